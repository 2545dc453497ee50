"""LoRA: train a low-rank update of frozen linear layers (Hu et al. 2021).

What it does
    `apply_lora(model, rank, alpha, dropout, targets)` freezes every parameter of the model.
    Each target linear layer then gains two trained factors, lora_A (r, in) and lora_B (out, r).
    Its output becomes  y = W x + b + (alpha / r) · B A dropout(x).
    A starts Kaiming-uniform (PEFT's init) and B starts zero, so the model starts unchanged.
    `merge` folds (alpha / r) · B A into W; `unmerge` takes it out again.
    `adapters_off(model)` is a context in which the model is its frozen base.
    Models: attotron's Llama, transformers' decoders, any model whose linears `targets` names.

The core idea
    A forward hook adds the low-rank term to the layer's output.
    The layer keeps its class and its parameter names: `q_proj.weight` stays `q_proj.weight`.
    So loading, sharding, exporting and checkpointing the base are unchanged.
    The adapters are `q_proj.lora_A` and `q_proj.lora_B`. PEFT calls them
    `q_proj.lora_A.weight` and `q_proj.lora_B.weight` (`peft_state_dict` maps the names).

Reference
    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models".
    PEFT (huggingface/peft), tuners/lora/layer.py: the same init, scaling and forward.

Run
    torchrun --nproc_per_node 4 train.py --init-from DIR --sft --lora 8 --tp 2 --zero 3

Invariants
    - Forward, loss and adapter gradients equal PEFT's within 1e-5 (fp32), on transformers'
      Llama and on attotron's (tests/test_lora.py::test_lora_equals_peft).
    - merge then unmerge gives the base back; merged logits equal the adapted ones
      (test_lora.py::test_merge_unmerge_and_adapters_off).
    - Every layout equals one process (test_lora.py::test_lora_layouts_equal_one_process).
    - The PEFT export loads in PEFT with the same logits (test_lora.py::test_peft_export_roundtrip).
    - At ZeRO-3 the build holds the frozen base's shards plus one weight, never the whole base
      (test_lora.py::test_build_peak_of_a_frozen_base).

Refinements after their banners: tensor parallelism (each factor split as its weight);
the init of a meta model, layout-free; PEFT's file format.

Builds on: tp.py for the tensor-parallel refinement (imported only when a layer is split).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

# every attention and MLP projection of the Llama-like families (PEFT's names too)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS


def _targeted(name: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for a list of names: the module's name is one, or ends with '.' + one."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _lora_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The layer's output plus (alpha / r) · B A dropout(x)."""
    if module.lora_merged or not module.lora_on:
        return out
    x = module.lora_dropout(args[0])
    if module.lora_split is not None:  # a tensor-parallel layer (refinement below)
        return out + module.lora_scaling * _split_delta(module, x)
    return out + module.lora_scaling * F.linear(F.linear(x, module.lora_A), module.lora_B)  # (..., out)


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0,
               targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS) -> list[str]:
    """Freeze the model and give each targeted linear layer the factors lora_A and lora_B.
    targets: module names (the last dotted parts), as PEFT's target_modules.
    alpha: None means rank (scaling 1). Returns the adapted modules' names.
    A meta-device model gets meta factors: `reader` gives their values to whoever fills it."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
    alpha = rank if alpha is None else alpha
    found = [(n, m) for n, m in model.named_modules() if n and _targeted(n, tuple(targets))]
    bad = [f"{n} ({type(m).__name__})" for n, m in found if not _is_linear(m)]
    if bad:
        raise ValueError(f"LoRA targets name modules that are not linear layers: {', '.join(bad)}")
    if not found:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"LoRA targets {list(targets)} name no module of {type(model).__name__} "
                         f"(its linear layers: {names})")
    if any(hasattr(m, "lora_A") for _, m in found):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    splits = [_split_of(m) for _, m in found]  # raises before any change
    for p in model.parameters():
        p.requires_grad_(False)
    for (_, m), split in zip(found, splits):
        out_n, in_n = m.weight.shape  # this rank's
        kw = dict(device=m.weight.device, dtype=m.weight.dtype)
        m.lora_A = nn.Parameter(torch.empty(rank, in_n, **kw))
        m.lora_B = nn.Parameter(torch.empty(out_n, rank, **kw))
        m.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        m.lora_scaling, m.lora_rank, m.lora_alpha = alpha / rank, rank, alpha
        m.lora_on, m.lora_merged, m.lora_split = True, False, split
        m.register_forward_hook(_lora_hook)
        if not m.weight.is_meta:
            with torch.no_grad():  # PEFT's init: B = 0, so the model starts as its base
                nn.init.kaiming_uniform_(m.lora_A, a=math.sqrt(5))
                m.lora_B.zero_()
            if split is not None:
                _sync_replicated(m)
    return [n for n, _ in found]


def _is_linear(m: nn.Module) -> bool:
    """nn.Linear, or tp.py's split linears (a 2-D weight used as F.linear's)."""
    return isinstance(m, nn.Linear) or (hasattr(m, "shards") and getattr(m, "weight", None) is not None
                                        and m.weight.dim() == 2)


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A")]


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters' parameter names, in the model's order."""
    return [n for n, _ in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))]


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """W += (alpha / r) · B A in every adapted layer. The hook then adds nothing.
    Under tp each rank merges its own slice: B_r A (column layers), B A_r (row layers)."""
    for _, m in lora_modules(model):
        if "weight" not in m._parameters:
            raise ValueError(f"merge: {type(m).__name__}'s base weight is not a parameter (QLoRA's NF4)")
        if not m.lora_merged:
            m.weight += (m.lora_scaling * (m.lora_B.float() @ m.lora_A.float())).to(m.weight.dtype)
            m.lora_merged = True


