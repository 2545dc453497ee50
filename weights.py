"""Weights: fill a meta-built Llama from safetensors or a seeded init, and write HF directories.

What it does
    `materialize` allocates a meta-device model and fills every parameter. The model comes from
    `model.build`, maybe already cut by pp.py and tp.py. The values come from an HF safetensors
    directory (one file, or sharded with `model.safetensors.index.json`), or from the parameter's
    own named generator. Only this rank's slice of each tensor is read.
    `param_reader` gives the same values piece by piece, without allocating the model.
    `read(name, start, stop)` returns elements [start, stop) of a parameter's flattened local
    values. So zero3.apply_zero(init=...) builds sharded state directly; `materialize_buffers`
    then allocates the buffers alone.
    `save_hf` writes full tensors as an HF directory that `AutoModelForCausalLM.from_pretrained`
    loads as the same family: config.json, generation_config.json, safetensors, the tokenizer.
    `load_config` reads a config.json of any of model.FAMILIES. One error names the file and
    every bad key and value. `load_hf` reads the whole model.
    Export streams too: export.py writes each pipeline stage's shard on its own rank.
    `write_safetensors` streams tensors into a file one at a time and returns its crc32.
    `begin_export` / `finish_hf` / `commit_export` stage an export beside its folder and swap it in.
    MoE experts: transformers 5 fuses them in memory, as model.py does. save_pretrained writes one
    tensor per expert and projection. `hf_pieces` maps one layout to the other. save_hf writes the
    per-expert one, and the reader takes either (only the experts a rank holds).

Reference
    The safetensors format (huggingface/safetensors) and transformers' sharded-checkpoint index
    (`model.safetensors.index.json`, `weight_map`).

Run
    torchrun --nproc_per_node 2 train.py --tp 2 --init-from out/pretrained   # each rank reads its slices

Invariants
    - Init is a function of (seed, HF name) only. Every parameter has its own generator, so the
      weights never depend on creation order or on how tp/pp/ZeRO slice the model. A `model.Shard`
      map (from tp.py) says which slice of each global tensor a rank holds. Only that slice is read.
      A seeded init draws a parameter's whole tensor (the generator's stream): one parameter in
      full at a time.
    - `to_empty` unties shared weights and leaves non-persistent buffers (RoPE `inv_freq`) as
      garbage, only ~100 ULP wrong. `materialize` re-ties the one and recomputes the other.
    - A truncated, corrupt or mismatched file raises, naming the file (or the tensor). A failed
      write (a full disk) names the file and leaves no partial file.
    - An export owns its folder. It is written whole into `<dir>.tmp` and swapped in. So no file of
      an older export survives, and a crash leaves the older one complete. A folder holding
      anything an export does not write is refused, never deleted.
    - An MoE export holds exactly save_pretrained's keys and loads bit-equal in transformers
      (tests/test_moe_models.py).

Builds on: model.py
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import json
import math
import os
import re
import shutil
import struct
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from model import Llama, LlamaConfig, Shard, build, global_shapes


def param_seed(seed: int, name: str) -> int:
    """Every parameter has its own generator, so init is independent of creation order and layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The full fp32 init of one parameter: norms 1, biases 0, matrices normal(0, std)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith((".bias", "_bias")):  # and DeepSeek's e_score_correction_bias (a state buffer)
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


# --- the experts on disk: transformers 5 fuses them in memory, save_pretrained writes one per expert
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")
Piece = tuple[str, tuple]  # a disk tensor's name and where it sits in the in-memory tensor (an index)


