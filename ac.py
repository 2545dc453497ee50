"""Activation checkpointing for the decoder layers, and a meter of the bytes autograd keeps.

What it does
    `apply_ac(model, mode, every)` makes chosen decoder layers keep less for backward:
      - "full": a layer keeps only its inputs; backward reruns the whole layer forward first
        (non-reentrant `torch.utils.checkpoint`, never debug mode). A layer given a KV cache
        (transformers' default use_cache=True) raises: the rerun would update it twice.
      - "selective" (the default of `--ac`): the layer runs once, as without AC, but the outputs of
        its cheap modules (`recomputable`: leaves holding no matrix — the RMSNorms and the SwiGLU
        activation) are not kept: the saved-tensor hooks replace each saved view of them by a note,
        and backward reruns that module alone (a few elementwise kernels) when it reaches them.
        Their inputs are kept anyway (the modules' own backward reads them), so this drops the
        inputs of the q/k/v, gate/up and down projections for free memory-wise. Host cost: one
        forward hook per cheap module and one Python call per saved tensor — no Python per aten op
        (torch's op-level selective checkpoint runs every op through a TorchDispatchMode, ~29 µs
        each on CPU: more host time than the layer itself). bench.py measures host time per layer.
        Under torch.compile (train.py --compile) the layer instead runs checkpoint with the op-level
        policy `SAVE_OPS` (outputs of matmuls, fused attention, collectives kept; elementwise ops
        recomputed), which the compiler applies once while tracing: no Python per op at run time.
        Any model: the same rule picks LayerNorm, transformers' RMSNorm, an activation module (SiLU,
        GELU); an op outside a module of its own (transformers' gate · up product) is kept.
      - `every=k`: only layers whose GLOBAL index is a multiple of k (0, k, 2k, ...) are checkpointed.
        The layers: `model.model.layers` (attotron's ModuleDict keyed by global index, so a pipeline
        stage holding "4".."7" checkpoints 4 and 6 at k=2; transformers' ModuleList), or for any
        other model the dotted path `layers=` names (e.g. "transformer.h"). tests/test_foreign.py.
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
      `remove_ac` deletes it again (and the forward hooks selective mode put on the cheap modules).
    - Gradients are bit-identical with and without AC: a recompute runs the same kernels on the same
      inputs (tests/test_ac.py checks every mode with torch.equal).
    - Hooks: the closure runs INSIDE the layer's `__call__`, so hooks on the layer itself fire once per
      forward, as without AC. Full AC's recompute calls the submodules (q_proj, mlp, ...) through their
      `__call__`, so their pre-hooks fire again in backward (their post-hooks may not: the recompute
      stops as soon as it has rebuilt the last tensor backward needs); selective mode reruns the cheap
      modules' `forward` only (no hooks). Tensor-parallel comm ops (autograd Functions) run again
      under full AC; under selective AC only what a cheap module holds runs again (tp.py's
      sequence-parallel norm: its all-gather, as Megatron regathers in backward). ZeRO-3 (zero3.py)
      re-gathers a layer's unit from a hook on the layer's output gradient — before the layer's
      backward, so before any recompute, which reads the gathered parameters. Under full AC autograd
      holds no reference to a layer's parameters between forward and backward (the meter's
      `param_nbytes`); under selective AC and without AC it holds views, whose storage ZeRO-3 resizes
      to 0 bytes after the forward: they hold no memory.
    - RNG: Llama has no dropout, so nothing random runs in a layer and the recompute is exact without
      restoring the RNG. Full AC passes `preserve_rng_state=False`, which skips a CPU (and, on GPU,
      per-device) RNG-state copy per checkpointed layer and the fork/restore of those states around
      every recompute — tiny costs, but paid for nothing. If you add dropout inside a layer, pass
      `preserve_rng_state=True` or the recompute draws different masks (silently wrong gradients;
      the tests show both). Selective mode never reruns a Dropout module.
    - Selective mode and in-place writes: a cheap module's rerun gives its output as it was made,
      which is what the saved view held; tensors kept as they are get autograd's in-place check back
      (autograd skips it for hooked tensors; `_unpack` compares version counters). The storage key of
      a cheap output identifies its views only while that output lives: the call's table holds it
      until the layer's forward returns (a freed storage's address may be reused by the next tensor).

Activation bytes per layer (Korthikanti et al.'s sbh(34 + 5as/h), redone for this layer)
    s tokens, b batch, h hidden, a heads, g = n_kv/a, i = intermediate; bf16 activations. Bytes one
    layer keeps for backward, per token (model.py's RMSNorm, RoPE and SwiGLU Functions):
      input RMSNorm: its input x (2h), fp32 rstd (4); its output, the q/k/v input (2h)  4h + 4
      RoPE + attention: rotated q (2h) and k (2gh), v (2gh), output (2h), fp32 lse (4a)   4h + 4gh + 4a
        (RoPE keeps cos/sin — shared by all layers — not q, k; o_proj reads a view of the output)
      post-attention RMSNorm: the residual sum (2h), rstd (4), its output (gate/up's)   4h + 4
      SwiGLU: gate, up (its own backward recomputes silu), the product = down's input    6i
    none      = sbh(12 + 4g + 6i/h) + 4sba + 8sb. i ≈ 8h/3 gives sbh(28 + 4g), Llama-3 8B's i = 3.5h
                sbh(33 + 4g): about GPT's 34 (no dropout masks; two extra i-sized SwiGLU tensors).
                The norms keep no fp32 copy of x and no x·rsqrt (ops.py; HF's op chain: 8h each).
                Fused attention (flash, efficient, cudnn, CPU flash) keeps only output + lse, so the
                5as²b term is gone; a math attention would add ≈ 2as²b of probabilities; a document
                mask adds a float b·s² mask per layer.
    selective = sbh(8 + 4g + 4i/h) + 4sba + 8sb: none without the two norm outputs and the SwiGLU
                product (op-level selective checkpointing kept sbh(10 + 4g + 4i/h) + 4sba).
    full      = 2sbh: the layer input only; backward briefly holds one layer's `none` while it runs.
    In fp32 the h, g, i terms double: none = 4sbh(6 + 2g + 3i/h) + 4sba + 8sb, selective =
    4sbh(4 + 2g + 2i/h) + 4sba + 8sb, full = 4sbh. tests/test_ac.py checks these byte for byte against
    SavedActivationMeter. Under --compile, what the compiled layer saves is the partitioner's choice
    (bench.py measures it with the same meter).
    Packed rows (attention.Documents) on the CPU path keep q, k, v, the attention output and lse for
    the T' = Σ bucket(len) padded slots of the length groups instead of the sb tokens, plus the output
    scattered back to token order (o_proj's input) and two int64 indices (shared by all layers):
    in fp32, T = sb, q width = h, none = 4Th(5 + 3i/h) + 16T + 4T'h(2 + 2g) + 4T'a + 8T' (16T: two
    rstd and the scatter index), selective = 4Th(3 + 2i/h) + the same other terms, full = 4Th;
    T' <= 9/8·T + 16·documents: O(S), no S² term (tests/test_model.py measures it). The CUDA varlen
    path keeps the unpacked formula.
"""
from __future__ import annotations