@torch.no_grad()
def unmerge(model: nn.Module) -> None:
    """W -= (alpha / r) · B A: the base again (up to rounding in low precision)."""
    for _, m in lora_modules(model):
        if m.lora_merged:
            m.weight -= (m.lora_scaling * (m.lora_B.float() @ m.lora_A.float())).to(m.weight.dtype)
            m.lora_merged = False


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within: the frozen base model (no adapter term). A merged model cannot switch them off."""
    mods = [m for _, m in lora_modules(model)]
    if any(m.lora_merged for m in mods):
        raise ValueError("adapters_off: the adapters are merged into the weights; unmerge first")
    was = [m.lora_on for m in mods]
    for m in mods:
        m.lora_on = False
    try:
        yield
    finally:
        for m, on in zip(mods, was):
            m.lora_on = on


# --- refinement: tensor parallelism, each factor split as its weight
# A column layer holds rows of W: y_r = x W_r^T. Its update B A splits the same way: B_r A.
#   So B splits its rows. A is whole on every rank.
#   Each rank's A meets only its B_r, so A's gradient is a partial sum: A enters through f.
#   The layer's input x is in the region already (attotron's block-level f, or sp's gather).
#   tp.py's plain column layer applies f inside its forward, after this hook's input: the hook
#   applies it to x too.
# A row layer holds columns of W: y = g(sum_r x_r W_r^T). Its update splits its inner sum too:
#   B (sum_r A_r x_r). So A splits its columns, and B is whole after g (an r-wide all-reduce).
#   Under sequence parallelism g is a reduce-scatter: B then meets S/tp tokens, so B enters through f.
# Merging stays local: W_r += B_r A (column), W_r += B A_r (row).
@dataclass(frozen=True)
class Split:
    kind: str  # "column" or "row"
    group: object  # the tp group
    input_in_region: bool  # column: x is already behind f
    sequence_parallel: bool  # row: g is a reduce-scatter along the sequence


def _split_of(m: nn.Module) -> Split | None:
    """How a tp.py layer splits its weight, read from its Shard (dim 0: column, dim 1: row)."""
    if not hasattr(m, "shards") or getattr(m, "group", None) is None:
        return None
    import torch.distributed as dist
    if dist.get_world_size(m.group) == 1:
        return None
    import tp
    if isinstance(m, (tp.VocabParallelHead, tp.VocabParallelEmbedding)) or m.shards()["weight"].parts:
        raise ValueError(f"LoRA on a vocab-parallel or fused {type(m).__name__} is not supported")
    if m.shards()["weight"].dim == 0:
        return Split("column", m.group, isinstance(m, tp.ColumnParallelLinearInRegion), False)
    return Split("row", m.group, True, isinstance(m, tp.SequenceParallelRowLinear))


def _split_delta(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import tp
    s = m.lora_split
    if s.kind == "column":
        x = x if s.input_in_region else tp.copy_to_region(x, s.group)
        a = tp.copy_to_region(m.lora_A, s.group)  # whole A: its gradient summed over tp
        return F.linear(F.linear(x, a), m.lora_B)  # (..., out/tp)
    u = F.linear(x, m.lora_A)  # (..., r): this rank's part of A x
    if s.sequence_parallel:
        u = tp.reduce_scatter_to_sequence_region(u, s.group)  # (B, S/tp, r)
        return F.linear(u, tp.copy_to_region(m.lora_B, s.group))  # (B, S/tp, out)
    return F.linear(tp.reduce_from_region(u, s.group), m.lora_B)  # (..., out)


def shards(model: nn.Module) -> dict:
    """{adapter name: tp.Shard} for the split factors: B's rows of a column layer, A's columns of
    a row layer. The whole factors are left out, as tp.apply_tp leaves out replicated weights."""
    out = {}
    for n, m in lora_modules(model):
        s = m.lora_split
        if s is not None:
            import tp
            w = m.shards()["weight"]
            out[f"{n}.lora_B" if s.kind == "column" else f"{n}.lora_A"] = tp.Shard(w.dim, w.start, w.size)
    return out


@torch.no_grad()
def _sync_replicated(m: nn.Module) -> None:
    """A materialized tp layer: the whole factor starts equal on every rank (tp rank 0's)."""
    import torch.distributed as dist
    whole = m.lora_A if m.lora_split.kind == "column" else m.lora_B
    dist.broadcast(whole, dist.get_global_rank(m.group, 0), group=m.group)


# --- refinement: the init of a meta model, layout-free
# A trainer builds on the meta device and fills each parameter from a reader (weights.param_reader).
# The adapters' values must not depend on the layout: A is drawn whole from a generator seeded by
# its name, then cut to this rank's slice; B is zero.
# The frozen base first takes the compute dtype, still on meta (frozen_dtype).
# Stages 0-2 then fill it whole on every rank (materialize_frozen): they replicate it anyway.
# ZeRO-3 reads each rank's shard instead, one weight at a time (zero3.py): a 70B base never lands whole.
def full_shape(model: nn.Module, name: str) -> tuple[int, int]:
    """The global (unsplit) shape of adapter `name`."""
    m = model.get_submodule(name.rsplit(".", 1)[0])
    shape = list(getattr(m, name.rsplit(".", 1)[1]).shape)
    if m.lora_split is not None:
        import torch.distributed as dist
        tp = dist.get_world_size(m.lora_split.group)
        if name.endswith("lora_B") and m.lora_split.kind == "column":
            shape[0] *= tp
        if name.endswith("lora_A") and m.lora_split.kind == "row":
            shape[1] *= tp
    return tuple(shape)


def initial_value(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """The full fp32 start of adapter `name`: A Kaiming-uniform (PEFT's a = sqrt(5): bound
    1 / sqrt(in)), drawn from (seed, name); B zeros."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def local_value(model: nn.Module, name: str, full: torch.Tensor, split_shards: dict) -> torch.Tensor:
    """This rank's slice of a full adapter tensor."""
    s = split_shards.get(name)
    return full if s is None else full.narrow(s.dim, s.start, s.size)


Reader = Callable[[str, int, int], torch.Tensor]


def adapter_shapes(base_shapes: dict[str, tuple[int, ...]], rank: int,
                   targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The full shapes of every adapter of a model whose weights have `base_shapes` (HF name →
    shape, e.g. model.global_shapes): A (r, in) and B (out, r) of each targeted weight. A pipeline
    stage holds some of them; a checkpoint lists them all."""
    out = {}
    for name, shape in base_shapes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(shape) == 2 and _targeted(module, tuple(targets)):
            out |= {f"{module}.lora_A": (rank, shape[1]), f"{module}.lora_B": (shape[0], rank)}
    return out


def reader(model: nn.Module, base: Reader, seed: int, adapters: dict[str, torch.Tensor] | None = None) -> Reader:
    """A parameter reader (weights.param_reader's shape) that also gives the adapters' values:
    from `adapters` (full tensors, e.g. `load_peft`), else `initial_value`."""
    split = shards(model)
    names = set(adapter_names(model))

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        if name not in names:
            return base(name, start, stop)
        full = adapters[name] if adapters is not None else initial_value(name, full_shape(model, name), seed)
        return local_value(model, name, full.float(), split).reshape(-1)[start:stop]
    return read


def frozen_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every frozen meta parameter `dtype`, still on the meta device.
    Whoever fills it later reads that dtype: materialize_frozen, or ZeRO-3's frozen units.
    Tied weights stay tied: the Parameter object keeps its identity."""
    for p in model.parameters():
        if p.is_meta and not p.requires_grad:
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=False))


@torch.no_grad()
def materialize_frozen(model: nn.Module, read: Reader, device: torch.device | str) -> None:
    """Fill every frozen meta parameter from `read`, whole, in its own dtype (the optimizer fills the trained ones).
    Stages 0-2 hold the whole base anyway. ZeRO-3 skips this: it reads each rank's shard (zero3.py)."""
    for name, p in model.named_parameters():
        if p.is_meta and not p.requires_grad:
            value = read(name, 0, p.numel()).to(device, p.dtype).view(p.shape)
            torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=False))


