"""Loading checkpoints into any layout: verify every file, then read only the slices a rank needs.

What it does
    `load_checkpoint` reads a checkpoint that checkpoint.py's `save_checkpoint` wrote.
    It fills an optimizer built under ANY layout: tp, pp, dp, any ZeRO stage.
    The pieces are stored by HF parameter name, with their place in the global tensor.
    (checkpoint.py describes the format.)
    So a rank takes the region that its local tensor holds from the saved tp slices overlapping it.
    Then it cuts its ZeRO piece out of that region.
    A checkpoint saved under tp2·pp2·dp2·ZeRO-2 resumes under dp4·ZeRO-3, or in one process.
    Then `opt._publish()` casts the masters to the compute parameters.
    The RNG comes back when the layout is the saved one.

Reference
    PyTorch DCP (torch.distributed.checkpoint) and Megatron-LM's distributed checkpointing.
    They reshard on load the same way: each saved shard carries its global offsets.

Run
    torchrun --nproc_per_node 4 train.py --zero 3 --save ckpt --resume auto   # any saved layout

Invariants (tests/test_checkpoint.py)
    - No rank gathers the model. A rank reads one name at a time.
      It reads only the saved tp slices that overlap its own, with all their ZeRO pieces.
      So at most one full tensor is in memory. Then it cuts out its local tensor and its piece.
    - Loading parses JSON and safetensors only. No pickle: a foreign checkpoint cannot run code.
      A missing, truncated, corrupt (crc32) or mismatched file raises, naming the file.
      That happens before any tensor is copied. When one rank finds it, all raise.
    - `verify` checks each file a rank reads against the crc32 that meta.json lists.
      Every rank reads all the small .json indexes, and only the .safetensors it needs.
    - RNG states come back only under the very same layout: same tp, dp and pp.
      Then every rank finds its own. Otherwise they are left alone: `Restored.rng_restored` is False.

Builds on: checkpoint.py (the format, Layout, the box geometry, `exchange`), model.py, weights.py
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from safetensors import safe_open

from checkpoint import (FORMAT, Box, Layout, _box, _check_layout, _check_local, _size, _tied_copy, exchange,
                        raise_errors)
from model import LlamaConfig, Shard, global_shapes
from weights import file_crc32

READS = ("attotron-checkpoint-1", FORMAT)  # 1: sizes only (nothing to verify)
EMBED = "model.embed_tokens.weight"


@dataclass
class Restored:
    step: int
    extra: dict
    saved_layout: dict  # {"tp", "dp", "pp", "zero"} of the run that saved
    rng_restored: bool


# ------------------------------------------------------------------------------------- geometry
def _overlap(a: Box, b: Box) -> Box:
    return [(max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b)]


def _empty(box: Box) -> bool:
    return any(hi <= lo for lo, hi in box)


# ------------------------------------------------------------------------------------- files
def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


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
        """Check `key` before anything is copied.

        The saved slices of `key` must tile the global tensor, and each slice's pieces the slice.
        Every piece must be in its file, with its length.
        Returns the first entry: all agree on the stored kinds, and its step is the parameter's."""
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
        """Flat elements [start, start+n) of this rank's local tensor.

        Its real elements (`box`) are a flat prefix. Padding rows come last, and are zero."""
        if n == 0:
            return torch.empty(0)  # a ZeRO rank owning nothing of this parameter reads nothing
        real = self.region(key, kind, box).reshape(-1)[start:start + n]
        return torch.cat([real, real.new_zeros(n - real.numel())])


def _describe_mismatch(saved: dict[str, list], now: dict[str, list]) -> str | None:
    """A few differing tensors, and their count. A whole model's list would be kilobytes long."""
    bad = [f"{k}: saved {saved.get(k)}, config {now.get(k)}"
           for k in sorted(set(now) | set(saved)) if saved.get(k) != now.get(k)]
    if not bad:
        return None
    more = f"; ... ({len(bad) - 3} more)" if len(bad) > 3 else ""
    return f"{len(bad)} of {len(set(now) | set(saved))} tensors differ: " + "; ".join(bad[:3]) + more


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, opt: Any, cfg: LlamaConfig, shards: dict[str, Shard],
                    layout: Layout, group: dist.ProcessGroup | None = None, verify: bool = True,
                    shapes: dict[str, tuple[int, ...]] | None = None) -> Restored:
    """Fill `opt`'s masters and AdamW state from a checkpoint folder. Any layout, any ZeRO stage.

    Then it publishes them to the compute parameters. For ZeRO that is a collective: all ranks call it.
    It restores this rank's RNG when the layout is the saved one.
    Every check runs before anything is copied: files, sizes, shapes, tiling.
    With `verify` it checks the crc32 of each file this rank reads too.
    shapes: the full shapes the checkpoint must hold (default: global_shapes(cfg); see save_checkpoint).
    The ranks agree over `group` (see `exchange`): when one fails, all raise."""
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
            want = global_shapes(cfg) if shapes is None else shapes
            mismatch = _describe_mismatch(meta["shapes"], {k: list(v) for k, v in want.items()})
            if mismatch:
                raise ValueError(f"{path / 'meta.json'}: checkpoint does not match the model config: "
                                 f"{mismatch}")
            index = _Index(path, meta, stack, verify)
            keys = [EMBED if _tied_copy(n, cfg) else n for n in opt.names]  # a tied copy loads the embedding
            keys += list(getattr(opt, "state_buffers", {}))  # DeepSeek's router bias (checkpoint.py)
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
        for name, b in getattr(opt, "state_buffers", {}).items():  # checked before any copy, as above
            b.copy_(index.piece(name, "value", _box(index.shapes[name], None), 0, b.numel()).view(b.shape))
    opt._publish()  # masters → compute params (a copy, an all-gather, or ZeRO-3's param shards)
    same = {k: meta["layout"][k] for k in ("tp", "dp", "pp")} == layout.sizes()
    if same:
        rng = _read_json(path / f"rank{layout.rank:05d}.json")["rng"]
        torch.set_rng_state(torch.tensor(rng["cpu"], dtype=torch.uint8))
        device = opt.master[0].device if opt.master else torch.device("cpu")
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8), device)
    return Restored(meta["step"], meta["extra"], meta["layout"], same)
