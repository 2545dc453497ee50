"""Weights: fill a meta-built Llama from safetensors or a seeded init, and write HF directories.

What it does
    `materialize` allocates a meta-device model (built by `model.build`, maybe already cut by pp.py
    and tp.py) and fills every parameter: from an HF safetensors directory (single file or sharded
    with `model.safetensors.index.json`), reading only this rank's slice of each tensor, or from the
    parameter's own named generator. `param_reader` gives the same values piece by piece without
    allocating the model — `read(name, start, stop)`, elements [start, stop) of a parameter's
    flattened local values — so zero.apply_zero(init=...) builds sharded state directly (reading
    from safetensors only the rows that hold those elements); `materialize_buffers` then allocates
    the buffers alone. `save_hf` writes full tensors as an HF directory that
    `AutoModelForCausalLM.from_pretrained` loads; `load_hf` reads one back whole.

Reference
    The safetensors format (huggingface/safetensors) and transformers' sharded-checkpoint index
    (`model.safetensors.index.json`, `weight_map`).

Run
    torchrun --nproc_per_node 2 train.py --tp 2 --init-from out/pretrained   # each rank reads its slices

Invariants
    - Init is a function of (seed, HF name) only: every parameter has its own generator, so the full
      weights never depend on creation order or on how tp/pp/ZeRO slice the model. A `model.Shard`
      map (from tp.py) says which slice of each global tensor a rank holds; only that slice is read.
      A seeded init draws a parameter's whole tensor (the generator's stream is the whole tensor):
      one parameter in full at a time, the most any build holds beyond its own state.
    - `to_empty` unties shared weights and leaves non-persistent buffers (RoPE `inv_freq`) as
      garbage that is only ~100 ULP wrong: `materialize` re-ties the one and recomputes the other.
    - A truncated, corrupt or mismatched file raises naming the file (or the tensor).

Builds on: model.py
"""
from __future__ import annotations

import json
import math
import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import Llama, LlamaConfig, Shard, build, global_shapes, load_config


def param_seed(seed: int, name: str) -> int:
    """Every parameter has its own generator, so init is independent of creation order and layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The full fp32 init of one parameter: norms 1, biases 0, matrices normal(0, std)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


@contextmanager
def open_safetensors(path: Path) -> Iterator:
    """safe_open with the file named in the error when it is truncated or not safetensors at all."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from None