# --- refinement: PEFT's file format
# adapter_config.json and adapter_model.safetensors. The keys are the module's full name with
# `base_model.model.` in front and `.weight` after: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
def peft_key(name: str) -> str:
    return f"base_model.model.{name}.weight"


def from_peft_key(key: str) -> str:
    return key.removeprefix("base_model.model.").removesuffix(".weight")


def peft_config(cfg: LoraConfig, base_model: str | None = None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model}


def save_peft(adapters: dict[str, torch.Tensor], cfg: LoraConfig, out_dir: str | os.PathLike,
              base_model: str | None = None) -> None:
    """Write full adapter tensors {our name: tensor} as a PEFT adapter folder."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(cfg, base_model), f, indent=2)
    save_file({peft_key(n): t.detach().contiguous().cpu() for n, t in adapters.items()},
              os.path.join(out_dir, "adapter_model.safetensors"))


@torch.no_grad()
def gather_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full adapter tensor} of this model (a pipeline stage: its own layers), on every tp rank.
    Split factors are all-gathered over their layer's tp group."""
    split, out = shards(model), {}
    for n, p in model.named_parameters():
        if n.endswith((".lora_A", ".lora_B")):
            s = split.get(n)
            if s is None:
                out[n] = p.detach().clone()
            else:
                import torch.distributed as dist
                import tp
                group = model.get_submodule(n.rsplit(".", 1)[0]).lora_split.group
                out[n] = tp.gather_tensor(p, s, p.shape[s.dim] * dist.get_world_size(group), group)
    return out


