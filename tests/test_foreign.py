"""ac.py, zero.py + zero3.py, cp.py copied ALONE into another project, on models attotron did not write.

Each check runs in a forked process (tests/dist.py run_alone) that has forgotten every module of
this repository and imports only from a folder holding the copied file(s) (the ones the file's
"Builds on:" line names), this file, tests/dist.py and tests/foreign_models.py; the repository
root is not importable there (main() asserts it). Models: transformers' own
LlamaForCausalLM (Qwen2 and Mistral too) and foreign_models.GPT (fused qkv, LayerNorm, GELU,
learned positions, tied head; described by dotted paths). References: the same model trained in
one process, on the whole global batch, with torch's own AdamW and clip_grad_norm_.

Tolerances, and why:
- fp32, every layout: 1e-5 relative (losses; gradients and parameters relative to the largest one).
  AC reruns the same kernels on the same inputs (measured: bit-identical); dp, ZeRO and CP only sum
  the same terms in another order (2-rank sums, the ring's log-sum-exp merges: measured <= 1e-6).
  AdamW runs with eps = 1e-5 there (`_optim`: at 1e-8 Adam turns that order noise on a gradient
  that is ~0 into a step of O(lr)); a wrong gradient (one rank's rows) misses by >= 4e-3.
- bf16 compute, fp32 master (every ZeRO stage at dp = 2 against the single-process run of the same
  recipe, precision.MixedPrecisionOptimizer): one step. The loss is the fp32 sum of the same
  per-token values (bf16 kernels, row by row): 1e-4. AdamW's first step moves every weight by
  lr·g/(|g| + eps) ≈ ±lr whatever |g|, so two runs whose bf16 gradients differ by rounding differ
  only where a tiny gradient flips sign: at most 2·lr + one bf16 step of the weight, on under 2% of
  the elements (a run with half the gradient, or no step at all, fails that by far).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F

from dist import run_alone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LR = 1e-2
FILES = {"ac": ["ac.py"], "zero": ["zero.py", "zero3.py", "dp.py", "precision.py"], "cp": ["cp.py"]}
GPT_PARTS = dict(embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f", head="lm_head")


def isolated(check: str, timeout: float = 300.0) -> dict:
    """Run `check` where only a temp folder holding FILES[check] and the helpers is importable."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in FILES[check]:
            shutil.copy(os.path.join(ROOT, f), tmp)
        for f in ("dist.py", "foreign_models.py", "test_foreign.py"):
            shutil.copy(os.path.join(HERE, f), tmp)
        return run_alone([tmp], "test_foreign", "main", check, timeout=timeout)


def main(check: str) -> dict:
    import importlib.util
    assert all(importlib.util.find_spec(m) is None for m in ("model", "train", "weights")), \
        "the repository root is importable: this check would prove nothing"
    torch.set_num_threads(1)
    return {"ac": _ac, "zero": _zero, "cp": _cp}[check]()


# ------------------------------------------------------------------------------------- helpers
def _make(name: str, **kw) -> torch.nn.Module:
    """"gpt", "gpt-scaled", or a transformers family ("qwen2-tied": its head tied to the embedding)."""
    from foreign_models import GPT, hf_causal_lm
    if name == "gpt":
        return GPT()
    if name == "gpt-scaled":
        return _ScaledGPT()
    family, _, tied = name.partition("-")
    return hf_causal_lm(family, **({"tie_word_embeddings": True} if tied else {}), **kw)


def _ScaledGPT() -> torch.nn.Module:
    """The GPT with a bare parameter of the model itself (outside every part), read by its forward."""
    from foreign_models import GPT

    class ScaledGPT(GPT):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((1,), 1.5))

        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
            logits, loss = super().forward(idx, targets)
            return logits * self.scale, loss
    return ScaledGPT()


def _logits(model: torch.nn.Module, x: torch.Tensor, **kw) -> torch.Tensor:
    if hasattr(model, "transformer"):  # the GPT: (logits, loss); the loss is ignored, computed below
        return model(x, x.contiguous())[0]
    return model(input_ids=x, use_cache=False, **kw).logits  # a ModelOutput


def _loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, **kw) -> torch.Tensor:
    return F.cross_entropy(_logits(model, x, **kw).flatten(0, 1).float(), y.flatten(), reduction="sum")