import threading
import weakref
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.attention.varlen  # noqa: F401 (registers torch.ops.torch_attn._varlen_attn)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("full", "selective")

# ------------------------------------------------------------------------------- selective, eager
def recomputable(module: nn.Module) -> bool:
    """A module selective AC reruns in backward instead of keeping its output: a leaf that holds no
    matrix — RMSNorm (model.py, tp.py's sequence-parallel one), the SwiGLU activation. Its inputs
    are kept anyway (its own backward reads them), so dropping its output saves that output for a
    few elementwise kernels. Dropout is random: never rerun."""
    return (next(module.children(), None) is None and not isinstance(module, nn.modules.dropout._DropoutNd)
            and all(p.ndim < 2 for p in module.parameters(recurse=False)))


def _storage_key(t: torch.Tensor) -> int:
    # The storage's identity (its C++ StorageImpl), not its data_ptr: ZeRO-3 resizes a parameter
    # storage to 0 bytes and the allocator hands that address to the next activation.
    return t.untyped_storage()._cdata


class _Rerun:
    """A recomputable module's call: its detached inputs, and its output once rerun (shared by every
    saved view of that output; freed with the last of them)."""
    __slots__ = ("module", "args", "kwargs", "layout", "out")

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor):
        detach = lambda a: a.detach() if isinstance(a, torch.Tensor) else a  # noqa: E731
        self.module, self.args = module, tuple(map(detach, args))
        self.kwargs = {k: detach(v) for k, v in kwargs.items()}
        self.layout, self.out = (out.shape, out.stride()), None

    def inputs(self) -> list[torch.Tensor]:
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)]

    def output(self) -> torch.Tensor:
        if self.out is None:
            with torch.no_grad():  # the same kernels on the same inputs: the same bits
                self.out = self.module.forward(*self.args, **self.kwargs)
            if (self.out.shape, self.out.stride()) != self.layout:
                raise RuntimeError(f"selective AC: rerunning {type(self.module).__name__} gave another layout")
        return self.out


