"""Checkpoints: atomic, layout-independent, and safe to load (safetensors + JSON, nothing unpickled).

What it does
    `save_checkpoint` writes the training state of every rank: the fp32 master weights, AdamW's
    moments and step, this rank's RNG state, and the caller's JSON `extra` (step, sampler position,
    args...). `load_checkpoint` puts it back into an optimizer built under ANY layout (tp, pp, dp,
    ZeRO stage): everything is stored by HF parameter name, each piece with the place it holds in
    the global tensor, so a checkpoint saved under tp2·pp2·dp2·ZeRO-2 resumes under dp4·ZeRO-3 or in
    a single process. The compute parameters are not stored: they are the masters (fp32) or their
    cast (`opt._publish()` redoes it after loading).

        <dir>/step_00000100/
            meta.json              step, layout, global shapes, extra, every file: bytes, crc32
            rank00000.json         rank 0's coordinates, RNG state, index of the pieces it wrote
            rank00000.safetensors  those pieces: "<hf name>/master", "/exp_avg", "/exp_avg_sq"
            rank00001.json ...     (a rank that owns nothing writes only its .json)

    An index entry says where its 1-D pieces sit: the tp `shard` (dim, start, size) of the local
    parameter (None: replicated over tp), the local shape, and the flat range [start, start+n) of
    the local parameter (a ZeRO rank's piece; the whole parameter in stage 0).

Reference
    Megatron-LM's distributed checkpointing and PyTorch DCP (torch.distributed.checkpoint) keep the
    same idea: shards stored with their global offsets and resharded on load.

Run
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --save ckpt --save-every 100 --keep 3
    torchrun --nproc_per_node 4 train.py --zero 3 --save ckpt --resume auto   # same run, other layout

Invariants
    - Every element is written once, by its owner: stage 0 (masters are whole local parameters,
      replicated over dp): dp rank 0 only; ZeRO 1-3: every dp rank its own piece; a parameter
      replicated over tp: tp rank 0 only; the last pipeline stage's copy of a tied embedding
      (`lm_head.weight`): never (the first stage's embedding is the truth, and the copy is loaded
      from it). tp vocab padding rows (at/after the true vocab) are never stored and load as zero.
    - No rank gathers the model. On load a rank reads, one name at a time, only the saved tp slices
      that overlap its own (all ZeRO pieces of such a slice: at most one full tensor in memory),
      then cuts out its local tensor and its piece.
    - Atomic: all ranks write into `step_XXXXXXXX.tmp/` and fsync; the ranks then exchange what
      they wrote (`exchange`: file names, bytes, crc32 — never a directory listing, which can be
      stale on a network filesystem), and the lead rank checks it sees those files (all ranks must
      share one filesystem), writes meta.json last, renames the folder and fsyncs the parent. A
      crash leaves at most a `.tmp` folder that `latest_checkpoint` ignores and `prune` removes;
      older checkpoints are never touched by a save (saving the same step again moves the old
      folder to `.old` until the new one is in place). A rank's failure (a full disk) is exchanged
      too: every rank raises the same OSError and the lead removes the `.tmp` folder.
    - Coordination: save and load wait for each other only in `exchange` over the caller's group;
      train.py passes a gloo group with a long timeout of its own, so a slow writer trips no NCCL
      watchdog, and the lead prunes (`keep`) while the others wait there.
    - Loading parses JSON and safetensors only (no pickle: a foreign checkpoint cannot run code).
      A missing, truncated, corrupt (crc32) or mismatched file raises naming the file, before any
      tensor is copied; when one rank finds it, all raise.
    - RNG states come back only under the very same layout (same tp, dp, pp: every rank finds its
      own); otherwise they are left alone and `Restored.rng_restored` is False.

Builds on: model.py, weights.py
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from safetensors import safe_open

from model import LlamaConfig, Shard, global_shapes
from weights import file_crc32, fsync_path, io_error, write_safetensors

FORMAT = "attotron-checkpoint-2"  # 2: meta.json lists each file's bytes and crc32
READS = ("attotron-checkpoint-1", FORMAT)  # 1: sizes only (nothing to verify)
KINDS = ("master", "exp_avg", "exp_avg_sq")  # what is stored per parameter piece
STEP_DIR = re.compile(r"step_(\d{8})")
EMBED = "model.embed_tokens.weight"

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


@dataclass
class Restored:
    step: int
    extra: dict
    saved_layout: dict  # {"tp", "dp", "pp", "zero"} of the run that saved
    rng_restored: bool


# ------------------------------------------------------------------------------------- geometry
def _tied_copy(name: str, cfg: LlamaConfig) -> bool:
    """A last pipeline stage's own copy of the tied embedding (on a single stage it IS the
    embedding and named_parameters() lists it only as model.embed_tokens.weight)."""
    return name == "lm_head.weight" and cfg.tie_word_embeddings


def _box(full: tuple[int, ...], shard: Shard | None) -> Box:
    """The region of the global tensor a local tensor holds, padding rows excluded."""
    box = [(0, n) for n in full]
    if shard is not None:
        box[shard.dim] = (shard.start, min(shard.start + shard.size, full[shard.dim]))
    return box


def _size(box: Box) -> list[int]:
    return [max(hi - lo, 0) for lo, hi in box]


def _overlap(a: Box, b: Box) -> Box:
    return [(max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b)]


def _empty(box: Box) -> bool:
    return any(hi <= lo for lo, hi in box)


def _check_local(name: str, local: tuple[int, ...], full: tuple[int, ...], shard: Shard | None) -> int:
    """Validate a local shape against its global shape; return how many of its flat elements are
    real (not padding). Padding rows come last along dim 0, so the real ones are a flat prefix."""
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
    data = json.dumps(obj).encode()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise io_error(path, e) from e
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


# ------------------------------------------------------------------------------------- coordination
def exchange(report: dict, group: dist.ProcessGroup | None = None) -> list[dict]:
    """Every rank's JSON-able `report`, in group rank order, on every rank: the files a rank wrote,
    its error. JSON bytes in uint8 tensors, nothing pickled. It is also the barrier of checkpoint
    I/O: `group` should be a gloo group with a long timeout (train.py's io group), so ranks waiting
    for a slow writer neither hold a GPU collective nor trip the NCCL watchdog."""
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
    """Raise the same OSError on every rank when any report carries an error (each rank calls it
    with the same exchanged reports, so either all go on or all stop: nobody waits for a peer that
    gave up)."""
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
           layout: Layout) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The pieces this rank writes (flat views of its masters and moments, not copies) and their
    index entries (see the invariants)."""
    shapes = global_shapes(cfg)
    pieces = getattr(opt, "pieces", None)  # ZeRO 1-3: master i = flat piece of local param i
    if pieces is None and layout.dp_rank != 0:
        return {}, []  # stage 0: a dp replica of what dp rank 0 writes
    tensors, entries = {}, []
    for i, name in enumerate(opt.names):
        shard = shards.get(name)
        if _tied_copy(name, cfg) or (shard is None and layout.tp_rank != 0):
            continue
        local = tuple(opt.params[i].shape)
        real = _check_local(name, local, shapes[name], shard)
        start, n = (pieces[i].start, pieces[i].n) if pieces is not None else (0, math.prod(local))
        n = min(start + n, real) - start  # padding rows are never stored
        if n <= 0:
            continue
        master = opt.master[i]
        state = opt.optimizer.state.get(master, {})
        values = {"master": master} | {k: state[k] for k in KINDS[1:] if k in state}
        for kind, t in values.items():
            tensors[f"{name}/{kind}"] = t.detach().reshape(-1)[:n]  # (n,)
        where = None if shard is None else [shard.dim, shard.start, shard.size]
        entries.append({"name": name, "shard": where, "local_shape": list(local), "start": start, "n": n,
                        "kinds": list(values), "step": float(state["step"]) if "step" in state else None})
    return tensors, entries


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, opt: Any, cfg: LlamaConfig,
                    shards: dict[str, Shard], layout: Layout, extra: dict | None = None,
                    group: dist.ProcessGroup | None = None, keep: int | None = None) -> Path:
    """Write `<ckpt_dir>/step_<step>` atomically; every rank of `group` (default: all) calls it.
    opt: precision.MixedPrecisionOptimizer or a zero.py/zero3.py optimizer (any stage); shards: apply_tp's
    map; extra: JSON-able (step, sampler state, args...), stored once by the lead rank; group: the
    ranks' coordination (see `exchange`: give it a long timeout); keep: the lead then prunes to the
    newest `keep` checkpoints up to this step, while the others wait in `group`, not in a compute
    collective. Each tensor streams from the device to its file on its own (no copy of the rank's
    share). Any rank's failure (a full disk...) raises the same OSError on every rank, after the
    partial `.tmp` folder is removed. Returns the final path."""
    _check_layout(layout, group)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    final = Path(ckpt_dir) / f"step_{step:08d}"
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    lead = layout.rank == 0
    meta = {"format": FORMAT, "step": step, "layout": {**layout.sizes(), "zero": getattr(opt, "stage", 0)},
            "shapes": {k: list(v) for k, v in global_shapes(cfg).items()}, "extra": extra or {}}
    json.dumps(meta)  # a non-JSON-able extra fails here, before anything is written
    what = f"checkpoint step {step} not saved"
    report: dict[str, Any] = {"rank": layout.rank, "error": None}
    if lead:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash at this step
            tmp.mkdir(parents=True)
        except OSError as e:
            report["error"] = str(io_error(tmp, e))
    raise_errors(exchange(report, group), what)

    report["files"] = {}
    try:
        tensors, entries = _owned(opt, cfg, shards, layout)
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
            # meta.json lists what the ranks report they wrote, not a directory listing (which can
            # be stale on a network filesystem); a file rank 0 cannot see means no shared filesystem
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
    """Remove all but the newest `keep` complete checkpoints at or before step `upto` (default: all
    of them), and the debris of crashed saves (.tmp/.old folders). Checkpoints after `upto` are
    never touched: a run passes the step it just saved (only finite steps save), so it can neither
    remove that checkpoint nor count checkpoints of another run's later steps against it. Call it
    on one rank, between saves. Returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    debris = [p for p in Path(ckpt_dir).glob("step_*") if re.fullmatch(r"step_\d{8}\.(tmp|old)", p.name)]
    done = [p for s, p in complete_checkpoints(ckpt_dir) if upto is None or s <= upto]
    gone = done[:-keep] + debris
    for p in gone:
        shutil.rmtree(p)
    return gone


# ------------------------------------------------------------------------------------- load
class _Index:
    """All ranks' index entries of one checkpoint: name → saved tp slice → its pieces (by start)."""

    def __init__(self, path: Path, meta: dict, stack: contextlib.ExitStack, verify: bool):
        self.path, self.stack, self.files, self.verify = path, stack, {}, verify
        self.shapes = {k: tuple(v) for k, v in meta["shapes"].items()}
        # format 1 listed sizes only; format 2 {"bytes", "crc32"} per file
        self.info = {f: i if isinstance(i, dict) else {"bytes": i} for f, i in meta["files"].items()}
        for fname, info in self.info.items():
            f = path / fname
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing (meta.json lists it)")
            if f.stat().st_size != info["bytes"]:
                raise ValueError(f"{f}: {f.stat().st_size} bytes, meta.json says {info['bytes']} "
                                 f"(truncated?)")
        jsons = sorted(f for f in meta["files"] if f.endswith(".json"))
        self.check_sums([path / f for f in jsons])  # small, and every rank reads them all
        self.slices: dict[str, dict[Shard | None, list[tuple[Path, dict]]]] = {}
        for fname in jsons:
            tensors = path / fname.replace(".json", ".safetensors")
            for e in _read_json(path / fname)["entries"]:
                shard = None if e["shard"] is None else Shard(*e["shard"])
                self.slices.setdefault(e["name"], {}).setdefault(shard, []).append((tensors, e))
        for pieces in (p for by_shard in self.slices.values() for p in by_shard.values()):
            pieces.sort(key=lambda fe: fe[1]["start"])

    def tensor(self, file: Path, key: str, n: int, read: bool = True) -> torch.Tensor | None:
        """The 1-D tensor `key` of `file` (read=False: only check that it is there with length n)."""
        if file not in self.files:
            try:
                self.files[file] = self.stack.enter_context(safe_open(str(file), "pt"))
            except Exception as e:  # safetensors' own error type for a damaged header
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        f = self.files[file]
        if key not in f.keys():
            raise ValueError(f"{file}: has no tensor {key!r} (its .json index lists it)")
        shape = f.get_slice(key).get_shape()
        if list(shape) != [n]:
            raise ValueError(f"{file}: {key} has shape {list(shape)}, its index says [{n}]")
        return f.get_tensor(key) if read else None

    def check(self, key: str) -> dict:
        """Before anything is copied: the saved slices of `key` tile the global tensor, each slice's
        pieces tile it, and every piece is in its file with its length. Returns the first entry
        (all agree on the stored kinds; its step is the parameter's)."""
        full, by_shard = self.shapes[key], self.slices[key]
        first = next(iter(by_shard.values()))[0][1]
        boxes = []
        for shard, pieces in by_shard.items():
            local = pieces[0][1]["local_shape"]
            real = _check_local(key, tuple(local), full, shard)
            done = 0
            for file, e in pieces:
                if e["start"] != done or e["local_shape"] != local or e["kinds"] != first["kinds"]:
                    raise ValueError(f"{key}: saved pieces of slice {shard} do not tile it at element "
                                     f"{done} (entry in {file.with_suffix('.json')}: {e})")
                for kind in e["kinds"]:
                    self.tensor(file, f"{key}/{kind}", e["n"], read=False)
                done += e["n"]
            if done != real:
                raise ValueError(f"{key}: saved pieces of slice {shard} hold {done} of {real} elements "
                                 f"(files {sorted({str(f) for f, _ in pieces})})")
            boxes.append(_box(full, shard))
        disjoint = all(_empty(_overlap(a, b)) for k, a in enumerate(boxes) for b in boxes[:k])
        if not disjoint or sum(math.prod(_size(b)) for b in boxes) != math.prod(full):
            raise ValueError(f"{key}: the saved slices {list(by_shard)} do not tile the global shape "
                             f"{list(full)} (checkpoint {self.path})")
        return first

    def sources(self, key: str, box: Box) -> set[Path]:
        """The files `region(key, ·, box)` reads."""
        full = self.shapes[key]
        return {file for shard, pieces in self.slices[key].items()
                if not _empty(_overlap(box, _box(full, shard))) for file, _ in pieces}

    def check_sums(self, files: Iterable[Path]) -> None:
        """Compare each file's crc32 with meta.json's (read whole: the cost of one more read)."""
        for f in sorted(files):
            want = self.info[f.name].get("crc32")
            if self.verify and want is not None and (got := file_crc32(f)) != want:
                raise ValueError(f"{f}: checksum mismatch (crc32 {got:08x}, meta.json says {want:08x}): "
                                 f"the file is corrupt; resume from another checkpoint")

    def region(self, key: str, kind: str, box: Box) -> torch.Tensor:
        """`box` of the global tensor `key` (values of `kind`), from the saved slices overlapping it."""
        full = self.shapes[key]
        out = torch.empty(_size(box))
        for shard, pieces in self.slices[key].items():
            src_box = _box(full, shard)
            overlap = _overlap(box, src_box)
            if _empty(overlap):
                continue  # a slice this rank does not need: not read
            parts = [self.tensor(file, f"{key}/{kind}", e["n"]) for file, e in pieces]
            src = parts[0] if len(parts) == 1 else torch.cat(parts)
            src = src.view(_size(src_box))  # the saved local tensor without its padding rows
            if overlap == box == src_box:
                return src  # exactly the saved slice (same tp layout, or replicated): no copy
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, box))] = \
                src[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, src_box))]
        return out

    def piece(self, key: str, kind: str, box: Box, start: int, n: int) -> torch.Tensor:
        """Flat elements [start, start+n) of this rank's local tensor, whose real elements (`box`)
        are a flat prefix: padding rows come last, and are zero."""
        if n == 0:
            return torch.empty(0)  # a ZeRO rank owning nothing of this parameter reads nothing
        real = self.region(key, kind, box).reshape(-1)[start:start + n]
        return torch.cat([real, real.new_zeros(n - real.numel())])


