"""ac.py against independent references.

- Gradients and loss: the same model without AC (same weights, same batch, fp32). They must be equal
  BIT FOR BIT (torch.equal): the recompute runs the same kernels on the same inputs in the same order,
  and selective mode's rerun of a cheap module gives the very values the forward computed. The tp=2 run compares against
  tp=2 without AC, also bit for bit (2-rank gloo sums are a fixed order, identical in both runs).
- Memory: SavedActivationMeter's counts against byte counts derived independently — from the no-AC
  measurement of ONE layer and the sizes of the layer inputs, and from the per-layer formulas in ac.py's
  docstring (counted by hand from the layer's ops). Every gradient check also asserts that AC really
  saved memory, so it cannot pass with AC silently off.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import set_checkpoint_debug_enabled
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ac import SavedActivationMeter, apply_ac, checkpointed, remove_ac
from dist import run_ranks
from model import PRESETS, LlamaConfig, build
from weights import materialize

CFG = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=4)  # h 64, 4 heads, 2 kv, i 176
B, S = 2, 16
MODES = [("full", 1), ("selective", 1), ("full", 2), ("selective", 2)]


def make_model(cfg: LlamaConfig = CFG) -> nn.Module:
    return materialize(build(cfg), "cpu", seed=0)


def batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
    labels[:, :3] = -100
    # three documents per row (5 + 7 + 4 tokens): block-diagonal attention, restarted RoPE
    pos = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).expand(B, S) if packed else None
    return ids, pos, labels


def grads(model: nn.Module, packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, every parameter's gradient, and the activation bytes the forward left for backward."""
    model.zero_grad(set_to_none=True)
    ids, pos, labels = batch(packed)
    with SavedActivationMeter() as meter:
        loss = model(ids, position_ids=pos, labels=labels, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, meter.nbytes


@pytest.mark.parametrize("packed", [False, True])
def test_gradients_bit_identical(packed):
    model = make_model()
    ref_loss, ref, ref_bytes = grads(model, packed)
    for mode, every in MODES:
        apply_ac(model, mode, every)
        assert checkpointed(model) == {str(i): mode for i in range(0, CFG.num_hidden_layers, every)}
        loss, got, nbytes = grads(model, packed)
        remove_ac(model)
        assert nbytes < ref_bytes, (mode, every)  # AC was really on
        assert torch.equal(loss, ref_loss), (mode, every)
        for name, g in ref.items():
            assert torch.equal(got[name], g), (mode, every, name)


def test_names_unchanged_remove_restores_and_bad_input():
    model = make_model()
    state = model.state_dict()
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    ids = batch(packed=False)[0]
    with torch.no_grad():
        plain_logits = model(ids)
    apply_ac(model, "selective")
    assert list(model.state_dict()) == list(state)
    assert [n for n, _ in model.named_parameters()] == names
    assert [n for n, _ in model.named_modules()] == modules
    model.load_state_dict(state)  # strict: a checkpoint of the plain model loads into the AC model
    with torch.no_grad():  # eval / generate: checkpoint just runs the layer
        assert torch.equal(model(ids), plain_logits)
    with pytest.raises(ValueError, match=r"already applied to layers \['0', '1', '2', '3'\]"):
        apply_ac(model, "full")
    remove_ac(model)
    assert checkpointed(model) == {}
    assert all("forward" not in layer.__dict__ for layer in model.model.layers.values())
    with pytest.raises(ValueError, match="'fast' is not one of"):
        apply_ac(model, "fast")
    with pytest.raises(ValueError, match="every=0"):
        apply_ac(model, "full", every=0)
    assert checkpointed(model) == {}  # rejected before wrapping anything
    # a pipeline stage holding layers 2 and 3 only: every-k counts global indices
    for drop in ("0", "1"):
        del model.model.layers[drop]
    apply_ac(model, "full", every=2)
    assert checkpointed(model) == {"2": "full"}
    remove_ac(model)
    apply_ac(model, "full", every=3)
    assert checkpointed(model) == {"3": "full"}


def layer_stack_bytes(model: nn.Module, n_layers: int, mode: str | None, every: int = 1,
                      ) -> tuple[SavedActivationMeter, dict[str, int]]:
    """Meter a forward through the first n_layers decoder layers (no embedding, head or loss)."""
    if mode:
        apply_ac(model, mode, every)
    x = torch.randn(B, S, CFG.hidden_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
    cos, sin = model.model.rotary_emb(torch.arange(S).expand(B, S), x.dtype)  # (B, S, hd) each
    with SavedActivationMeter() as meter:
        h = x
        for i in range(n_layers):
            h = model.model.layers[str(i)](h, cos, sin, None)
    if mode:
        remove_ac(model)
    return meter, {"input": x.nbytes, "shared": cos.nbytes + sin.nbytes}


def test_saved_bytes_bounds():
    model, L = make_model(), CFG.num_hidden_layers
    one, size = layer_stack_bytes(model, 1, None)
    act, x, shared = one.nbytes, size["input"], size["shared"]  # cos/sin: one copy for all layers
    none = layer_stack_bytes(model, L, None)[0]
    full = layer_stack_bytes(model, L, "full")[0]
    sel = layer_stack_bytes(model, L, "selective")[0]
    every2 = layer_stack_bytes(model, L, "full", every=2)[0]
    assert none.nbytes == L * (act - shared) + shared  # the meter: unique storages, nothing twice
    # full: every layer keeps only its input. The bound of the issue adds one layer's activations: the
    # recompute of the layer in backward (held by checkpoint's own hooks, outside any meter)
    assert full.nbytes == L * x + shared <= L * x + act
    assert full.nbytes < sel.nbytes < none.nbytes
    # every 2nd layer (0 and 2) checkpointed: half the layers keep everything, half only their input
    assert every2.nbytes == (L // 2) * (act - shared) + (L // 2) * x + shared
    assert full.nbytes < every2.nbytes < none.nbytes
    # selective: the same tensors minus the outputs of the two norms and SwiGLU (ac.py's docstring)
    h, i = CFG.hidden_size, CFG.intermediate_size
    assert sel.nbytes == none.nbytes - L * B * S * 4 * (2 * h + i)
    # autograd holds the weights only for layers that full AC does not checkpoint (selective runs the
    # layer as without AC: views whose storage ZeRO-3 resizes to 0 bytes after the forward)
    layer_params = sum(p.nbytes for p in model.model.layers["0"].parameters())
    assert (none.param_nbytes, full.param_nbytes, sel.param_nbytes, every2.param_nbytes) == (
        L * layer_params, 0, L * layer_params, (L // 2) * layer_params)
    assert none.peak_nbytes == none.nbytes  # forward only: everything saved is still held


def formula_bytes(cfg: LlamaConfig, b: int, s: int, dtype: torch.dtype, mode: str | None) -> int:
    """ac.py's docstring formulas (bytes one layer keeps), counted by hand from the layer's ops."""
    h, a, i = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    gh = cfg.num_key_value_heads * cfg.head_dim  # g·h (head_dim may differ from h/a)
    qh = a * cfg.head_dim  # width of q and of the attention output (= h for the presets)
    t, e = s * b, dtype.itemsize
    lse, rstd = 4 * t * a, 2 * 4 * t  # fp32: per head, per norm
    # x, norm output, residual sum, norm output; q, k, v, attention output; gate, up, product
    none = e * t * (4 * h + 2 * qh + 2 * gh + 3 * i) + lse + rstd
    return {None: none, "selective": none - e * t * (2 * h + i), "full": e * t * h}[mode]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_docstring_formulas(dtype):
    for cfg, s in ((dataclasses.replace(PRESETS["tiny"], num_hidden_layers=1), 16),
                   (dataclasses.replace(PRESETS["small"], num_hidden_layers=1), 64)):
        layer = materialize(build(cfg), "cpu").to(dtype)
        x = torch.randn(1, s, cfg.hidden_size, dtype=dtype, requires_grad=True)
        cos, sin = layer.model.rotary_emb(torch.arange(s)[None], dtype)
        for mode in (None, "selective", "full"):
            if mode:
                apply_ac(layer, mode)
            with SavedActivationMeter() as meter:
                layer.model.layers["0"](x, cos, sin, None)
            if mode:
                remove_ac(layer)
            assert meter.nbytes == formula_bytes(cfg, 1, s, dtype, mode) + cos.nbytes + sin.nbytes, mode


def test_meter_releases_with_autograd():
    model = make_model()
    for mode in (None, "selective", "full"):
        if mode:
            apply_ac(model, mode)
        with SavedActivationMeter() as meter:
            loss = model(*batch(packed=False), reduction="sum")  # no input stays referenced here
        held = meter.live_nbytes
        assert held == meter.nbytes == meter.peak_nbytes > 0
        loss.backward()  # autograd frees what it saved, the selective cache included
        assert meter.live_nbytes == 0 and meter.peak_nbytes == held, mode
        if mode:
            remove_ac(model)


def test_never_debug_mode():
    """checkpoint(debug=True) runs the layer under a Python LoggingTensorMode (orders of magnitude
    slower). A probe inside the layer sees the dispatch-mode stack: empty for full AC and for
    selective AC (no Python per op in eager) — and, as a control that the probe can fail, the debug
    mode when checkpoint debugging is forced on globally."""
    model = make_model()
    seen: list[list[str]] = []
    probe = model.model.layers["1"].self_attn.q_proj.register_forward_pre_hook(
        lambda mod, args: seen.append([type(m).__name__ for m in _get_current_dispatch_mode_stack()]))
    for mode in ("full", "selective"):
        apply_ac(model, mode)
        seen.clear()
        grads(model, packed=False)
        remove_ac(model)
        assert len(seen) == (2 if mode == "full" else 1)  # forward (and full AC's recompute)
        assert all(stack == [] for stack in seen), (mode, seen)
    apply_ac(model, "full")
    seen.clear()
    with set_checkpoint_debug_enabled(True):
        grads(model, packed=False)
    remove_ac(model)
    probe.remove()
    assert "LoggingTensorMode" in seen[0]


def test_hooks_layer_once_submodules_again():
    model = make_model()
    layer = model.model.layers["2"]
    calls = {"layer": 0, "q_proj": 0, "mlp": 0}

    def count(key):
        return lambda mod, args: calls.__setitem__(key, calls[key] + 1)
    handles = [layer.register_forward_pre_hook(count("layer")),
               layer.self_attn.q_proj.register_forward_pre_hook(count("q_proj")),
               layer.mlp.register_forward_pre_hook(count("mlp"))]
    for mode, again in ((None, 0), ("full", 1), ("selective", 0)):  # selective reruns norms, SwiGLU
        if mode:
            apply_ac(model, mode)
        calls.update(layer=0, q_proj=0, mlp=0)
        grads(model, packed=False)
        if mode:
            remove_ac(model)
        assert calls == {"layer": 1, "q_proj": 1 + again, "mlp": 1 + again}, mode
    for h in handles:
        h.remove()


def test_rng_dropout_needs_preserve_rng_state():
    """Llama has no dropout, so ac.py skips RNG stashing. With dropout added inside the layers the
    recompute draws new masks (wrong gradients) unless preserve_rng_state=True."""
    model = make_model()
    handles = [layer.mlp.register_forward_hook(lambda mod, args, out: F.dropout(out, 0.3))
               for layer in model.model.layers.values()]

    def seeded():
        torch.manual_seed(5)
        return grads(model, packed=False)[1]
    ref = seeded()
    for preserve in (False, True):
        apply_ac(model, "full", preserve_rng_state=preserve)
        got = seeded()
        remove_ac(model)
        same = all(torch.equal(got[n], ref[n]) for n in ref)
        assert same == preserve
    for h in handles:
        h.remove()


# ------------------------------------------------------------------------------- multi-rank
class _ReduceInPlace(torch.autograd.Function):
    """All-reduce in forward written into the matmul output itself, as Megatron's `_reduce` does
    (dist.all_reduce bumps no version counter, so SAC's own mutation check cannot see it); identity
    in backward."""

    @staticmethod
    def forward(ctx, y):
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class _CommBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        y = torch.tanh(_ReduceInPlace.apply(self.a(x)))  # a's mm output is kept, then reduced in place
        z = funcol.all_reduce(self.b(y), "sum", dist.group.WORLD)  # out of place: kept, not replayed
        return torch.tanh(z) * y


def _comm_rank(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # different inputs and weights per rank: the reductions matter
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleDict({"0": _CommBlock(), "1": _CommBlock()})
    x = torch.randn(3, 8)

    def run():
        model.zero_grad(set_to_none=True)
        h = x
        for layer in model.model.layers.values():
            h = layer(h)
        h.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    ref = run()
    out = {}
    for mode in ("full", "selective"):
        apply_ac(model, mode)
        got = run()
        remove_ac(model)
        out[mode] = all(torch.equal(g, r) for g, r in zip(got, ref))
    return out


def test_collectives_inside_checkpointed_layers():
    """An in-place all-reduce of a kept matmul output, and an out-of-place functional all-reduce,
    inside checkpointed layers: bit-identical gradients at 2 ranks. Without ac.py's in-place rule,
    selective AC replays the all-reduce on the cached (already reduced) value: wrong gradients."""
    for result in run_ranks(_comm_rank, 2):
        assert result == {"full": True, "selective": True}


def _tp_rank(rank: int, world: int) -> dict:
    from tp import apply_tp
    out = {}
    for sp in (False, True):  # sequence parallel: selective AC reruns each norm's all-gather
        model = build(CFG)
        model = materialize(model, "cpu", seed=0, shards=apply_tp(model, dist.group.WORLD, sequence_parallel=sp))
        for packed in (False, True):
            ref_loss, ref, ref_bytes = grads(model, packed)
            for mode, every in MODES:
                apply_ac(model, mode, every)
                loss, got, nbytes = grads(model, packed)
                remove_ac(model)
                out[(sp, packed, mode, every)] = (nbytes < ref_bytes, torch.equal(loss, ref_loss),
                                                  all(torch.equal(got[n], g) for n, g in ref.items()))
    return out


def test_tp2_gradients_bit_identical():
    for result in run_ranks(_tp_rank, 2):
        for case, checks in result.items():
            assert checks == (True, True, True), case