class _Note:
    """What autograd holds instead of a view of a recomputable module's output."""
    __slots__ = ("rerun", "shape", "stride", "offset", "__weakref__")

    def __init__(self, rerun: _Rerun, t: torch.Tensor):
        self.rerun, self.shape, self.stride, self.offset = rerun, t.shape, t.stride(), t.storage_offset()


# One table per selective layer call running: storage → (_Rerun, the output). The table holds the
# output until the layer's forward returns, so its storage (the key) cannot be freed and handed to
# another tensor meanwhile; then only the notes remain.
_CALLS: list[dict[int, tuple[_Rerun, torch.Tensor]]] = []


def _record(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
    """Forward hook of each recomputable module inside a selective layer."""
    if _CALLS and isinstance(out, torch.Tensor) and out.requires_grad:
        _CALLS[-1][_storage_key(out)] = (_Rerun(module, args, kwargs, out), out)


def _pack(t: torch.Tensor) -> Any:
    """Saved-tensor hook inside a selective layer: a view of a recomputable module's output becomes
    a note (the _Rerun and the view's geometry); anything else is kept with its version counter
    (autograd skips its in-place check for hooked tensors: we do it at unpack)."""
    made = _CALLS[-1].get(_storage_key(t)) if _CALLS else None
    if made is None:
        _count(t, owner=t)
        return t, t._version
    rerun = made[0]
    note = _Note(rerun, t)
    for x in rerun.inputs():  # held by the note (usually saved by the module itself: counted once)
        _count(x, owner=note)
    return note


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Note):
        return saved.rerun.output().as_strided(saved.shape, saved.stride, saved.offset)
    t, version = saved
    if t._version != version:
        raise RuntimeError("selective AC: a tensor saved for backward was modified in place")
    return t


def _selective(inner: Callable, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled():  # eval / generate: nothing is saved
        return inner(*args, **kwargs)
    _CALLS.append({})
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return inner(*args, **kwargs)
    finally:
        _CALLS.pop()  # the table goes; the notes keep what they need


# ------------------------------------------------------------------------------- selective, compiled
aten = torch.ops.aten
# Under torch.compile the layer's checkpoint is traced with this op-level policy and the partitioner
# bakes it into the compiled backward (no Python per op at run time): keep the outputs of matmuls,
# fused attention and collectives (as costly to redo as to run), recompute the elementwise ops
# between them (fused by inductor into the backward's kernels). F.linear is mm (addmm with a bias).
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
    _funcol = torch.ops._c10d_functional  # dynamo turns in-place collectives into these
    SAVE_OPS |= {_funcol.all_reduce.default, _funcol.all_gather_into_tensor.default,
                 _funcol.reduce_scatter_tensor.default, _funcol.wait_tensor.default}


def _compile_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _compile_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_compile_policy)


# ------------------------------------------------------------------------------- wrapping layers
_CACHES = ("cache", "past_key_values", "past_key_value")  # transformers' names for a layer's KV cache


def _wrap(layer: nn.Module, mode: str, preserve_rng_state: bool) -> None:
    own = layer.__dict__.get("forward")  # an instance-level forward set by someone else, if any
    ref = weakref.ref(layer)  # no layer → closure → layer cycle: the model stays freeable by refcount

    def forward(*args: Any, **kwargs: Any) -> Any:
        inner = own if own is not None else partial(type(ref()).forward, ref())  # (traceable by compile)
        if mode == "selective" and not torch.compiler.is_compiling():
            return _selective(inner, args, kwargs)
        if any(kwargs.get(k) is not None for k in _CACHES) and torch.is_grad_enabled():
            raise ValueError("full activation checkpointing reruns the layer in backward, which would update "
                             "its KV cache twice: call the model with use_cache=False")
        # (compile traces checkpoint's context_fn only when it is a selective one: full passes none)
        policy = {"context_fn": _compile_contexts} if mode == "selective" else {}
        return checkpoint(inner, *args, use_reentrant=False, debug=False,
                          preserve_rng_state=preserve_rng_state, **policy, **kwargs)

    forward.ac_mode = mode
    forward.ac_own = own
    forward.ac_hooks = [m.register_forward_hook(_record, with_kwargs=True) for m in layer.modules()
                        if m is not layer and recomputable(m)] if mode == "selective" else []
    layer.forward = forward  # an instance attribute: no new module, no change to any name


