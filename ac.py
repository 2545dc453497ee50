"""Activation checkpointing: chosen decoder layers keep less for backward and recompute the rest.

What it does
    `apply_ac(model, mode, every)` wraps the forward of every k-th decoder layer.
    `remove_ac(model)` restores the plain layers.
    `SavedActivationMeter` counts the bytes autograd keeps for backward.

The core idea
    "full": a layer keeps only its inputs. Backward reruns the whole layer first.
    That is torch's non-reentrant `checkpoint`, never in debug mode.
    "selective", the default of `--ac`: the layer runs once, as without AC.
    Its cheap modules (the norms, the SwiGLU activation) do not keep their outputs.
    Saved-tensor hooks replace each saved view of them by a note.
    Backward reruns that module alone when it reaches a note.
    Under torch.compile, selective mode is an op-level policy instead (`SAVE_OPS`).
    `every=k` picks the layers whose GLOBAL index is a multiple of k.
    docs/ac.md has the bytes per layer, and how AC meets TP, ZeRO-3 and PP.

Reference
    Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": checkpointing.
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
    selective recompute, and the per-layer activation formula.

Run
    torchrun --nproc_per_node 1 train.py --model small --ac                     # selective
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --ac-mode full --ac-every 2

Invariants (tests/test_ac.py unless named)
    - Gradients are bit-identical with and without AC, in every mode (test_gradients_bit_identical).
    - Names and state_dict keys do not change (test_names_unchanged_remove_restores_and_bad_input).
    - `remove_ac` restores the plain layers (the same test).
    - Bytes kept equal docs/ac.md's formulas, byte for byte (test_saved_bytes_match_docstring_formulas).
    - Hooks on a layer fire once per forward (test_hooks_layer_once_submodules_again).
    - Dropout needs preserve_rng_state=True. The default skips it (test_rng_dropout_needs_...).
    - Full AC refuses a KV cache: the rerun would update it twice (test_foreign.py).
    - Full AC's recompute reads no host value again (`kept_for_recompute`, test_cuda_paths.py).

Reading order
    The public functions come first: `apply_ac`, `remove_ac`. Then `_wrap`, the core.
    Refinements follow, each after a `# --- refinement:` banner.
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


# ------------------------------------------------------------------------ the public functions
def apply_ac(model: nn.Module, mode: str = "selective", every: int = 1,
             preserve_rng_state: bool = False, *, layers: str | None = None) -> None:
    """Checkpoint every `every`-th decoder layer in `mode`, "full" or "selective".

    `every` counts by global index: layers 0, k, 2k, ... are checkpointed.
    The layers are `model.model.layers` (attotron, transformers).
    Any other model gives the dotted path `layers`.
    Apply it after tp/pp have transformed the model, and after materialize.
    Apply it before the optimizer, dp and zero wrap the model."""
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
    """Undo apply_ac. Every layer runs its plain forward again."""
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


def checkpointed(model: nn.Module, layers: str | None = None) -> dict[str, str]:
    """The layers apply_ac wrapped, as {global layer index: mode}."""
    return {name: layer.forward.ac_mode for name, layer in decoder_layers(model, layers).items()
            if hasattr(layer.forward, "ac_mode")}


def decoder_layers(model: nn.Module, layers: str | None = None) -> dict[str, nn.Module]:
    """The decoder layers, as {global index: layer}.

    `layers` is a dotted path to the model's layer list, e.g. "transformer.h".
    Without it, the layers are `model.model.layers`.
    attotron's is a ModuleDict keyed by global index. A pipeline stage holds only some.
    transformers' is a ModuleList. Other lists are keyed by position."""
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


# ------------------------------------------------- the core: a checkpointed forward per layer
_CACHES = ("cache", "past_key_values", "past_key_value")  # transformers' names for a layer's KV cache