def load_peft(in_dir: str | os.PathLike) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder → (its config, {our name: full tensor}). Features we lack raise."""
    from safetensors.torch import load_file
    path = os.path.join(in_dir, "adapter_config.json")
    with open(path) as f:
        c = json.load(f)
    bad = [f"{k}={c.get(k)!r}" for k, ok in (("peft_type", "LORA"), ("bias", "none"), ("use_dora", False),
                                             ("use_rslora", False), ("fan_in_fan_out", False))
           if c.get(k, ok) != ok]
    if c.get("modules_to_save") or c.get("rank_pattern") or c.get("alpha_pattern"):
        bad.append("modules_to_save / rank_pattern / alpha_pattern")
    if bad:
        raise ValueError(f"{path}: unsupported PEFT adapter settings: {', '.join(bad)}")
    targets = c["target_modules"]
    if isinstance(targets, str):  # PEFT reads a string as a regular expression over module names
        raise ValueError(f"{path}: target_modules {targets!r} is a regular expression; only a list of names is supported")
    targets = tuple(targets)
    cfg = LoraConfig(c["r"], c["lora_alpha"], c.get("lora_dropout", 0.0), targets)
    tensors = load_file(os.path.join(in_dir, "adapter_model.safetensors"))
    return cfg, {from_peft_key(k): v for k, v in tensors.items()}
