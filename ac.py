"""Activation checkpointing for the decoder layers, and a meter of the bytes autograd keeps.

What it does
    `apply_ac(model, mode, every)` makes chosen decoder layers keep less for backward and recompute
    the rest when backward reaches them (non-reentrant `torch.utils.checkpoint`, never debug mode):
      - "full": a layer keeps only its inputs; backward reruns the whole layer forward first.
      - "selective" (the default of `--ac`): op-level selection (`create_selective_checkpoint_contexts`
        with the policy below, `SAVE_OPS` + `_Policy`): the outputs of matmuls, fused attention and
        collectives are kept, the cheap elementwise ops between them (RMSNorm, RoPE, SiLU, the SwiGLU
        product) are recomputed.
      - `every=k`: only layers whose GLOBAL index is a multiple of k (0, k, 2k, ...) are checkpointed.
        Layers live in `model.model.layers` keyed by global index, so a pipeline stage holding layers
        "4".."7" checkpoints 4 and 6 at k=2: the choice does not depend on how pp splits the model.
    `remove_ac(model)` restores the plain layers. `SavedActivationMeter` counts what autograd keeps.

Reference
    Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (checkpointing);
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (selective recomputation; the per-layer activation formula below).

Run
    torchrun --nproc_per_node 1 train.py --model small --ac                     # selective
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --ac-mode full --ac-every 2

Invariants
    - Parameter names and state_dict keys do not change: the layer's own forward is replaced by a
      closure on the instance (no wrapper module, no `_checkpoint_wrapped_module.` in any key), and
      `remove_ac` deletes it again.
    - Gradients are bit-identical with and without AC: the recompute runs the same ops on the same
      inputs (tests/test_ac.py checks every mode with torch.equal).
    - Hooks: the closure runs INSIDE the layer's `__call__`, so hooks on the layer itself fire once per
      forward, as without AC. The recompute calls the submodules (q_proj, mlp, ...) through their
      `__call__`, so their pre-hooks fire again in backward (their post-hooks may not: the recompute
      stops as soon as it has rebuilt the last tensor backward needs). Tensor-parallel comm ops
      (autograd Functions) simply run again. ZeRO-3 (zero.py) re-gathers a layer's unit from a hook on
      the layer's output gradient — before the layer's backward, so before its recompute, which reads
      the gathered parameters. With AC autograd holds no reference to a layer's gathered parameters
      between forward and backward (the meter's `param_nbytes`).
    - RNG: Llama has no dropout, so nothing random runs in a layer and the recompute is exact without
      restoring the RNG. We pass `preserve_rng_state=False`, which skips a CPU (and, on GPU, per-device)
      RNG-state copy per checkpointed layer and the fork/restore of those states around every
      recompute — tiny costs, but paid for nothing. If you add dropout inside a layer, pass
      `preserve_rng_state=True` or the recompute draws different masks (silently wrong gradients;
      the tests show both).
    - Selective AC and in-place collectives: `dist.all_reduce(x)` mutates x without bumping its
      version counter, so if x is a saved matmul output, replaying the all-reduce on the cached
      value in backward would reduce it twice — silently. The policy therefore keeps the collective
      (does not replay it) exactly when the tensor it writes is one the policy kept. A collective into
      a fresh tensor the policy did not keep is replayed (one more collective in backward); an
      out-of-place functional collective (`torch.ops._c10d_functional`, as tp.py uses) is kept.

Activation bytes per layer (Korthikanti et al.'s sbh(34 + 5as/h), redone for this layer)
    s tokens, b batch, h hidden, a heads, g = n_kv/a, i = intermediate; bf16 activations, RMSNorm
    computing in fp32 (as HF). Bytes one layer keeps for backward, per token:
      input RMSNorm: fp32 copy of x (4h), x·rsqrt (2h), w·x·rsqrt = the q/k/v input (2h)  8h
      RoPE + attention: rotated q (2h) and k (2gh), v (2gh), output (2h), fp32 lse (4a)   4h + 4gh + 4a
        (RoPE keeps cos/sin — shared by all layers — not q, k; o_proj reads a view of the output)
      post-attention RMSNorm (the residual sum itself is not kept, its fp32 copy is)     8h
      SwiGLU: gate, up, silu(gate), silu(gate)·up                                       8i
    none      = sbh(20 + 4g + 8i/h) + 4sba + 8sb (two fp32 rsqrt). i ≈ 8h/3 gives sbh(41.3 + 4g),
                Llama-3 8B's i = 3.5h sbh(48 + 4g): more than GPT's 34 (two extra i-sized SwiGLU tensors
                and the fp32 norm copies, fewer: no dropout masks). Fused attention (flash, efficient,
                cudnn, CPU flash) keeps only output + lse, so the 5as²b term is gone; a math attention
                would add ≈ 2as²b of probabilities; a document mask adds a float b·s² mask per layer.
    selective = sbh(10 + 4g + 4i/h) + 4sba: x (the checkpoint input), q, k, v, attention output, lse and
                the o, gate, up, down projection outputs (down's is kept though only the residual add
                reads it: the policy sees ops, not their consumers) — about half of none.
    full      = 2sbh: the layer input only; backward briefly holds one layer's `none` while it runs.
    In fp32 x.float() is x itself, so the norm keeps x and the residual sum instead of copies:
    none = 4sbh(8 + 2g + 4i/h) + 4sba + 8sb, selective = 4sbh(5 + 2g + 2i/h) + 4sba, full = 4sbh.
    tests/test_ac.py checks these formulas byte for byte against SavedActivationMeter.
    Packed rows (attention.Documents) on the CPU path keep q, k, v, the attention output and lse for
    the T' = Σ bucket(len) padded slots of the length groups instead of the sb tokens, plus the output
    scattered back to token order (o_proj's input) and two int64 indices (shared by all layers):
    in fp32, T = sb, none = 4Th(6 + 4i/h + 1) + 8T + 4T'h(2 + 2g) + 4T'a + 8T' + 8T, selective =
    4Th(3 + 1 + 2g + 2i/h) + 4T'(h + a), full = 4Th (q width = h); T' <= 9/8·T + 16·documents: O(S),
    no S² term (tests/test_model.py measures it). The CUDA varlen path keeps the unpacked formula.
"""
from __future__ import annotations

