"""Checkpoints: the layout-independent format and its atomic save (safetensors + JSON, nothing pickled).

What it does
    `save_checkpoint` writes the training state of every rank.
    That is the fp32 master weights, AdamW's moments and step, the RNG state, and a JSON `extra`.
    `checkpoint_load.load_checkpoint` puts it back into an optimizer built under ANY layout.
    Everything is stored by HF parameter name, each piece with its place in the global tensor.
    So a checkpoint saved under tp2·pp2·dp2·ZeRO-2 resumes under dp4·ZeRO-3, or in one process.
    The compute parameters are not stored: they are the masters, or their cast.
    (`opt._publish()` redoes the cast after loading.) checkpoint_load.py reads and verifies.
    This file also finds complete checkpoints (`latest_checkpoint`) and prunes old ones.

        <dir>/step_00000100/
            meta.json              step, layout, global shapes, extra, every file: bytes, crc32
            rank00000.json         rank 0's coordinates, RNG state, index of the pieces it wrote
            rank00000.safetensors  those pieces: "<hf name>/master", "/exp_avg", "/exp_avg_sq"
            rank00001.json ...     (a rank that owns nothing writes only its .json)

    An index entry says where its 1-D pieces sit in the local parameter:
    the tp `shard` (dim, start, size), or None when replicated over tp;
    the local shape; and the flat range [start, start+n) that this rank holds (ZeRO's piece).

Reference
    Megatron-LM's distributed checkpointing and PyTorch DCP (torch.distributed.checkpoint).
    Both store shards with their global offsets and reshard on load.

Run
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --save ckpt --save-every 100 --keep 3
    torchrun --nproc_per_node 4 train.py --zero 3 --save ckpt --resume auto   # same run, other layout

Invariants (tests/test_checkpoint.py)
    - Every element is written once, by its owner.
      ZeRO 0: dp rank 0 writes. ZeRO 1-3: each dp rank writes its own piece.
      A parameter replicated over tp: tp rank 0 writes. tp's vocab padding rows are never stored.
      The last stage's copy of a tied embedding is never stored: it loads from the embedding.
      An expert tensor's ep shard is a box of the global (E, ...) tensor, as a tp slice is.
      Rank 0 of its replica group writes it. So ep = 2 resumes at ep = 1 or 4 (tests/test_moe_ep.py).
    - Atomic. All ranks write into `step_XXXXXXXX.tmp/` and fsync.
      They exchange what they wrote: names, bytes, crc32 (`exchange`, never a directory listing).
      The lead checks it sees those files: all ranks must share one filesystem.
      It writes meta.json last, renames the folder and fsyncs the parent.
      A crash leaves at most a `.tmp` folder. `latest_checkpoint` ignores it and `prune` removes it.
      A save never touches older checkpoints. The same step saved again waits in `.old`.
    - A rank's failure (a full disk) is exchanged too. Every rank raises the same OSError.
    - Ranks wait for each other only in `exchange`, over the caller's group.
      train.py passes a gloo group with a long timeout, so a slow writer trips no NCCL watchdog.
    - meta.json lists each file's bytes and crc32. A load checks each file before copying anything.

Builds on: model.py, weights.py
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from model import LlamaConfig, Shard, global_shapes
from weights import expert_tensor, fsync_path, io_error, write_bytes, write_safetensors

FORMAT = "attotron-checkpoint-2"  # 2: meta.json lists each file's bytes and crc32
KINDS = ("master", "exp_avg", "exp_avg_sq")  # what is stored per parameter piece
MORE_KINDS = ("momentum_buffer",)  # another rule's state (muon.py), stored and loaded the same way
STEP_DIR = re.compile(r"step_(\d{8})")

Box = list[tuple[int, int]]  # per dim [lo, hi) of a region of a global tensor


@dataclass(frozen=True)
class Layout:
    """This rank's place in the grid (tp innermost, then dp, then pp) and the grid's sizes."""
    tp: int = 1
    dp: int = 1
    pp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0

    @property
    def rank(self) -> int:
        return (self.pp_rank * self.dp + self.dp_rank) * self.tp + self.tp_rank

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp}


# ------------------------------------------------------------------------------------- geometry
def _tied_copy(name: str, cfg: LlamaConfig) -> bool:
    """A last pipeline stage's own copy of the tied embedding.

    On a single stage it IS the embedding: named_parameters() lists only model.embed_tokens.weight."""
    return name == "lm_head.weight" and cfg.tie_word_embeddings


def _box(full: tuple[int, ...], shard: Shard | None) -> Box:
    """The region of the global tensor a local tensor holds, padding rows excluded."""
    box = [(0, n) for n in full]
    if shard is not None:
        box[shard.dim] = (shard.start, min(shard.start + shard.size, full[shard.dim]))
    return box


def _size(box: Box) -> list[int]:
    return [max(hi - lo, 0) for lo, hi in box]


def _check_local(name: str, local: tuple[int, ...], full: tuple[int, ...], shard: Shard | None) -> int:
    """Check a local shape against its global shape. Return how many flat elements are real.

    Padding rows come last along dim 0, so the real elements are a flat prefix."""
    want = list(full)
    if shard is not None:
        want[shard.dim] = shard.size
    if list(local) != want:
        raise ValueError(f"{name}: local shape {list(local)} does not fit global shape {list(full)} "
                         f"with shard {shard}")
    real = math.prod(_size(_box(full, shard)))
    if real < math.prod(local) and shard.dim != 0:
        raise ValueError(f"{name}: padding along dim {shard.dim} is not supported (only dim 0)")
    return real


# ------------------------------------------------------------------------------------- files
def _write_json(path: Path, obj: Any) -> dict[str, int]:
    """Write, fsync; return {"bytes", "crc32"} of what was written (as write_safetensors does)."""
    return write_bytes(path, json.dumps(obj).encode())


# ------------------------------------------------------------------------------------- coordination
def exchange(report: dict, group: dist.ProcessGroup | None = None) -> list[dict]:
    """Every rank's JSON-able `report` (its files, its error), in group rank order, on every rank.

    The JSON travels as bytes in uint8 tensors: nothing is pickled.
    It is also the barrier of checkpoint I/O. Pass a gloo group with a long timeout (train.py's io group).
    Then ranks that wait for a slow writer hold no GPU collective and trip no NCCL watchdog."""
    if not dist.is_initialized():
        return [report]
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    data = torch.tensor(list(json.dumps(report).encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    longest = int(max(sizes))
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.cat([data, data.new_zeros(longest - data.numel())]), group=group)
    return [json.loads(p[:int(n)].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]


def raise_errors(reports: list[dict], what: str) -> None:
    """Raise the same OSError on every rank when any report carries an error.

    Each rank calls it with the same exchanged reports. So all go on, or all stop.
    Nobody waits for a peer that gave up."""
    bad = [f"rank {r.get('rank', i)}: {r['error']}" for i, r in enumerate(reports) if r.get("error")]
    if bad:
        more = f"; ... ({len(bad) - 4} more)" if len(bad) > 4 else ""
        raise OSError(f"{what}: " + "; ".join(bad[:4]) + more)


def _rng_state(device: torch.device) -> dict[str, list[int]]:
    state = {"cpu": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


# ------------------------------------------------------------------------------------- save
def _check_layout(layout: Layout, group: dist.ProcessGroup | None) -> None:
    sizes = (layout.tp, layout.dp, layout.pp)
    ranks = (layout.tp_rank, layout.dp_rank, layout.pp_rank)
    if not all(0 <= r < s for r, s in zip(ranks, sizes)):
        raise ValueError(f"layout {layout}: every rank must lie in [0, size)")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != math.prod(sizes):
        raise ValueError(f"layout tp·dp·pp = {math.prod(sizes)} ranks, but the group has {world}")


def _owned(opt: Any, cfg: LlamaConfig, shards: dict[str, Shard],
           layout: Layout, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The pieces this rank writes, and their index entries (see the invariants).

    The pieces are flat views of its masters and moments, not copies."""
    pieces = getattr(opt, "pieces", None)  # ZeRO 1-3: master i = flat piece of local param i
    replica_rank = getattr(opt, "replica_rank", lambda i: None)  # EP: an expert's rank among its holders
    tensors, entries = {}, []
    for i, name in enumerate(opt.names):
        shard = shards.get(name)
        holder = replica_rank(i)
        if pieces is None and (layout.dp_rank if holder is None else holder) != 0:
            continue  # stage 0: a replica of what rank 0 of its group (dp; an expert's replicas) writes
        tp_copy = shard is None or expert_tensor(name)  # an ep shard is whole on every tp rank
        if _tied_copy(name, cfg) or (tp_copy and layout.tp_rank != 0):
            continue
        local = tuple(opt.params[i].shape)
        real = _check_local(name, local, shapes[name], shard)
        start, n = (pieces[i].start, pieces[i].n) if pieces is not None else (0, math.prod(local))
        n = min(start + n, real) - start  # padding rows are never stored
        if n <= 0:
            continue
        master = opt.master[i]
        state = opt.optimizer.state.get(master, {})
        values = {"master": master} | {k: state[k] for k in KINDS[1:] + MORE_KINDS if k in state}
        for kind, t in values.items():
            tensors[f"{name}/{kind}"] = t.detach().reshape(-1)[:n]  # (n,)
        where = None if shard is None else [shard.dim, shard.start, shard.size]
        entries.append({"name": name, "shard": where, "local_shape": list(local), "start": start, "n": n,
                        "kinds": list(values), "step": float(state["step"]) if "step" in state else None})
    # the state buffers (a declared attribute of the optimizer, none by default: DeepSeek's router
    # bias). Whole on every rank of a stage; (dp 0, tp 0) writes them, as a replicated parameter.
    for name, b in getattr(opt, "state_buffers", {}).items():
        if layout.dp_rank == 0 and layout.tp_rank == 0:
            tensors[f"{name}/value"] = b.detach().reshape(-1)
            entries.append({"name": name, "shard": None, "local_shape": list(b.shape), "start": 0,
                            "n": b.numel(), "kinds": ["value"], "step": None})
    return tensors, entries


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, opt: Any, cfg: LlamaConfig,
                    shards: dict[str, Shard], layout: Layout, extra: dict | None = None,
                    group: dist.ProcessGroup | None = None, keep: int | None = None,
                    guard: Callable[[], None] | None = None,
                    shapes: dict[str, tuple[int, ...]] | None = None) -> Path:
    """Write `<ckpt_dir>/step_<step>` atomically. Every rank of `group` (default: all) calls it.

      - opt: precision.MixedPrecisionOptimizer, or a zero.py/zero3.py optimizer (any stage).
      - shards: apply_tp's map. extra: JSON-able (step, sampler state, args...), stored once.
      - group: the ranks' coordination (see `exchange`). Give it a long timeout.
      - keep: the lead then prunes to the newest `keep` checkpoints up to this step.
        The others wait in `group` meanwhile, not in a compute collective.
      - guard: the lead runs it before it writes anything.
        train.py checks that this run still holds the folder's lock.
        Its OSError stops every rank, like a full disk.
      - shapes: the full shape of every tensor the optimizer steps (default: global_shapes(cfg)).
        lora.py's adapters bring their own (lora.adapter_shapes).
    Each tensor streams from the device to its file on its own: no copy of the rank's share.
    Any rank's failure raises the same OSError on every rank, once the `.tmp` folder is removed.
    Returns the final path."""
    _check_layout(layout, group)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    shapes = global_shapes(cfg) if shapes is None else shapes
    final = Path(ckpt_dir) / f"step_{step:08d}"
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    lead = layout.rank == 0
    meta = {"format": FORMAT, "step": step, "layout": {**layout.sizes(), "zero": getattr(opt, "stage", 0)},
            "shapes": {k: list(v) for k, v in shapes.items()}, "extra": extra or {}}
    json.dumps(meta)  # a non-JSON-able extra fails here, before anything is written
    what = f"checkpoint step {step} not saved"
    report: dict[str, Any] = {"rank": layout.rank, "error": None}
    if lead:
        try:
            if guard is not None:
                guard()
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash at this step
            tmp.mkdir(parents=True)
        except OSError as e:
            report["error"] = str(io_error(tmp, e))
    raise_errors(exchange(report, group), what)

    report["files"] = {}
    try:
        tensors, entries = _owned(opt, cfg, shards, layout, shapes)
        name = f"rank{layout.rank:05d}"
        if tensors:
            specs = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
            report["files"][f"{name}.safetensors"] = write_safetensors(tmp / f"{name}.safetensors", specs,
                                                                       tensors.values())
        device = opt.master[0].device if opt.master else torch.device("cpu")
        report["files"][f"{name}.json"] = _write_json(tmp / f"{name}.json", {
            "coords": layout.__dict__, "entries": entries, "rng": _rng_state(device)})
    except Exception as e:  # noqa: BLE001 - reported to every rank below, never a lone raise
        report["error"] = str(e)
    reports = exchange(report, group)  # every rank's files are durable (or it failed)
    if lead and any(r["error"] for r in reports):
        shutil.rmtree(tmp, ignore_errors=True)  # the partial folder: debris nobody would load
    raise_errors(reports, what + f" (the partial {tmp.name} was removed)")

    done = {"rank": layout.rank, "error": None}
    if lead:
        try:
            # meta.json lists what the ranks report they wrote, not a directory listing.
            # A listing can be stale on a network filesystem.
            # A file that rank 0 cannot see means the ranks share no filesystem.
            meta["files"] = {f: info for r in reports for f, info in r["files"].items()}
            for f, info in meta["files"].items():
                if not (tmp / f).is_file() or (tmp / f).stat().st_size != info["bytes"]:
                    raise OSError(f"{tmp / f}: written by another rank ({info['bytes']} bytes), not seen "
                                  f"so by rank 0: all ranks must write one shared filesystem")
            _write_json(tmp / "meta.json", meta)  # last: a folder with meta.json is complete
            fsync_path(tmp)  # the folder's entries (file names) are durable too
            if final.exists():  # the same step saved again: swap, so a crash keeps one of the two
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_path(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            done["error"] = str(e)
        if done["error"] is None and keep is not None:
            try:
                prune(ckpt_dir, keep, upto=step)
            except OSError as e:
                done["error"] = f"saved {final}, but pruning older checkpoints failed: {e}"
    raise_errors(exchange(done, group), what)  # nobody moves on before the rename (and prune)
    return final


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).glob("step_*") if (m := STEP_DIR.fullmatch(p.name))]
    return sorted((s, p) for s, p in found if (p / "meta.json").is_file())


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ckpt_dir (for `--resume auto`), or None."""
    done = complete_checkpoints(ckpt_dir)
    return done[-1][1] if done else None


def prune(ckpt_dir: str | os.PathLike, keep: int, upto: int | None = None) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints at or before step `upto`.

    `upto` None means all of them. It removes the debris of crashed saves too (.tmp/.old folders).
    Checkpoints after `upto` are never touched. A run passes the step it just saved.
    So it cannot remove that checkpoint, nor count another run's later steps against it.
    Call it on one rank, between saves. Returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    debris = [p for p in Path(ckpt_dir).glob("step_*") if re.fullmatch(r"step_\d{8}\.(tmp|old)", p.name)]
    done = [p for s, p in complete_checkpoints(ckpt_dir) if upto is None or s <= upto]
    gone = done[:-keep] + debris
    for p in gone:
        shutil.rmtree(p)
    return gone