def _wrap(layer: nn.Module, mode: str, preserve_rng_state: bool) -> None:
    """Replace the layer's forward by a closure that checkpoints it (on the instance: names stay)."""
    own = layer.__dict__.get("forward")  # an instance-level forward set by someone else, if any
    ref = weakref.ref(layer)  # no layer → closure → layer cycle. Refcounting frees the model.

    def forward(*args: Any, **kwargs: Any) -> Any:
        inner = own if own is not None else partial(type(ref()).forward, ref())  # compile traces it
        if mode == "selective" and not torch.compiler.is_compiling():
            return _selective(inner, args, kwargs)
        if any(kwargs.get(k) is not None for k in _CACHES) and torch.is_grad_enabled():
            raise ValueError("full activation checkpointing reruns the layer in backward, which would update "
                             "its KV cache twice: call the model with use_cache=False")
        # Compile traces checkpoint's context_fn only when it is a selective one. Full passes none.
        policy = {"context_fn": _compile_contexts} if mode == "selective" else {}
        if mode == "full" and not torch.compiler.is_compiling():
            inner = _keeping(inner)  # eager: the recompute reuses the forward's host reads
        return checkpoint(inner, *args, use_reentrant=False, debug=False,
                          preserve_rng_state=preserve_rng_state, **policy, **kwargs)

    forward.ac_mode = mode
    forward.ac_own = own
    forward.ac_hooks = [m.register_forward_hook(_record, with_kwargs=True) for m in layer.modules()
                        if m is not layer and recomputable(m)] if mode == "selective" else []
    layer.forward = forward  # an instance attribute: no new module, no name changes


# --- refinement: selective recompute, eager: saved-tensor hooks drop the cheap modules' outputs
# Host cost: one forward hook per cheap module, one Python call per saved tensor. No Python per op.
# docs/ac.md says why this beats torch's op-level policy in eager mode.
def recomputable(module: nn.Module) -> bool:
    """A module that selective AC reruns in backward instead of keeping its output.

    It is a leaf that holds no matrix: an RMSNorm or LayerNorm, the SwiGLU activation.
    Its inputs are kept anyway, since its own backward reads them.
    So dropping its output costs only a few elementwise kernels.
    Dropout is random: never rerun."""
    return (next(module.children(), None) is None and not isinstance(module, nn.modules.dropout._DropoutNd)
            and all(p.ndim < 2 for p in module.parameters(recurse=False)))


def _storage_key(t: torch.Tensor) -> int:
    # The storage's identity (its C++ StorageImpl), not its data_ptr.
    # ZeRO-3 resizes a parameter storage to 0 bytes. The allocator hands that address on.
    return t.untyped_storage()._cdata


class _Rerun:
    """A recomputable module's call: its detached inputs, and its output once rerun.

    Every saved view of that output shares the rerun. It is freed with the last of them."""
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
            with torch.no_grad():  # the same kernels on the same inputs give the same bits
                self.out = self.module.forward(*self.args, **self.kwargs)
            if (self.out.shape, self.out.stride()) != self.layout:
                raise RuntimeError(f"selective AC: rerunning {type(self.module).__name__} gave another layout")
        return self.out


class _Note:
    """What autograd holds instead of a view of a recomputable module's output."""
    __slots__ = ("rerun", "shape", "stride", "offset", "__weakref__")

    def __init__(self, rerun: _Rerun, t: torch.Tensor):
        self.rerun, self.shape, self.stride, self.offset = rerun, t.shape, t.stride(), t.storage_offset()


# One table per running selective layer call: storage → (_Rerun, the output).
# The table holds the output until the layer's forward returns.
# So its storage, the key, cannot be freed and handed to another tensor meanwhile.
# Then only the notes remain.
_CALLS: list[dict[int, tuple[_Rerun, torch.Tensor]]] = []