import threading
import types
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.attention.varlen  # noqa: F401 (registers torch.ops.torch_attn._varlen_attn)
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

MODES = ("full", "selective")

# ------------------------------------------------------------------------------- selective policy
aten = torch.ops.aten
# Keep the outputs of the expensive ops (Korthikanti et al. 2022): recomputing a matmul costs
# as much as running it, while the elementwise ops between them (norms, RoPE, SiLU, products) are
# memory-bound and nearly free to rerun. F.linear reaches the dispatcher as mm (addmm with a bias).
# Fused attention keeps O(s) memory (output + log-sum-exp) and costs a full attention forward, so it
# is kept too. Deliberately NOT kept: bmm/softmax of a math (non-fused) attention — those are the
# O(s²) tensors Korthikanti et al. recompute; here they are recomputed from the kept q, k, v.
SAVE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops.torch_attn._varlen_attn.default,  # packed rows on CUDA (attention.py)
}
if torch.distributed.is_available():
    # Out-of-place (functional) collectives: communication is as costly to redo as a matmul. The
    # in-place ones (dist.all_reduce) are handled in _Policy.
    _funcol = torch.ops._c10d_functional
    SAVE_OPS |= {_funcol.all_reduce.default, _funcol.all_gather_into_tensor.default,
                 _funcol.reduce_scatter_tensor.default}


def _storage_key(t: torch.Tensor) -> int:
    # The storage's identity (its C++ StorageImpl), not its data_ptr: ZeRO-3 resizes a parameter
    # storage to 0 bytes and the allocator hands that address to the next activation.
    return t.untyped_storage()._cdata


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of an op argument or output (a tensor, or nested lists/tuples of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


class _Policy:
    """The save-or-recompute decision for one checkpointed layer call. It remembers which storages
    it kept, for the in-place collectives (see the module docstring) and for the meter."""

    def __init__(self) -> None:
        self.kept: set[int] = set()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in SAVE_OPS:
            self._keep(ctx.op_output)
            return CheckpointPolicy.MUST_SAVE
        if getattr(op, "namespace", None) == "c10d":
            # c10d's in-place collectives (allreduce_, allgather_, _reduce_scatter_base_, ...) all
            # write into their first argument; their schemas and version counters do not say so.
            written = [_storage_key(t) in self.kept for t in _tensors(args[0])]
            if written and all(written):  # the kept value already holds the result: do not replay
                return CheckpointPolicy.MUST_SAVE
            if any(written):
                raise RuntimeError(f"selective AC: {op} writes into tensors of which only some were "
                                   f"kept; neither replaying nor skipping it is correct. Use mode='full' "
                                   f"or an out-of-place collective.")
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _keep(self, output: Any) -> None:
        for t in _tensors(output):
            self.kept.add(_storage_key(t))
            for meter in _METERS:  # kept by the checkpoint's cache, invisible to saved-tensor hooks
                meter._add(t, owner=self)


def _selective_contexts() -> tuple[Any, Any]:
    policy = _Policy()
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
    # The recompute context lives as long as the checkpoint (until this layer's backward ran); tying
    # the policy to it lets the meter release the kept bytes exactly when the cache goes away.
    recompute_ctx.ac_policy = policy
    return forward_ctx, recompute_ctx


# ------------------------------------------------------------------------------- wrapping layers
def _wrap(layer: nn.Module, mode: str, preserve_rng_state: bool) -> None:
    own = layer.__dict__.get("forward")  # an instance-level forward set by someone else, if any
    ref = weakref.ref(layer)  # no layer → closure → layer cycle: the model stays freeable by refcount
    context_fn = _selective_contexts if mode == "selective" else noop_context_fn

    def forward(*args: Any, **kwargs: Any) -> Any:
        inner = own if own is not None else types.MethodType(type(ref()).forward, ref())
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, debug=False,
                          preserve_rng_state=preserve_rng_state, **kwargs)

    forward.ac_mode = mode
    forward.ac_own = own
    layer.forward = forward  # an instance attribute: no new module, no change to any name