def _data(steps: int = 2, rows: int = 4, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 97, (rows, seq + 1), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in ids]  # labels already shifted


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference relative to the largest reference value (per list)."""
    scale = max(t.abs().max().item() for t in b)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)) / scale


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ------------------------------------------------------------------------------------- ac.py
def _ac() -> dict:
    import ac as AC
    x, y = _data(1)[0]
    out = {}
    for name in ("llama", "qwen2", "mistral", "gpt"):
        layers = "transformer.h" if name == "gpt" else None
        ref = _make(name)
        with AC.SavedActivationMeter() as meter:
            loss = _loss_sum(ref, x, y)
        loss.backward()
        out[f"{name}/none/saved"] = meter.nbytes
        ref_grads = [p.grad for p in ref.parameters()]
        for mode in AC.MODES:
            m = _make(name)
            AC.apply_ac(m, mode, layers=layers)
            out[f"{name}/{mode}/layers"] = sorted(AC.checkpointed(m, layers), key=int)
            with AC.SavedActivationMeter() as meter:
                loss_ac = _loss_sum(m, x, y)
            loss_ac.backward()
            out[f"{name}/{mode}/saved"] = meter.nbytes
            out[f"{name}/{mode}/loss"] = abs(loss_ac.item() - loss.item()) / loss.item()
            out[f"{name}/{mode}/grads"] = _rel([p.grad for p in m.parameters()], ref_grads)
            AC.remove_ac(m, layers)
            out[f"{name}/{mode}/removed"] = AC.checkpointed(m, layers) == {}
    gpt = _make("gpt")
    AC.apply_ac(gpt, "full", every=2, layers="transformer.h")
    out["gpt/every2"] = sorted(AC.checkpointed(gpt, "transformer.h"), key=int)
    out["error/no layers"] = _error(lambda: AC.apply_ac(_make("gpt"), "full"))
    out["error/not a list"] = _error(lambda: AC.apply_ac(_make("gpt"), "full", layers="transformer.wte"))
    hf = _make("llama")
    AC.apply_ac(hf, "full")
    out["error/kv cache"] = _error(lambda: hf(input_ids=x, use_cache=True))
    return out


def test_ac_full_and_selective_copied_alone():
    """apply_ac on transformers' Llama, Qwen2, Mistral and the GPT: the loss and gradients of the plain
    model; less saved for backward (selective < none, full < selective); clear errors."""
    out = isolated("ac")
    for name in ("llama", "qwen2", "mistral", "gpt"):
        for mode in ("full", "selective"):
            assert out[f"{name}/{mode}/layers"] == ["0", "1", "2", "3"], (name, mode)
            assert out[f"{name}/{mode}/loss"] <= 1e-5 and out[f"{name}/{mode}/grads"] <= 1e-5, (name, mode, out)
            assert out[f"{name}/{mode}/removed"]
        assert out[f"{name}/full/saved"] < out[f"{name}/selective/saved"] < out[f"{name}/none/saved"], (name, out)
    assert out["gpt/every2"] == ["0", "2"]
    assert "pass layers=" in out["error/no layers"]
    assert "ModuleList" in out["error/not a list"]
    assert "use_cache=False" in out["error/kv cache"]


# ------------------------------------------------------------------------------------- zero*.py
def _optim(dtype: torch.dtype):
    """AdamW's settings. fp32: eps = 1e-5, not 1e-8. Adam divides by |g| + eps, so a gradient that
    differs by δg (the summation order: ~1e-9 here) moves a weight by up to lr·δg/eps: 1e-4 of lr
    at 1e-5, but O(lr) at 1e-8 for weights whose gradient is ~0 (a key bias). A wrong gradient (one
    rank's rows only) still moves the weights by ~lr."""
    import precision as P
    return P.OptimConfig(lr=LR, eps=1e-5 if dtype == torch.float32 else 1e-8)


def _reference(name: str, data: list, dtype: torch.dtype) -> tuple[list[float], list[torch.Tensor]]:
    """The single process on the whole global batch: torch's AdamW (fp32), or the same mixed-precision
    recipe (bf16: precision.MixedPrecisionOptimizer, fp32 masters)."""
    import precision as P
    m = _make(name)
    cfg = _optim(dtype)
    if dtype == torch.float32:
        groups = [[p for p in m.parameters() if p.ndim >= 2], [p for p in m.parameters() if p.ndim < 2]]
        opt = torch.optim.AdamW([{"params": groups[0], "weight_decay": cfg.weight_decay},
                                 {"params": groups[1], "weight_decay": 0.0}],
                                lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    else:
        opt = P.MixedPrecisionOptimizer(m.named_parameters(), cfg, dtype)
    losses = []
    for x, y in data:
        loss = _loss_sum(m, x, y) / y.numel()
        loss.backward()
        losses.append(loss.item())
        if dtype == torch.float32:
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad()
        else:
            opt.step(LR)
    return losses, [p.detach().clone() for p in m.parameters()]


def _zero_run(name: str, stage: int, data: list, dtype: torch.dtype, rank: int, world: int) -> tuple:
    import precision as P
    import zero3 as Z3
    import torch.distributed as dist
    m = _make(name)
    parts = GPT_PARTS if name.startswith("gpt") else {}
    opt = Z3.apply_zero(m, stage, None, _optim(dtype), dtype, bucket_mb=0.01, **parts)
    losses = []
    for x, y in data:
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)  # this dp rank's rows
        loss = _loss_sum(m, x[rows], y[rows]) / y.numel()  # normalised by the GLOBAL target count
        loss.backward()
        opt.step(LR)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    with opt.gathered():
        params = [p.detach().clone() for p in m.parameters()]
    units = len(opt.buckets) if stage == 3 else None
    masters = {str(t.dtype) for t in opt.master}
    opt.teardown()
    return losses, params, units, masters


def _zero_rank(rank: int, world: int) -> dict:
    import precision as P
    import zero3 as Z3
    out = {}
    data = _data(2)
    for name, stages in (("llama", (0, 1, 2, 3)), ("gpt", (0, 1, 2, 3)), ("qwen2-tied", (3,)), ("mistral", (3,)),
                         ("gpt-scaled", (3,))):
        ref_losses, ref_params = _reference(name, data, torch.float32)
        for stage in stages:
            losses, params, units, _ = _zero_run(name, stage, data, torch.float32, rank, world)
            out[f"{name}/{stage}/loss"] = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
            out[f"{name}/{stage}/params"] = _rel(params, ref_params)
            if units is not None:
                out[f"{name}/units"] = units
    one = data[:1]
    for name in ("llama", "gpt"):
        ref_losses, ref_params = _reference(name, one, torch.bfloat16)
        ref_init = [p.detach().to(torch.bfloat16) for p in _make(name).parameters()]
        for stage in (0, 1, 2, 3):
            losses, params, _, masters = _zero_run(name, stage, one, torch.bfloat16, rank, world)
            diff = torch.cat([(a.float() - b.float()).abs().flatten() for a, b in zip(params, ref_params)])
            ulp = torch.cat([torch.finfo(torch.bfloat16).eps * b.float().abs().flatten() for b in ref_params])
            out[f"bf16/{name}/{stage}"] = {
                "loss": abs(losses[0] - ref_losses[0]) / ref_losses[0],
                "max": (diff - ulp).max().item() / LR,  # in units of lr, beyond one bf16 step
                "differ": (diff > LR / 2).float().mean().item(),  # fraction of weights moved otherwise
                "moved": _rel(params, ref_init) > 0, "dtypes": [str(params[0].dtype), sorted(masters)]}
    out["error/undescribed"] = _error(lambda: Z3.apply_zero(_make("gpt"), 3, None, P.OptimConfig()))
    odd = _OddLayers()  # its layer returns an object ZeRO-3 cannot find the output tensor in
    opt = Z3.apply_zero(odd, 3, None, P.OptimConfig(), layers="layers")
    out["error/no output tensor"] = _error(lambda: odd(torch.ones(2, 4)))
    opt.teardown()
    out["error/no layers"] = _error(lambda: Z3.apply_zero(_make("gpt"), 1, None, P.OptimConfig(),
                                                          embed="transformer.wte"))
    return out


class _OddLayers(torch.nn.Module):
    class Layer(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> object:
            return type("Out", (), {"h": super().forward(x)})()

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([self.Layer(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x).h


def test_dp_and_zero_stages_copied_alone():
    """dp (stage 0: dp.GradSync) and ZeRO-1/2/3 at dp = 2 on transformers' Llama and the GPT (Qwen2
    with a tied head, Mistral: stage 3), fp32 and bf16 + fp32 masters, against the single process;
    the GPT's learned position embedding is a unit of its own; what ZeRO cannot follow raises."""
    for out in isolated("zero"):
        for name, stages in (("llama", (0, 1, 2, 3)), ("gpt", (0, 1, 2, 3)), ("qwen2-tied", (3,)),
                             ("mistral", (3,)), ("gpt-scaled", (3,))):
            for stage in stages:
                assert out[f"{name}/{stage}/loss"] <= 1e-5 and out[f"{name}/{stage}/params"] <= 1e-5, \
                    (name, stage, out)
        assert out["gpt/units"] == 7  # wte (tied to the head), wpe, 4 layers, ln_f + lm_head
        assert out["gpt-scaled/units"] == 8  # + the model's own `scale`
        assert out["llama/units"] == out["mistral/units"] == out["qwen2-tied/units"] == 6
        for name in ("llama", "gpt"):
            for stage in (0, 1, 2, 3):
                r = out[f"bf16/{name}/{stage}"]
                assert r["loss"] <= 1e-4 and r["max"] <= 2.0 and r["differ"] <= 0.02 and r["moved"], (name, stage, r)
                assert r["dtypes"] == ["torch.bfloat16", ["torch.float32"]]
        assert "name its parts" in out["error/undescribed"]
        assert "layers=" in out["error/no layers"]
        assert "returned no tensor that requires grad" in out["error/no output tensor"]


# ------------------------------------------------------------------------------------- cp.py
def _cp_rank(rank: int, world: int) -> dict:
    import cp as C
    import torch.distributed as dist
    out = {}
    # ring_attention(group=None) is the ring over the default group, not local attention
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, 8, generator=g)
    k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    local = [C.shard_sequence(t, world, rank, dim=2) for t in (q, k, v)]
    want = C.shard_sequence(ref, world, rank, dim=2)
    out["ring/default"] = _rel([C.ring_attention(*local)], [want])
    out["ring/None"] = _rel([C.ring_attention(*local, group=None)], [want])
    out["ring/local attention"] = _rel([F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=True)],
                                       [want])
    # whole models: loss and gradients (summed over the cp ranks) against the single process
    x, y = _data(1, rows=2)[0]
    for name in ("llama", "qwen2", "mistral", "gpt"):
        ref_model = _make(name)
        loss = _loss_sum(ref_model, x, y) / y.numel()
        loss.backward()
        m = _make(name)
        C.apply_cp(m, None, **(dict(layers="transformer.h", attention="attn", positions="transformer.wpe")
                               if name == "gpt" else {}))
        xs, ys = (C.shard_sequence(t, world, rank) for t in (x, y))
        mine = _loss_sum(m, xs, ys) / y.numel()  # the GLOBAL target count
        mine.backward()
        total = mine.detach().clone()
        dist.all_reduce(total)
        grads = [p.grad for p in m.parameters()]
        for grad in grads:
            dist.all_reduce(grad)
        out[f"{name}/loss"] = abs(total.item() - loss.item()) / loss.item()
        out[f"{name}/grads"] = _rel(grads, [p.grad for p in ref_model.parameters()])
    xs = C.shard_sequence(x, world, rank)

    def cp_model(name: str, **kw) -> torch.nn.Module:
        m = _make(name, **kw)
        C.apply_cp(m, None)
        return m
    out["error/sliding window"] = _error(lambda: _logits(cp_model("mistral", sliding_window=8), xs))
    out["error/position_ids"] = _error(lambda: _logits(cp_model("llama"), xs, position_ids=torch.arange(8)[None]))
    out["error/padding"] = _error(lambda: _logits(cp_model("llama"), xs, attention_mask=torch.zeros_like(xs)))
    odd = cp_model("llama")  # one layer's attention no longer goes through transformers' interface
    odd.model.layers[1].self_attn.forward = lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None)
    out["error/not the interface"] = _error(lambda: _logits(odd, xs))
    out["error/undescribed"] = _error(lambda: C.apply_cp(_make("gpt"), None))
    out["error/no positions"] = _error(lambda: C.apply_cp(_make("gpt"), None, layers="transformer.h",
                                                          attention="attn"))
    gpt = _make("gpt")
    C.apply_cp(gpt, None, layers="transformer.h", attention="mlp", positions="transformer.wpe")
    out["error/not sdpa"] = _error(lambda: _logits(gpt, xs))
    return out


def test_cp_copied_alone():
    """cp.py alone at cp = 2 on the default group: ring_attention(group=None) is the ring; apply_cp on
    transformers' Llama, Qwen2, Mistral (the attention interface, global position_ids) and the GPT
    (described: its SDPA call, its learned positions) equals the single process; what the ring cannot
    compute raises."""
    for out in isolated("cp"):
        assert out["ring/default"] <= 1e-5 and out["ring/None"] <= 1e-5, out
        assert out["ring/local attention"] > 1e-2, out  # what group=None used to compute
        for name in ("llama", "qwen2", "mistral", "gpt"):
            assert out[f"{name}/loss"] <= 1e-5 and out[f"{name}/grads"] <= 1e-5, (name, out)
        assert "sliding_window=8" in out["error/sliding window"]
        assert "without position_ids" in out["error/position_ids"]
        assert "attention mask" in out["error/padding"]
        assert "3 of 4 attention layers" in out["error/not the interface"]
        assert "pass layers=" in out["error/undescribed"]
        assert "positions=" in out["error/no positions"]
        assert "without calling F.scaled_dot_product_attention" in out["error/not sdpa"]


def _ranks(fn):
    def run() -> list:
        from dist import run_ranks
        return run_ranks(fn, 2)
    return run


_zero, _cp = _ranks(_zero_rank), _ranks(_cp_rank)