def hf_pieces(name: str, cfg: LlamaConfig) -> list[Piece]:
    """Where in-memory tensor `name` lives in transformers' on-disk layout (what save_pretrained
    writes). [(name, ())] for every tensor but a sparse layer's. There the router is `gate.weight`
    (Mixtral: under `block_sparse_moe`). Expert e of `gate_up_proj` (E, 2I, H) is two files'
    tensors, each (I, H). Rows [0, I) are the gate (Mixtral `w1`, else `gate_proj`). Rows [I, 2I)
    are the up (`w3`, `up_proj`). Expert e of `down_proj` (E, H, I) is one (`w2`, `down_proj`)."""
    m = _FUSED.fullmatch(name)
    if m is None:
        return [(name, ())]
    layer, what = m.groups()
    mixtral = cfg.model_type == "mixtral"
    block = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if what == "gate.weight":
        return [(f"{block}.gate.weight", ())]
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    e_all, i = range(cfg.num_experts), cfg.moe_intermediate_size
    if what == "experts.down_proj":
        return [(f"{block}.experts.{e}.{down}.weight", (e,)) for e in e_all]
    return [piece for e in e_all for piece in ((f"{block}.experts.{e}.{gate}.weight", (e, slice(0, i))),
                                                (f"{block}.experts.{e}.{up}.weight", (e, slice(i, 2 * i))))]


def expert_tensor(name: str) -> bool:
    """Whether in-memory tensor `name` holds an MoE layer's experts (`mlp.experts.gate_up_proj` or
    `down_proj`, (E, ...)): what expert parallelism splits by rows, one block of experts per ep rank.
    The experts are whole on every tp rank (docs/moe.md): their shard is ep's, never tp's."""
    m = _FUSED.fullmatch(name)
    return m is not None and m.group(2) != "gate.weight"


def _piece_shape(full: tuple[int, ...], at: tuple) -> tuple[int, ...]:
    """The shape of full-tensor[at] for an index of leading ints and row slices."""
    shape = list(full)
    for d, ix in enumerate(at):
        shape[d] = -1 if isinstance(ix, int) else ix.stop - ix.start
    return tuple(n for n in shape if n != -1)


def hf_disk_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Disk name → shape of every tensor save_pretrained writes for this config."""
    return {disk: _piece_shape(full, at) for name, full in global_shapes(cfg).items()
            for disk, at in hf_pieces(name, cfg)}


def hf_tensors(specs: list["Spec"], tensors: Iterable[torch.Tensor],
               cfg: LlamaConfig) -> tuple[list["Spec"], Iterator[torch.Tensor]]:
    """In-memory specs and tensors → transformers' on-disk ones (hf_pieces): views, no copy."""
    disk = [(d, _piece_shape(shape, at), dtype) for name, shape, dtype in specs for d, at in hf_pieces(name, cfg)]
    pieces = (t[at] for (name, _, _), t in zip(specs, tensors, strict=True) for _, at in hf_pieces(name, cfg))
    return disk, pieces


def _read_block(src: SafetensorsDir, name: str, full: tuple[int, ...], index: tuple[slice, ...],
                cfg: LlamaConfig) -> torch.Tensor:
    """tensor[index] of in-memory `name` from either layout on disk: as it is named in memory, or
    in pieces (hf_pieces), of which only the experts in index[0] are read."""
    pieces = hf_pieces(name, cfg)
    if name in src.files or len(pieces) == 1 and pieces[0][1] == ():
        return src.block(name if name in src.files else pieces[0][0], full, index)
    e0, e1, _ = index[0].indices(full[0])
    out = torch.empty((e1 - e0, *full[1:]))  # (experts read, ...) in memory's layout
    for disk, at in pieces:
        if e0 <= at[0] < e1:
            out[(at[0] - e0, *at[1:])] = src.block(disk, _piece_shape(full, at), (slice(None),))
    return out[(slice(None), *index[1:])]