def decoder_layers(model: nn.Module, layers: str | None = None) -> dict[str, nn.Module]:
    """{global index: layer}: `layers` (a dotted path to the model's layer list, e.g. "transformer.h")
    or, found by itself, `model.model.layers` (attotron's ModuleDict keyed by global index, a pipeline
    stage holding only some; transformers' ModuleList). Other keys: the layers' positions."""
    found = model.get_submodule(layers) if layers is not None else \
        getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(found, (nn.ModuleDict, nn.ModuleList)):
        where = f"{layers!r} is {type(found).__name__}" if layers is not None else \
            f"{type(model).__name__} has no model.layers"
        raise ValueError(f"apply_ac needs the decoder layers as an nn.ModuleDict or nn.ModuleList: {where}; "
                         f"pass layers= (the dotted path to them, e.g. layers='transformer.h')")
    if isinstance(found, nn.ModuleDict) and all(name.isdigit() for name in found):
        return dict(found.items())
    ordered = found.values() if isinstance(found, nn.ModuleDict) else found
    return {str(i): layer for i, layer in enumerate(ordered)}


def checkpointed(model: nn.Module, layers: str | None = None) -> dict[str, str]:
    """{global layer index: mode} of the layers apply_ac wrapped."""
    return {name: layer.forward.ac_mode for name, layer in decoder_layers(model, layers).items()
            if hasattr(layer.forward, "ac_mode")}


def apply_ac(model: nn.Module, mode: str = "selective", every: int = 1,
             preserve_rng_state: bool = False, *, layers: str | None = None) -> None:
    """Checkpoint every `every`-th decoder layer (by global index: 0, k, 2k, ...) in `mode` ("full"
    or "selective"). The layers: `model.model.layers` (attotron, transformers) or the `layers` path
    of any other model. Apply after tp/pp have transformed the model and after materialize; before
    the optimizer, dp and zero wrap it."""
    if mode not in MODES:
        raise ValueError(f"ac mode {mode!r} is not one of {MODES}")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"ac every={every!r}: expected an integer >= 1 (1 checkpoints every layer)")
    done = checkpointed(model, layers)
    if done:
        raise ValueError(f"activation checkpointing is already applied to layers {sorted(done, key=int)}; "
                         f"call remove_ac(model) first")
    for name, layer in decoder_layers(model, layers).items():
        if int(name) % every == 0:
            _wrap(layer, mode, preserve_rng_state)


def remove_ac(model: nn.Module, layers: str | None = None) -> None:
    """Undo apply_ac: every layer runs its plain forward again."""
    for layer in decoder_layers(model, layers).values():
        forward = layer.__dict__.get("forward")
        if forward is None or not hasattr(forward, "ac_mode"):
            continue
        for handle in forward.ac_hooks:
            handle.remove()
        if forward.ac_own is None:
            del layer.forward
        else:
            layer.forward = forward.ac_own


# ------------------------------------------------------------------------------- the meter
_METERS: list["SavedActivationMeter"] = []


def _count(t: torch.Tensor, owner: object) -> None:
    for meter in _METERS:
        meter._add(t, owner=owner)


def _meter_pack(t: torch.Tensor) -> torch.Tensor:
    _count(t, owner=t)
    return t  # autograd keeps the tensor itself, exactly as without the meter


def _meter_unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class SavedActivationMeter:
    """Count what autograd keeps for backward while the context is active.

        with SavedActivationMeter() as m:
            loss = model(ids, labels=labels, reduction="sum")
        print(m.nbytes, m.count)          # activations the forward handed to backward
        loss.backward()                   # m.live_nbytes drops back as backward frees them

    Tensors are counted per unique storage (a view counts its whole storage once; a tensor saved by
    several ops counts once). Parameters and their views (W.t() saved by a matmul) are not activations:
    they are counted apart in `param_nbytes` (the storage's size when saved: ZeRO-3 later resizes
    it to 0). Inside a selective layer autograd uses that layer's hooks, not the meter's (the
    innermost pair wins): they report here what they keep, and the inputs a note holds, so the
    meter counts everything a backward will read. Recomputed tensors (inside backward) are not
    counted. Only sizes and storage ids are stored, plus a weakref finalizer
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
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_meter_pack, _meter_unpack)

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