def checkpointed(model: nn.Module) -> dict[str, str]:
    """{global layer index: mode} of the layers apply_ac wrapped."""
    return {name: layer.forward.ac_mode for name, layer in model.model.layers.items()
            if hasattr(layer.forward, "ac_mode")}


def apply_ac(model: nn.Module, mode: str = "selective", every: int = 1,
             preserve_rng_state: bool = False) -> None:
    """Checkpoint every `every`-th decoder layer of `model.model.layers` (by global index: 0, k, 2k,
    ...) in `mode` ("full" or "selective"). Apply after tp/pp have transformed the model and
    after materialize; before the optimizer, dp and zero wrap it."""
    if mode not in MODES:
        raise ValueError(f"ac mode {mode!r} is not one of {MODES}")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"ac every={every!r}: expected an integer >= 1 (1 checkpoints every layer)")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("apply_ac expects model.model.layers to be an nn.ModuleDict of decoder layers")
    done = checkpointed(model)
    if done:
        raise ValueError(f"activation checkpointing is already applied to layers {sorted(done, key=int)}; "
                         f"call remove_ac(model) first")
    for name, layer in layers.items():
        if int(name) % every == 0:
            _wrap(layer, mode, preserve_rng_state)


def remove_ac(model: nn.Module) -> None:
    """Undo apply_ac: every layer runs its plain forward again."""
    for layer in model.model.layers.values():
        forward = layer.__dict__.get("forward")
        if forward is None or not hasattr(forward, "ac_mode"):
            continue
        if forward.ac_own is None:
            del layer.forward
        else:
            layer.forward = forward.ac_own


# ------------------------------------------------------------------------------- the meter
_METERS: list["SavedActivationMeter"] = []


def _pack(t: torch.Tensor) -> torch.Tensor:
    for meter in _METERS:
        meter._add(t, owner=t)
    return t  # autograd keeps the tensor itself, exactly as without the meter


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class SavedActivationMeter:
    """Count what autograd keeps for backward while the context is active.

        with SavedActivationMeter() as m:
            loss = model(ids, labels=labels, reduction="sum")
        print(m.nbytes, m.count)          # activations the forward handed to backward
        loss.backward()                   # m.live_nbytes drops back as backward frees them

    Tensors are counted per unique storage (a view counts its whole storage once; a tensor saved by
    several ops counts once). Parameters and their views (W.t() saved by a matmul) are not activations:
    they are counted apart in `param_nbytes` — with ZeRO-3 that is where gathered buffers held by
    autograd show up. Tensors kept by selective AC's cache never pass through saved-tensor hooks; the
    policy reports them here, so the meter counts everything a backward will read. Recomputed tensors
    (inside backward) are not counted. Only sizes and storage ids are stored, plus a weakref finalizer
    per saved tensor: nothing lives longer than autograd keeps it. A storage counts as held while any
    tensor object saved from it is alive — so an input the caller still references stays "live".

    nbytes, count              unique activation storages saved while active
    param_nbytes, param_count  unique parameter storages saved while active
    live_nbytes, peak_nbytes   activation bytes held right now / at most (updated also after exit)
    """

    def __init__(self) -> None:
        self.nbytes = self.count = self.param_nbytes = self.param_count = 0
        self.live_nbytes = self.peak_nbytes = 0
        self._live: dict[int, list] = {}  # storage key → [nbytes, holders, is_param]
        self._lock = threading.Lock()  # finalizers may run on autograd's device threads
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        _METERS.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _METERS.remove(self)
        self._hooks.__exit__(*exc)

    def _add(self, t: torch.Tensor, owner: object) -> None:
        """Count t's storage as held until `owner` is garbage collected."""
        key = _storage_key(t)
        is_param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [t.untyped_storage().nbytes(), 0, is_param]
                if is_param:
                    self.param_count += 1
                    self.param_nbytes += entry[0]
                else:
                    self.count += 1
                    self.nbytes += entry[0]
                    self.live_nbytes += entry[0]
                    self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes)
            entry[1] += 1
        weakref.finalize(owner, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[key]
                if not entry[2]:
                    self.live_nbytes -= entry[0]