def _describe_mismatch(saved: dict[str, list], now: dict[str, list]) -> str | None:
    """A few differing tensors and their count (a whole model's list would be kilobytes on one line)."""
    bad = [f"{k}: saved {saved.get(k)}, config {now.get(k)}"
           for k in sorted(set(now) | set(saved)) if saved.get(k) != now.get(k)]
    if not bad:
        return None
    more = f"; ... ({len(bad) - 3} more)" if len(bad) > 3 else ""
    return f"{len(bad)} of {len(set(now) | set(saved))} tensors differ: " + "; ".join(bad[:3]) + more


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, opt: Any, cfg: LlamaConfig, shards: dict[str, Shard],
                    layout: Layout, group: dist.ProcessGroup | None = None, verify: bool = True) -> Restored:
    """Fill `opt`'s masters and AdamW state (any layout, any ZeRO stage) from a checkpoint folder,
    publish them to the compute parameters (a collective for ZeRO: all ranks call this), and
    restore this rank's RNG when the layout is the saved one. Every check (files, sizes, crc32 of
    each file this rank reads when `verify`, shapes, tiling) runs before anything is copied, and
    the ranks agree over `group` (see `exchange`): when one fails, all raise."""
    _check_layout(layout, None)
    path = Path(path)
    pieces = getattr(opt, "pieces", None)
    # AdamW keeps its step count on the CPU unless it is capturable or fused
    on_device = any(opt.optimizer.defaults.get(k) for k in ("capturable", "fused"))
    with contextlib.ExitStack() as stack:
        error = None
        try:
            meta = _read_json(path / "meta.json")
            if meta.get("format") not in READS:
                raise ValueError(f"{path / 'meta.json'}: format {meta.get('format')!r}, expected {FORMAT!r}")
            mismatch = _describe_mismatch(meta["shapes"], {k: list(v) for k, v in global_shapes(cfg).items()})
            if mismatch:
                raise ValueError(f"{path / 'meta.json'}: checkpoint does not match the model config: "
                                 f"{mismatch}")
            index = _Index(path, meta, stack, verify)
            keys = [EMBED if _tied_copy(n, cfg) else n for n in opt.names]  # a tied copy loads the embedding
            missing = sorted({k for k in keys if k not in index.slices})
            if missing:
                raise ValueError(f"{path}: no saved pieces for {len(missing)} tensors: {missing[:5]}"
                                 + (" ..." if len(missing) > 5 else ""))
            boxes = [_box(index.shapes[key], shards.get(name)) for name, key in zip(opt.names, keys)]
            for name, key, p in zip(opt.names, keys, opt.params):
                _check_local(name, tuple(p.shape), index.shapes[key], shards.get(name))
            saved = {key: index.check(key) for key in dict.fromkeys(keys)}  # all checks before any copy
            index.check_sums({f for key, box in zip(keys, boxes) for f in index.sources(key, box)})
        except (OSError, ValueError, KeyError, TypeError) as e:
            error = e
        reports = exchange({"rank": layout.rank, "error": None if error is None else str(error)}, group)
        if error is not None:
            raise error
        raise_errors(reports, f"cannot load {path}")  # a peer failed: stop with it
        for i, (key, box) in enumerate(zip(keys, boxes)):
            master = opt.master[i]
            start, n = (pieces[i].start, pieces[i].n) if pieces is not None else (0, opt.params[i].numel())
            values = {kind: index.piece(key, kind, box, start, n).view(master.shape)
                      for kind in saved[key]["kinds"]}
            master.copy_(values.pop("master"))
            step = saved[key]["step"]
            if step is None:  # saved before the first step: no moments yet
                opt.optimizer.state.pop(master, None)
            else:
                opt.optimizer.state[master] = {
                    "step": torch.tensor(step, dtype=torch.float32,
                                         device=master.device if on_device else "cpu"),
                    **{k: v.to(master.device, master.dtype, copy=True) for k, v in values.items()}}
    opt._publish()  # masters → compute params (a copy, an all-gather, or ZeRO-3's param shards)
    same = {k: meta["layout"][k] for k in ("tp", "dp", "pp")} == layout.sizes()
    if same:
        rng = _read_json(path / f"rank{layout.rank:05d}.json")["rng"]
        torch.set_rng_state(torch.tensor(rng["cpu"], dtype=torch.uint8))
        device = opt.master[0].device if opt.master else torch.device("cpu")
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8), device)
    return Restored(meta["step"], meta["extra"], meta["layout"], same)