class SafetensorsDir:
    """Read-only view of an HF safetensors directory: one file or sharded with an index."""

    def __init__(self, hf_dir: str | os.PathLike):
        d = Path(hf_dir)
        index, single = d / "model.safetensors.index.json", d / "model.safetensors"
        if index.is_file():
            self.files = {k: d / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            with open_safetensors(single) as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {d}")
        missing = sorted({str(p) for p in self.files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"safetensors shards listed in the index are missing: {missing}")

    def block(self, name: str, full_shape: tuple, index: tuple[slice, ...]) -> torch.Tensor:
        """tensor[index] of `name`, read from disk as that block only."""
        if name not in self.files:
            raise ValueError(f"{name} not found in the checkpoint")
        with open_safetensors(self.files[name]) as f:
            sl = f.get_slice(name)
            if tuple(sl.get_shape()) != tuple(full_shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(sl.get_shape())} != config {full_shape}")
            return sl[index]


def param_reader(model: Llama, seed: int = 0, hf_dir: str | None = None,
                 shards: dict[str, Shard] | None = None) -> Callable[[str, int, int], torch.Tensor]:
    """read(name, start, stop) → fp32 CPU tensor (stop - start,): elements [start, stop) of
    parameter `name`'s flattened local values — this rank's tp slice (`shards`), zero past the
    global size — from `hf_dir` (only the local rows holding them leave the file) or the seeded init
    (the whole tensor is drawn, then cut). The model may stay on the meta device: only names and
    shapes are read from it."""
    shards = shards or {}
    cfg = model.config
    shapes = global_shapes(cfg)
    local = {n: tuple(p.shape) for n, p in model.named_parameters()}
    src = SafetensorsDir(hf_dir) if hf_dir else None

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        # tied: lm_head is the embedding (a pipeline's last stage holds its own copy of it)
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and cfg.tie_word_embeddings else name
        shape, full, shard = local[name], shapes[key], shards.get(name)
        row = math.prod(shape[1:])  # elements per local row
        r0, r1 = start // row, -(-stop // row)  # the local rows holding [start, stop)
        index = [slice(None)] * len(full)  # the block of the global tensor behind those rows
        local_dim0 = shard is not None and shard.dim == 0
        g0 = r0 + (shard.start if local_dim0 else 0)
        index[0] = slice(min(g0, full[0]), min(g0 + r1 - r0, full[0]))
        if shard is not None and shard.dim > 0:
            index[shard.dim] = slice(min(shard.start, full[shard.dim]),
                                     min(shard.start + shard.size, full[shard.dim]))
        if src is not None:
            got = src.block(key, full, tuple(index))
        else:
            got = init_tensor(key, full, seed, cfg.initializer_range)[tuple(index)]
        rows = torch.zeros((r1 - r0, *shape[1:]))  # padding (past the global size) stays zero
        rows[tuple(slice(0, n) for n in got.shape)] = got
        return rows.reshape(-1)[start - r0 * row:stop - r0 * row]
    return read


@torch.no_grad()
def materialize_buffers(model: Llama, device: torch.device | str) -> Llama:
    """Allocate only the buffers (RoPE's inv_freq, recomputed): the parameters stay on the meta
    device for zero.apply_zero(init=param_reader(...)) to build sharded."""
    rotary = model.model.rotary_emb
    rotary.to_empty(device=device)
    rotary.reset_buffers()
    return model


@torch.no_grad()
def materialize(model: Llama, device: torch.device | str, seed: int = 0, hf_dir: str | None = None,
                shards: dict[str, Shard] | None = None) -> Llama:
    """Allocate a meta-built model on `device` and fill every parameter: from `hf_dir` (only this
    rank's slices are read) or from the named-seeded init. Then recompute the RoPE buffers."""
    read = param_reader(model, seed, hf_dir, shards)  # opens the checkpoint: errors before allocating
    # to_empty gives every module its own new Parameter, which silently unties shared weights
    # (tied embeddings): remember who shares what and re-tie afterwards
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod, attr))
    model.to_empty(device=device)
    for (mod0, attr0), *others in owners.values():
        for mod, attr in others:
            setattr(mod, attr, getattr(mod0, attr0))
    for name, p in model.named_parameters():
        p.copy_(read(name, 0, p.numel()).view_as(p))
    model.model.rotary_emb.reset_buffers()
    return model


def save_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig, out_dir: str | os.PathLike,
            max_shard_bytes: int = 4 << 30) -> None:
    """Write full (gathered) tensors as an HF dir: config.json + safetensors (sharded with an index
    when larger than max_shard_bytes). Tied models write no `lm_head.weight`. Every file is written
    under a temporary name and renamed, and config.json comes last: a fresh directory that has a
    config.json is complete (overwriting an older export in place is not atomic as a whole)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    expected = global_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"save_hf: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
    tensors = {k: state[k].detach().to("cpu").contiguous() for k in expected}
    shards, cur, size = [], {}, 0
    for k, t in tensors.items():
        if cur and size + t.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = t, size + t.nbytes
    shards.append(cur)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    writes = list(zip(names, shards))
    for n, s in writes:
        save_file(s, str(out / (n + ".tmp")), metadata={"format": "pt"})
        os.replace(out / (n + ".tmp"), out / n)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": {k: n for n, s in writes for k in s}}
        _write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2))
    d = cfg.to_hf()
    d["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    _write_text(out / "config.json", json.dumps(d, indent=2))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_hf(hf_dir: str | os.PathLike, device: torch.device | str = "cpu") -> Llama:
    """The whole model from an HF dir, on one device (fp32 as stored or upcast)."""
    return materialize(build(load_config(hf_dir)), device, hf_dir=str(hf_dir))