def param_reader(model: Llama, seed: int = 0, hf_dir: str | None = None,
                 shards: dict[str, Shard] | None = None) -> Callable[[str, int, int], torch.Tensor]:
    """read(name, start, stop) → fp32 CPU tensor (stop - start,). It holds elements [start, stop)
    of parameter `name`'s flattened local values: this rank's tp slice (`shards`), zero past the
    global size. They come from `hf_dir` (only the local rows holding them leave the file). Or
    from the seeded init: the whole tensor is drawn, then cut. The model may stay on the meta
    device: only names and shapes are read from it."""
    shards = shards or {}
    cfg = model.config
    shapes = global_shapes(cfg)
    local = {n: tuple(p.shape) for n, p in named_state(model).items()}
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
            got = _read_block(src, key, full, tuple(index), cfg)
        else:
            got = init_tensor(key, full, seed, cfg.initializer_range)[tuple(index)]
        rows = torch.zeros((r1 - r0, *shape[1:]))  # padding (past the global size) stays zero
        rows[tuple(slice(0, n) for n in got.shape)] = got
        return rows.reshape(-1)[start - r0 * row:stop - r0 * row]
    return read


@torch.no_grad()
def materialize_buffers(model: Llama, device: torch.device | str,
                        read: Callable[[str, int, int], torch.Tensor] | None = None) -> Llama:
    """Allocate only the buffers (RoPE's inv_freq, recomputed): the parameters stay on the meta
    device for zero3.apply_zero(init=param_reader(...)) to build sharded. The state buffers
    (`state_buffers`) are filled by `read` (param_reader's), else zero."""
    rotary = model.model.rotary_emb
    rotary.to_empty(device=device)
    rotary.reset_buffers()
    for name, b in state_buffers(model).items():
        owner, _, attr = name.rpartition(".")
        t = torch.zeros(b.shape, dtype=b.dtype, device=device)
        if read is not None:
            t.copy_(read(name, 0, t.numel()).view_as(t))
        model.get_submodule(owner)._buffers[attr] = t
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
    for name, p in named_state(model).items():
        p.copy_(read(name, 0, p.numel()).view_as(p))
    model.model.rotary_emb.reset_buffers()
    return model


def state_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that are model state: those global_shapes names (DeepSeek's router bias). They
    load, save, checkpoint and export as parameters do; RoPE's tables are recomputed instead."""
    shapes = global_shapes(model.config) if hasattr(model, "config") else {}
    return {n: b for n, b in model.named_buffers() if n in shapes}


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """named_parameters, then the state buffers."""
    return dict(model.named_parameters()) | state_buffers(model)


# ------------------------------------------------------------------------------------- writing
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}
Spec = tuple[str, tuple[int, ...], torch.dtype]  # what a file's header needs before any value


def write_safetensors(path: str | os.PathLike, specs: list[Spec], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str] | None = None) -> dict[str, int]:
    """Stream `tensors` (in the order of `specs`, from any device) into a safetensors file, one at
    a time. The header follows from the specs, so no tensor waits in memory for the others.
    Returns {"bytes", "crc32"} of the whole file, the checksum taken from the bytes as written.
    The file is fsynced. A tensor that does not match its spec raises before it is written."""
    header, end = {}, 0
    for name, shape, dtype in specs:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [end, end + n]}
        end += n
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    head = struct.pack("<Q", len(text)) + text
    crc = zlib.crc32(head)
    try:
        with open(path, "wb") as f:
            f.write(head)
            for (name, shape, dtype), t in zip(specs, tensors, strict=True):
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"{path}: {name} is {t.dtype} {list(t.shape)}, expected {dtype} "
                                     f"{list(shape)}")
                cpu = t.detach().to("cpu").contiguous()
                if cpu.numel():  # the raw bytes, no copy (numpy() would mark the storage non-resizable
                    # for good, and ZeRO-3 frees its units by resizing their storages)
                    data = (ctypes.c_char * (cpu.numel() * cpu.element_size())).from_address(cpu.data_ptr())
                    crc = zlib.crc32(data, crc)
                    f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        Path(path).unlink(missing_ok=True)  # no partial file (a full disk gets its space back)
        if isinstance(e, OSError):
            raise io_error(path, e) from e
        raise
    return {"bytes": len(head) + end, "crc32": crc}


def io_error(path: str | os.PathLike, e: OSError) -> OSError:
    """An OSError whose message names the file and the cause in words (a write that fills the disk
    raises a bare "[Errno 28]" without the file)."""
    why = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}.get(
        e.errno, e.strerror or str(e))
    err = OSError(f"{path}: {why}")
    err.errno = e.errno
    return err