def _record(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
    """Forward hook of each recomputable module inside a selective layer."""
    if _CALLS and isinstance(out, torch.Tensor) and out.requires_grad:
        _CALLS[-1][_storage_key(out)] = (_Rerun(module, args, kwargs, out), out)


def _pack(t: torch.Tensor) -> Any:
    """Saved-tensor hook inside a selective layer.

    A view of a recomputable module's output becomes a note: the _Rerun and the view's geometry.
    Anything else is kept with its version counter.
    Autograd skips its in-place check for hooked tensors, so _unpack does it."""
    made = _CALLS[-1].get(_storage_key(t)) if _CALLS else None
    if made is None:
        _count(t, owner=t)
        return t, t._version
    rerun = made[0]
    note = _Note(rerun, t)
    for x in rerun.inputs():  # held by the note. Usually the module saves them too: counted once.
        _count(x, owner=note)
    return note


def _unpack(saved: Any) -> torch.Tensor:
    """Saved-tensor hook: a note reruns its module; a kept tensor must be unmodified."""
    if isinstance(saved, _Note):
        return saved.rerun.output().as_strided(saved.shape, saved.stride, saved.offset)
    t, version = saved
    if t._version != version:
        raise RuntimeError("selective AC: a tensor saved for backward was modified in place")
    return t


def _selective(inner: Callable, args: tuple, kwargs: dict) -> Any:
    """Run the layer's forward once, under the saved-tensor hooks."""
    if not torch.is_grad_enabled():  # eval / generate: nothing is saved
        return inner(*args, **kwargs)
    _CALLS.append({})
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return inner(*args, **kwargs)
    finally:
        _CALLS.pop()  # the table goes. The notes keep what they need.


# --- refinement: selective recompute under torch.compile: an op-level policy
aten = torch.ops.aten
# Under torch.compile the layer's checkpoint is traced with this op-level policy.
# The partitioner bakes it into the compiled backward: no Python per op at run time.
# Keep the outputs of matmuls, fused attention and collectives: as costly to redo as to run.
# Recompute the elementwise ops between them. Inductor fuses them into the backward's kernels.
# F.linear is mm, or addmm with a bias.
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


# --- refinement: full AC's recompute reuses the host values its forward read
# A layer's forward may read device values on the host: moe's exchanged token counts, a sync.
# The recompute in backward would read them again: a second exchange, a second sync.
# It routes exactly as the forward did: the same inputs through the same kernels.
# (The same determinism makes AC's gradients bit-identical.) So the values cannot change.
# The forward keeps each read's result. The recompute takes them back, in call order.
_HOST = threading.local()  # .now: the open checkpoint's kept list, or an iterator over it (recompute)


def _keeping(inner: Callable) -> Callable:
    """inner for one checkpoint call. Its first run is the forward: it keeps each host read. Each
    later run is a recompute (a second backward with retain_graph makes another): it replays them.
    A wrapper, not checkpoint's context_fn: that one refuses checkpoint's debug mode."""
    kept: list = []
    runs = [0]

    def run(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_HOST, "now", None)
        _HOST.now = iter(list(kept)) if runs[0] else kept
        runs[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            _HOST.now = outer
    return run


def kept_for_recompute(read: Callable[[], Any]) -> Any:
    """read(): values a forward reads from the device. In a full-AC layer the forward keeps them,
    and the recompute gets them back without calling read. Elsewhere it just calls read()."""
    now = getattr(_HOST, "now", None)
    if now is None:
        return read()
    if isinstance(now, list):
        now.append(read())
        return now[-1]
    return next(now)


# --- refinement: a meter of the bytes autograd keeps
_METERS: list["SavedActivationMeter"] = []


def _count(t: torch.Tensor, owner: object) -> None:
    for meter in _METERS:
        meter._add(t, owner=owner)


def _meter_pack(t: torch.Tensor) -> torch.Tensor:
    _count(t, owner=t)
    return t  # autograd keeps the tensor itself, as without the meter


def _meter_unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class SavedActivationMeter:
    """Count what autograd keeps for backward while the context is active.

        with SavedActivationMeter() as m:
            loss = model(ids, labels=labels, reduction="sum")
        print(m.nbytes, m.count)          # activations the forward handed to backward
        loss.backward()                   # m.live_nbytes drops back as backward frees them

    Tensors are counted per unique storage. A view counts its whole storage, once.
    A tensor saved by several ops counts once.
    Parameters and their views (W.t() saved by a matmul) are not activations.
    They are counted apart, in `param_nbytes`, at the storage's size when saved.
    (ZeRO-3 later resizes it to 0.)
    Inside a selective layer autograd uses that layer's hooks, not the meter's: the innermost wins.
    Those hooks report here what they keep, and the inputs a note holds.
    So the meter counts everything a backward will read.
    Tensors recomputed inside backward are not counted.
    Only sizes and storage ids are stored, plus a weakref finalizer per saved tensor.
    So nothing lives longer than autograd keeps it.
    A storage counts as held while any tensor object saved from it is alive.
    So an input the caller still references stays "live".

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