def file_crc32(path: str | os.PathLike, chunk: int = 16 << 20) -> int:
    """crc32 of a whole file, read in chunks (to compare with what write_safetensors returned)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def plan_shards(specs: list[Spec], max_bytes: int) -> list[list[Spec]]:
    """Consecutive groups of at most max_bytes of data (a larger tensor gets a file of its own)."""
    files, size = [[]], 0
    for spec in specs:
        n = math.prod(spec[1]) * spec[2].itemsize
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += n
    return files


def shard_name(i: int, n: int) -> str:
    """transformers' names: one model.safetensors, or model-0000i-of-0000n.safetensors + an index."""
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# ------------------------------------------------------------------------------------- HF dirs
# what an export writes (weights, configs, a tokenizer): the only files it may replace
_EXPORT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                          r"(generation_)?config\.json|tokenizer(_config)?\.json|special_tokens_map\.json|"
                          r"added_tokens\.json|chat_template\.(jinja|json)|tokenizer\.model|vocab\.json|"
                          r"merges\.txt|.*\.tmp")


def export_problem(out_dir: str | os.PathLike) -> str | None:
    """Why `out_dir` cannot receive an HF export (None: it can). An export owns its folder and
    replaces it whole, so an existing folder may hold only what an export writes."""
    out = Path(out_dir)
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} is a file, not a folder"
    foreign = sorted(p.name + "/" * p.is_dir() for p in out.iterdir()
                     if p.is_dir() or not _EXPORT_NAME.fullmatch(p.name))
    if foreign:
        return (f"{out} holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which an "
                f"export (it replaces the whole folder) would delete: pick a new or empty folder")
    return None


def staging_dir(out_dir: str | os.PathLike, suffix: str = ".tmp") -> Path:
    """`<out_dir>.tmp`, the sibling an export is written into (same filesystem: renames are atomic)."""
    out = Path(out_dir).resolve()
    return out.with_name(out.name + suffix)


def begin_export(out_dir: str | os.PathLike) -> Path:
    """A fresh staging_dir(out_dir) to write the export into (see commit_export)."""
    for path in (out_dir, staging_dir(out_dir), staging_dir(out_dir, ".old")):
        problem = export_problem(path)
        if problem:
            raise ValueError(f"cannot export: {problem}")
    tmp = staging_dir(out_dir)
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed export's debris
        shutil.rmtree(staging_dir(out_dir, ".old"), ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise io_error(tmp, e) from e
    return tmp


def commit_export(tmp: Path, out_dir: str | os.PathLike) -> None:
    """Swap the finished staging_dir in for out_dir: no file of an older export survives (a stale
    index or shard would make two loaders read different weights). Two renames: a crash between
    them leaves the new export in `<out_dir>.tmp` and the old one in `<out_dir>.old`."""
    out, old = Path(out_dir).resolve(), staging_dir(out_dir, ".old")
    fsync_path(tmp)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: its entries, e.g. a rename into it, become durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _byte_chars() -> list[str]:
    """GPT-2's table byte → printable character, the alphabet of `tokenizers`' ByteLevel."""
    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tokenizer(tok: object, out_dir: Path) -> None:
    """Tokenizer files `AutoTokenizer.from_pretrained(out_dir)` loads: a copy of an HF tokenizer
    (data.HFTokenizer's `.hf`), or for data.ByteTokenizer (ids 0-255 = bytes, then its specials) a
    byte-level BPE without merges: each byte is one token whose id is the byte."""
    if getattr(tok, "hf", None) is not None:
        tok.hf.save_pretrained(str(out_dir))
        return
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    t = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in tok.specials])
    name = {t.token_to_id(s): s for s in tok.specials}
    t.save(str(out_dir / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"]}  # no token_type_ids: generate() refuses
    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id), ("pad_token", tok.pad_id)):
        if i is not None:
            conf[key] = name[i]
    if getattr(tok, "chat_template", None):  # the template the model was trained with (pairing.py)
        conf["chat_template"] = tok.chat_template
    _write_text(out_dir / "tokenizer_config.json", json.dumps(conf, indent=2))


def finish_hf(tmp: Path, out_dir: str | os.PathLike, cfg: LlamaConfig, weight_map: dict[str, str],
              dtype: torch.dtype, tokenizer: object | None = None) -> None:
    """Complete an export written into `tmp` (begin_export): the index (several shards),
    config.json and generation_config.json with the tokenizer's bos/eos/pad ids, the tokenizer
    files; then swap it in (commit_export)."""
    # either layout: a fused expert tensor by its in-memory name, or all its pieces (hf_pieces)
    missing = sorted(n for n in global_shapes(cfg) if n not in weight_map
                     and any(d not in weight_map for d, _ in hf_pieces(n, cfg)))
    if missing:
        raise ValueError(f"export: no shard holds {len(missing)} tensors, e.g. {missing[:3]}")
    shapes = global_shapes(cfg) | hf_disk_shapes(cfg)
    if len(set(weight_map.values())) > 1:
        total = sum(math.prod(shapes[k]) * dtype.itemsize for k in weight_map)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2))
    d = cfg.to_hf()
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    if tokenizer is not None:  # the ids the model was trained with
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        if tokenizer.pad_id is not None:
            ids["pad_token_id"] = tokenizer.pad_id
        write_tokenizer(tokenizer, tmp)
    _write_text(tmp / "config.json", json.dumps(d | ids, indent=2))
    _write_text(tmp / "generation_config.json", json.dumps(ids, indent=2))
    commit_export(tmp, out_dir)


def save_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig, out_dir: str | os.PathLike,
            max_shard_bytes: int = 4 << 30, tokenizer: object | None = None) -> None:
    """Write full (gathered) tensors as an HF dir: config.json, generation_config.json, safetensors
    (sharded with an index when larger than max_shard_bytes), the tokenizer when given (a data.py
    tokenizer). Tied models write no `lm_head.weight`. The export owns out_dir: it is written whole
    beside it and swapped in (begin_export / commit_export), so no file of an older export
    survives and a crash leaves the older export complete."""
    shapes = global_shapes(cfg)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise ValueError(f"save_hf: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
    dtype = state[next(iter(shapes))].dtype
    # transformers' on-disk layout: one tensor per expert and projection (hf_pieces)
    specs, tensors = hf_tensors([(k, shapes[k], dtype) for k in shapes], (state[k] for k in shapes), cfg)
    files = plan_shards(specs, max_shard_bytes)
    tmp = begin_export(out_dir)
    weight_map = {}
    try:
        for i, specs in enumerate(files):
            name = shard_name(i, len(files))
            write_safetensors(tmp / name, specs, itertools.islice(tensors, len(specs)), metadata={"format": "pt"})
            weight_map |= {k: name for k, _, _ in specs}
        finish_hf(tmp, out_dir, cfg, weight_map, dtype, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the older export, if any, is untouched
        raise


def write_bytes(path: Path, data: bytes) -> dict[str, int]:
    """Write and fsync `data`; return {"bytes", "crc32"} of it (what checkpoint.py records per file).
    A failure (a full disk) raises io_error naming `path`."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise io_error(path, e) from e
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _write_text(path: Path, text: str) -> None:
    """Replace `path` atomically: a temporary file written in full, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_bytes(tmp, text.encode())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def load_config(hf_dir: str | os.PathLike) -> LlamaConfig:
    """config.json of an HF model dir; any problem is one ValueError naming the file and the keys."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (expected an HF model directory)")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 (byte {e.start})") from None
    try:
        return LlamaConfig.from_hf(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_hf(hf_dir: str | os.PathLike, device: torch.device | str = "cpu") -> Llama:
    """The whole model from an HF dir, on one device (fp32 as stored or upcast)."""
    return materialize(build(load_config(hf_dir)), device, hf_dir=str(hf_dir))


