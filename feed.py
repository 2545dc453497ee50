"""The trainer's data path. The corpus is prepared once. This rank's rows become micro-batches,
made a step ahead and copied to the device without blocking the host. Also here: the validation
loss over the held-out split.

What it does
    load_data, prepared_data   the pretraining rows (data.py). A prepared --data is used as is.
                               Otherwise it is prepared into --cache-dir, again when stale.
                               Without --data: the default corpus.
    load_val, val_loss         the held-out split and its loss. The forward runs through the same
                               pipeline, tp and ZeRO code as training, normalized like its loss.
    load_sft                   chats tokenized once into a cache every rank maps (sft.py)
    fit_seq_len, fit_batch_size  SFT's defaults shrunk to a small set of chats, said in the log
    held_out_chats, chat_val   the user's chats held out for SFT's validation loss
    sample_replies             --sample-prompts: greedy replies printed at each evaluation
    split_prompts              GRPO's held-out prompts, whose greedy replies' reward is evaluated
    split_pairs, dpo_val       DPO's held-out pairs and their implicit rewards (reward accuracy)
    evaluate                   exact-match accuracy of generated answers on sft chats
    prepared_once              the pattern both loaders use: rank 0 prepares, the others wait
    host_batch                 a step's rows → micro-batches of host tensors: the cp rank's zigzag
                               tokens, packed rows' document boundaries, pinned memory on CUDA
    to_device, get_batch       the copies to the device, non_blocking
    Prefetcher                 the next step's batch, made by a thread while this step computes
    host_copy                  a device value (the loss) copied to host memory in stream order

How train.py uses it
    load_data (the phase) calls load_sft, or load_data and load_val, before make_grid. In the
    step loop, a Prefetcher over host_batch gives each step its batch. host_copy takes the loss,
    read after the step's one sync. evaluate calls val_loss.

Run
    torchrun --nproc_per_node 4 train.py --data corpus.jsonl --eval-every 50   # rank 0 prepares
    torchrun --nproc_per_node 1 train.py --sft --packing ffd

Invariants
    - Only rank 0 prepares. The others wait on a gloo group with a DATA_WAIT timeout. A barrier
      of the default group would not do: its NCCL watchdog would kill them. Every rank then
      checks that it reads the meta.json rank 0 wrote.
    - The sampler gives a step's rows, sharded by dp rank only. So tp and pp peers read the same
      rows. The cp ranks of a replica read the same rows too, each its zigzag share.
    - Nothing here makes the training step wait for the device. A thread makes the batches on the
      host, pinned on CUDA and copied non_blocking. The loss comes back the same way.

Builds on: grid.py, cp.py, data.py, dp.py, formats.py, model.py, pairing.py, pp.py, precision.py, sft.py
"""
from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import cp as CP
import data
import dp
import formats as FM
import grid as G
import model as M
import pairing as PA
import pp as PP
import precision as P
import sft


# ------------------------------------------------------------------------------------------ data
# Ranks wait this long for rank 0 to prepare --data (tokenizing a large corpus takes hours).
DATA_WAIT = datetime.timedelta(hours=24)


def cache_dir(args: argparse.Namespace) -> Path:
    """--cache-dir, else $ATTOTRON_CACHE_DIR, else ~/.cache/attotron: where prepared data goes."""
    root = getattr(args, "cache_dir", None) or os.environ.get("ATTOTRON_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "attotron"


def cache_path(args: argparse.Namespace, suffix: str = ".attotron") -> Path:
    """The cache folder of --data: its name and a hash of its absolute path, under cache_dir."""
    source = Path(args.data).resolve()
    tag = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    return cache_dir(args) / f"{source.name}-{tag}{suffix}"


def cache_text(args: argparse.Namespace) -> str:
    """The start-up line's cache folder."""
    return f" · cache {cache_dir(args)}"


def prepared_data(args: argparse.Namespace) -> Path:
    """Rank 0: the prepared folder of --data, prepared when missing or stale. Stale means another
    corpus content, tokenizer or --val-fraction (data.is_prepared)."""
    if args.data is None:
        version = ".".join(map(str, sys.version_info[:3]))
        return data.default_corpus(cache_dir(args) / f"stdlib-{version}-8000000", val_fraction=args.val_fraction)
    want = str(Path(args.tokenizer).resolve()) if args.tokenizer not in (None, "bytes") else None
    if (Path(args.data) / "meta.json").is_file():  # already prepared: used as is
        got = data.read_meta(Path(args.data)).get("tokenizer_path")
        if args.tokenizer is not None and got != want:
            model = args.tokenizer == getattr(args, "init_from", None)  # pairing.settle took the model's own
            raise ValueError(f"--data {args.data} was prepared with the tokenizer {got or 'bytes'}, not "
                             f"--tokenizer {args.tokenizer}" + (
                                 " (--init-from's own): the model reads its tokenizer's ids, so pass the raw "
                                 "corpus as --data to prepare it again" if model else
                                 ": drop --tokenizer, or prepare the corpus again"))
        return Path(args.data)
    path = cache_path(args)  # in the cache folder, never beside the user's data
    column = getattr(args, "data_column", None)
    if not data.is_prepared(path, args.data, args.tokenizer, val_fraction=args.val_fraction, column=column):
        print(f"preparing {args.data} into {path}", flush=True)
        try:
            data.prepare(args.data, path, args.tokenizer, val_fraction=args.val_fraction, column=column,
                         cache_dir=cache_dir(args))
        except PermissionError as e:
            raise ValueError(f"cannot write the prepared data {path} ({e.strerror}): pass --cache-dir "
                             f"a folder you can write") from None
    return path


def prepared_once(prepare: Callable[[], Path], grid: G.Grid) -> Path:
    """Rank 0 runs `prepare()`, which finds or makes a prepared folder. The others wait on a gloo
    group with a DATA_WAIT timeout. A barrier of the default group would not do: its NCCL watchdog
    kills them after --timeout. Rank 0's outcome, the folder or its error, reaches every rank. Then
    every rank checks that it reads the very meta.json rank 0 wrote. So a multi-node run needs the
    data and the cache folder on a shared filesystem."""
    group = dist.new_group(backend="gloo", timeout=DATA_WAIT) if grid.world > 1 else None
    outcome = [None]
    if grid.rank == 0:
        try:
            path = prepare()
            outcome[0] = (str(path), (path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            outcome[0] = (None, str(e))
    if group is not None:
        dist.broadcast_object_list(outcome, src=0, group=group)
    path, meta = outcome[0]
    if path is None:
        raise ValueError(meta)  # rank 0's error, raised on every rank
    try:
        seen = "same" if (Path(path) / "meta.json").read_text() == meta else "a different meta.json"
    except OSError as e:
        seen = str(e)
    views = [None] * grid.world
    if group is not None:
        dist.all_gather_object(views, seen, group=group)
        dist.destroy_process_group(group)
    else:
        views = [seen]
    blind = [r for r, v in enumerate(views) if v != "same"]
    if blind:
        raise ValueError(f"ranks {blind} do not see the data rank 0 prepared at {path} (rank {blind[0]}: "
                         f"{views[blind[0]]}): a multi-node run needs --data and --cache-dir (where it is "
                         f"prepared) on a filesystem every node shares, or the prepared folder copied to the "
                         f"same path on each node")
    return Path(path)


def load_data(args: argparse.Namespace, grid: G.Grid) -> data.TokenDataset:
    """The pretraining rows, prepared once by rank 0 (`prepared_once`)."""
    return data.TokenDataset(prepared_once(lambda: prepared_data(args), grid), args.seq_len)


def load_val(args: argparse.Namespace, ds: data.TokenDataset,
             grid: G.Grid) -> tuple[data.TokenDataset | None, int]:
    """The held-out split of the prepared data, and how many global batches each evaluation reads.
    (None, 0) when there is none. That is an error if --eval-every asked for it."""
    want = 10 if args.eval_batches is None else args.eval_batches
    n_docs = ds.meta.get("num_val_documents", 0)
    try:
        val = data.TokenDataset(ds.data_dir, args.seq_len, split="val")
        batches = min(want, len(val) // args.batch_size)
        if not batches:
            raise ValueError(f"its {len(val)} rows of --seq-len {args.seq_len} do not fill one "
                             f"--batch-size {args.batch_size}")
    except ValueError as e:
        frac = ds.meta.get("val_fraction") or 0
        why = (f"the held-out split of {ds.data_dir} is too small: {e}" if n_docs else
               f"{ds.data_dir} was prepared without a held-out split (val_fraction 0)" if not frac else
               f"{ds.data_dir} has no held-out split: {ds.meta['num_documents']} documents × val_fraction "
               f"{frac} < 1 (a .txt file is one document: use a .jsonl, one document per line, or a folder)")
        if args.eval_every:
            raise ValueError(f"--eval-every {args.eval_every}: {why}") from None
        if grid.rank == 0:
            print(f"note: no validation loss: {why}", flush=True)
        return None, 0
    if grid.rank == 0:
        print(f"validation loss: {batches} batches × {args.batch_size} rows of the held-out split "
              f"({n_docs} documents, {len(val)} rows)", flush=True)
    return val, batches


@torch.no_grad()
def val_loss(chunks: list[M.Llama], val: data.TokenDataset, batches: int, args: argparse.Namespace,
             grid: G.Grid) -> float:
    """Mean token loss over the first `batches` global batches of the held-out split. Every
    evaluation reads the same rows. The forward runs through the same pipeline, tp and ZeRO code as
    training. It is normalized like the training loss: sum of token losses / all target tokens.
    So every layout gets the single-process value."""
    fwd = PP.forward_only(PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp,
                                                      args.virtual_stages))
    dp_rank, dp_size = grid.data
    per = args.batch_size // dp_size  # this dp rank's contiguous slice, as DPSampler takes it
    first = [b * args.batch_size + dp_rank * per for b in range(batches)]
    micro = [get_batch(val, list(range(i, i + per)), args.micro_batches, grid) for i in first]
    targets = dp.global_count(sum(P.count_targets(m["labels"]) for mb in micro for m in mb), grid.dp_group)
    total = torch.zeros((), dtype=torch.float32, device=grid.device)
    for mb in micro:
        total += PP.run_pipeline(chunks, fwd, mb, grid.pp_group, targets,
                                 seq_shards=args.tp if args.sp else 1, check_group=grid.pp_check,
                                 peer_groups=grid.pp_peers, hidden_size=chunks[0].config.hidden_size)
    if grid.at.dp > 1:  # (dp · cp replicas; no collective on a group of one)
        dist.all_reduce(total, group=grid.dp_group)
    return total.item()


def load_sft(args: argparse.Namespace, grid: G.Grid) -> tuple[sft.SFTDataset, sft.ChatTemplate, list]:
    """Chats from --data (a few held out: ds.held_out), or the built-in arithmetic set (train + held-out eval).
    Rank 0 tokenizes them once into a cache every rank maps (sft.prepare_sft). The cache sits in
    --cache-dir (`cache_path`). A new data file, tokenizer or chat template remakes it. A plain
    .jsonl file is read by sft.load_jsonl; other files and folders by formats.parse_all."""
    tok = data.load_tokenizer(args.tokenizer)
    tpl = PA.chat_template(args, tok)  # the tokenizer's own, or the built-in one (--chat-template builtin)
    if args.data and not (args.data_column or not str(args.data).endswith(".jsonl") or Path(args.data).is_dir()):
        out = cache_path(args, ".attotron-sft")
        key = lambda: {"sha256": sft.file_digest(args.data), "skip_bad": args.skip_bad}  # noqa: E731
        load = lambda: sft.load_jsonl(args.data, skip_bad=args.skip_bad)  # noqa: E731
        eval_set = []
    elif args.data:  # parquet, JSON, arrow, .jsonl.gz or a folder (formats.py); --data-column's turns
        out = cache_path(args, ".attotron-sft")
        key = lambda: {"sha256": FM.digest(args.data), "skip_bad": args.skip_bad,  # noqa: E731
                       "column": args.data_column}
        load = lambda: FM.parse_all(args.data, lambda r: sft.parse_conversation(  # noqa: E731
            FM.chat(r, args.data_column)), args.skip_bad, cache_dir(args))
        eval_set = []
    else:
        convs, eval_set = sft.arithmetic_chats()
        out = cache_dir(args) / "sft-arithmetic"
        key = lambda: hashlib.sha256(json.dumps(convs).encode()).hexdigest()  # noqa: E731
        load = lambda: (convs, 0)  # noqa: E731
    def prepare() -> Path:
        sft.prepare_sft(out, key, load, tpl)
        return out
    tokenized = sft.read_cache(prepared_once(prepare, grid))
    if tokenized is None:  # prepared_once checked its meta.json: only its arrays can be missing
        raise ValueError(f"the SFT cache {out} rank 0 wrote is incomplete on rank {grid.rank}")
    fitted = fit_seq_len(args, int(tokenized.lengths.max(initial=0)))  # a small set: shorter rows
    held, said = held_out_chats(args, len(tokenized.lengths))  # --data: the validation loss's chats
    rows = lambda only: sft.SFTDataset(tokenized, tok, args.seq_len, args.packing, args.overlong,  # noqa: E731
                                       template=tpl, only=only)
    ds = rows(None if held is None else ~held)
    ds.held_out = None if held is None else rows(held)
    fitted += fit_batch_size(args, len(ds), grid.world)
    if grid.rank == 0:
        bad = tokenized.skipped
        print(ds.report() + (f"\n  {bad} malformed lines skipped" if bad else "") + fitted + said, flush=True)
    return ds, tpl, eval_set


# ------------------------------------------------------------------------------------------ batches
@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, eval_set: list[sft.Conversation],
             max_new_tokens: int = 8, batch_size: int = 64, template: sft.ChatTemplate | None = None,
             temperature: float = 0.0, samples: int = 1, seed: int = 0, shard: tuple[int, int] = (0, 1)) -> float:
    """Exact-match accuracy over every assistant turn of eval_set, given the earlier turns as the
    chat so far. At temperature 0 the answers are greedy (model.generate). Above it, each turn gets
    `samples` sampled answers; answer j of turn i draws with the seed of (seed, i, j). The mean of
    their exact matches estimates pass@1: the RL literature's sampled accuracy. Prompts are batched
    shortest first, right-padded (generate's lengths). An answer must end with end_id within
    max_new_tokens. shard (rank, size): this rank decodes every size-th answer and returns its
    share of the accuracy (correct / all answers). The shards' values sum to the whole's."""
    if temperature == 0 and samples != 1:
        raise ValueError(f"greedy evaluation draws one answer per turn, not samples={samples}")
    if samples < 1:
        raise ValueError(f"samples={samples}: a sampled evaluation needs at least one draw per turn")
    tpl = template or sft.chat_template(tokenizer)
    device = next(model.parameters()).device
    prompts, golds = [], []
    for turns in eval_set:
        for k, t in enumerate(turns):
            if t["role"] == "assistant":
                prompts.append(tpl.render(turns[:k], True))
                golds.append(t["content"].strip())
    todo = sorted((len(p), i, j) for i, p in enumerate(prompts) for j in range(samples))  # (length, turn, draw)
    todo = todo[shard[0]::shard[1]]  # still shortest first; a draw's seed does not depend on its shard
    correct = 0
    for c in range(0, len(todo), batch_size):
        chunk = todo[c:c + batch_size]  # shortest first: little padding
        S = chunk[-1][0]
        x = torch.tensor([prompts[i] + [tpl.end_id] * (S - n) for n, i, _ in chunk], device=device)  # (b, S)
        seeds = [hash((seed, i, j)) % 2**63 for _, i, j in chunk] if temperature > 0 else None
        out = M.generate(model, x, max_new_tokens, tpl.end_id, temperature=temperature, seeds=seeds,
                         lengths=[n for n, _, _ in chunk])  # (b, S + steps): row b's answer from its length
        steps = out.shape[1] - S
        for (n, i, _), row in zip(chunk, out.tolist()):
            new = row[n:n + steps]  # the answer (the cells after it hold end_id: not part of it)
            if tpl.end_id in new:
                correct += tpl.decode(new[:new.index(tpl.end_id)]).strip() == golds[i]
    return correct / max(len(prompts) * samples, 1)


def host_batch(ds: data.TokenDataset | sft.SFTDataset, rows: list[int], micro_batches: int,
               grid: G.Grid) -> list[dict]:
    """This rank's rows as micro-batches of (b, S) host tensors: input_ids and labels, already
    shifted. Packed SFT rows add position_ids, restarting per conversation, and `docs`. `docs` are
    their document boundaries (attention.Documents), derived here on the host once per micro-batch.
    So no layer builds a mask, and the step never waits for a device→host copy. The tensors are
    pinned on CUDA, so `to_device` copies them without blocking the host."""
    items = [ds[i] for i in rows]
    if isinstance(items[0], dict):  # an item is a row (S,) or rows that stay together (n, S): a DPO pair
        batch = {k: torch.cat([it[k].view(-1, it[k].shape[-1]) for it in items]) for k in items[0]}
    else:
        tokens = torch.stack(items)  # (b, S+1)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if grid.cp > 1:  # this cp rank's zigzag tokens of every row (packed rows are refused with --cp)
        batch = {k: CP.shard_sequence(v, grid.cp, grid.at.dp_rank % grid.cp) for k, v in batch.items()}
    micro = [dict(zip(batch, parts)) for parts in zip(*(v.chunk(micro_batches) for v in batch.values()))]
    for mb in micro:
        if "position_ids" in mb:
            mb["docs"] = M.Documents.from_position_ids(mb["position_ids"], "cpu")
    if pin_batches(grid.device):  # contiguous first, since pin_memory keeps strides:
        # a strided pinned tensor's non_blocking copy goes through a pageable temporary (the host waits)
        micro = [{k: _pinned(v) for k, v in mb.items()} for mb in micro]
    return micro


def _pinned(v: torch.Tensor | M.Documents) -> torch.Tensor | M.Documents:
    return v.contiguous().pin_memory() if isinstance(v, torch.Tensor) else v.pin_memory()


def pin_batches(device: torch.device) -> bool:
    """Host batches in pinned memory, so that their non_blocking copies to `device` do not block
    (CUDA). A predicate so that tests/cuda_contract.py can point it at the meta device."""
    return device.type == "cuda"


def to_device(micro: list[dict], device: torch.device) -> list[dict]:
    """Start each micro-batch's copy to the device and return at once. From pinned memory a
    non_blocking copy runs in stream order while the host goes on. On CPU the tensors stay as they
    are. Tensors and attention.Documents move. A plain list (GRPO's prompt rows) stays on the host."""
    return [{k: v if isinstance(v, list) else v.to(device, non_blocking=True) for k, v in mb.items()}
            for mb in micro]


def get_batch(ds: data.TokenDataset | sft.SFTDataset, rows: list[int], micro_batches: int,
              grid: G.Grid) -> list[dict]:
    """`host_batch` on the device: what evaluation reads (training prefetches: `Prefetcher`)."""
    return to_device(host_batch(ds, rows, micro_batches, grid), grid.device)


class Prefetcher:
    """The next steps' batches, made in a background thread while this step computes. The thread
    draws the sampler's rows, reads the memmap, splits micro-batches, pins on CUDA (`host_batch`).
    `next()` hands the oldest batch over with the sampler state after it. A checkpoint of that step
    records this state, since the thread runs ahead. `next()` also starts the copies to the device
    (`to_device`). At most two batches wait: one queued, one made. next() raises the thread's
    error. The thread owns the sampler from start to end; resume loads its state before."""

    def __init__(self, load: Callable[[list[int]], list[dict]], sampler: dp.DPSampler, steps: int,
                 device: torch.device):
        self.device = device
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, args=(load, sampler, steps), daemon=True,
                                        name="attotron-prefetch")
        self._thread.start()

    def _run(self, load: Callable[[list[int]], list[dict]], sampler: dp.DPSampler, steps: int) -> None:
        try:
            if self.device.type == "cuda":  # pinning on this thread: this rank's GPU, not GPU 0
                torch.cuda.set_device(self.device)
            for _ in range(steps):
                rows = sampler.next_batch()
                self._queue.put((sampler.state_dict(), load(rows)))
        except BaseException as e:  # noqa: BLE001 - the training thread raises it
            self._queue.put(e)

    def next(self) -> tuple[dict, list[dict]]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        state, micro = item
        return state, to_device(micro, self.device)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A device value copied to host memory without waiting (CUDA: pinned, in stream order). Read
    after a later host sync, such as the step's grad norm, it costs nothing."""
    return t.detach().to("cpu", non_blocking=True)


# ------------------------------------------------------------------------------------------ small SFT sets
# The SFT defaults (--seq-len 1024, --batch-size 16) suit thousands of chats. Fifty short chats
# would pack into three rows, and a batch of 16 would repeat each about five times a step. So a
# default the user did not set (cli: args.fit_to_data) shrinks to the data, and the log says so.
def fit_seq_len(args: argparse.Namespace, longest: int) -> str:
    """Rows as long as the longest chat needs (a power of two from 64: every cp/tp split divides
    it), never longer than the default. Returns the log's note ('' when nothing changed)."""
    if "seq_len" not in args.fit_to_data or longest < 1:
        return ""
    fit = max(64, 1 << (longest - 1).bit_length())
    if fit >= args.seq_len:
        return ""
    default, args.seq_len = args.seq_len, fit
    return (f"\n  --seq-len {fit}, not the default {default}: the longest chat has {longest} tokens "
            f"(give --seq-len to choose)")


def fit_batch_size(args: argparse.Namespace, rows: int, world: int) -> str:
    """A global batch of at most the data's rows, in whole multiples of dp × micro-batches (each dp
    rank gets the same rows). Returns the log's note ('' when nothing changed)."""
    unit = world // (args.tp * args.cp * args.pp) * args.micro_batches
    if "batch_size" not in args.fit_to_data or rows >= args.batch_size or unit < 1:
        return ""
    default, args.batch_size = args.batch_size, max(unit, rows // unit * unit)
    return (f"\n  --batch-size {args.batch_size}, not the default {default}: the data has {rows} rows "
            f"(give --batch-size to choose)")


# ------------------------------------------------------------------------------------------ held-out chats
# SFT on the user's chats holds some out for a validation loss. --val-fraction's pretraining
# default (1%) holds out nothing of 50 chats, so a post-training set gets at least a few.
def held_out_chats(args: argparse.Namespace, n: int, what: str = "samples",
                   purpose: str = "the validation loss") -> tuple[np.ndarray | None, str]:
    """A (n,) bool mask of the samples held out, spread evenly over the file, and the log's line.
    --val-fraction given: that share. Default: 1%, but at least min(5, n/10) samples."""
    if not args.data:
        return None, ""
    k = round(args.val_fraction * n)
    if "val_fraction" in args.fit_to_data:
        k = max(k, min(5, n // 10))
    k = min(k, n - 1)
    if k < 1:
        return None, (f"\n  no held-out split: {n} {what} × --val-fraction {args.val_fraction:g} holds "
                      f"out none (raise --val-fraction)")
    mask = np.zeros(n, dtype=bool)
    mask[np.linspace(0, n - 1, k).round().astype(int)] = True
    how = ("--val-fraction" if "val_fraction" not in args.fit_to_data else
           "the post-training default: 1%, at least min(5, a tenth); --val-fraction to choose")
    return mask, f"\n  held out {k} of {n} {what} for {purpose} ({how})"


class HeldOutRows:
    """A held-out SFT set padded to whole global batches with rows that hold no target: val_loss
    then reads every real row once, and the padding rows add nothing to its sums."""

    def __init__(self, ds: sft.SFTDataset, batch_size: int, drop: tuple[str, ...]):
        self.ds, self.drop = ds, drop
        self.batches = -(-len(ds) // batch_size)
        self.length = self.batches * batch_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ds[min(i, len(self.ds) - 1)]
        if i >= len(self.ds):  # padding: the same shapes, no targets, no real tokens
            row = {**row, "labels": torch.full_like(row["labels"], sft.IGNORE_INDEX),
                   "real_tokens": torch.zeros_like(row["real_tokens"])}
        return {k: v for k, v in row.items() if k not in self.drop}


def chat_val(args: argparse.Namespace, ds: Any, drop: tuple[str, ...]) -> tuple[HeldOutRows | None, int]:
    """SFT's held-out rows and the global batches one evaluation reads ((None, 0) when none)."""
    held = getattr(ds, "held_out", None)
    if held is None:
        return None, 0
    val = HeldOutRows(held, args.batch_size, drop)
    return val, val.batches


# ------------------------------------------------------------------------------------------ sample replies
SAMPLE_TOKENS = 48  # new tokens a --sample-prompts reply may have


def read_sample_prompts(path: str) -> list[str]:
    """--sample-prompts: one prompt a line (blank lines skipped)."""
    prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--sample-prompts {path}: no prompt in it (one a line)")
    return prompts


@torch.no_grad()
def greedy_replies(model: torch.nn.Module, prompts: list[list[int]], end_id: int, max_new: int) -> list[list[int]]:
    """Each prompt's greedy continuation, without its end token. One prompt at a time: no padding."""
    device = next(model.parameters()).device
    replies = []
    for ids in prompts:
        new = M.generate(model, torch.tensor([ids], device=device), max_new, end_id)[0, len(ids):].tolist()
        replies.append(new[:new.index(end_id)] if end_id in new else new)
    return replies


def sample_replies(model: torch.nn.Module, prompts: list[str], tokenizer: Any,
                   template: sft.ChatTemplate | None) -> list[str]:
    """Each prompt's greedy continuation: a user turn rendered by the chat template, or raw text
    (pretraining, ending at the tokenizer's eos)."""
    if template is not None:
        ids = [template.render([{"role": "user", "content": text}], True) for text in prompts]
        return [template.decode(r) for r in greedy_replies(model, ids, template.end_id, SAMPLE_TOKENS)]
    ids = [tokenizer.encode(text) for text in prompts]
    return [tokenizer.decode(r) for r in greedy_replies(model, ids, tokenizer.eos_id, SAMPLE_TOKENS)]


def split_prompts(args: argparse.Namespace, ds: Any, grid: G.Grid) -> tuple[Any, Any]:
    """GRPO's prompts from --data: (the training ones, the held-out ones scored at each evaluation:
    None when none), by held_out_chats' rule. The log names how many."""
    held, said = held_out_chats(args, len(ds), "prompts", "the held-out reward")
    if grid.rank == 0 and said:
        print(said.strip(), flush=True)
    if held is None:
        return ds, None
    part = lambda mask: type(ds)([p for p, k in zip(ds.prompts, mask) if k],  # noqa: E731
                                 [g for g, k in zip(ds.golds, mask) if k])
    return part(~held), part(held)


def split_pairs(args: argparse.Namespace, ds: Any, grid: G.Grid) -> tuple[Any, Any]:
    """DPO's pairs from --data: (the training ones, the held-out ones whose implicit rewards each
    evaluation measures: None when none), by held_out_chats' rule. The log names how many."""
    held, said = held_out_chats(args, len(ds.docs), "pairs", "the held-out reward accuracy")
    if grid.rank == 0 and said:
        print(said.strip(), flush=True)
    if held is None:
        return ds, None
    return _pairs_subset(ds, ~held), _pairs_subset(ds, held)


def _pairs_subset(ds: Any, mask: np.ndarray) -> Any:
    """A copy of a dpo.PairDataset with the pairs `mask` keeps, packed again as it packs."""
    out = copy.copy(ds)
    out.docs = [d for d, k in zip(ds.docs, mask) if k]
    if ds.packing == "ffd":  # a pair takes both halves' positions in one row
        out.rows = sft.ffd([sum(len(ids) - 1 for ids, _ in d) for d in out.docs], ds.seq_len)
    else:
        out.rows = [[k] for k in range(len(out.docs))]
    out.ref = torch.zeros(len(out.docs), 2)  # (pairs, 2): filled by the reference pass
    return out


class HeldOutPairs:
    """Held-out DPO rows padded to whole global batches with rows that hold no pair."""

    def __init__(self, ds: Any, batch_size: int):
        self.ds, self.batches = ds, -(-len(ds) // batch_size)
        self.length = self.batches * batch_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ds[min(i, len(self.ds) - 1)]
        if i < len(self.ds):
            return row
        return {**row, "labels": torch.full_like(row["labels"], sft.IGNORE_INDEX),
                "dpo_seq": torch.full_like(row["dpo_seq"], -1), "dpo_ref": torch.zeros_like(row["dpo_ref"])}


@torch.no_grad()
def dpo_val(chunks: list[M.Llama], held: Any, loss: Any, args: argparse.Namespace, grid: G.Grid) -> torch.Tensor:
    """The DPO loss's reward sums (dpo.DPOLoss.reduce_log) over the held-out pairs, forward only
    through the training layout. Every held-out pair counts once."""
    fwd = PP.forward_only(PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp,
                                                      args.virtual_stages))
    rows, (dp_rank, dp_size) = HeldOutPairs(held, args.batch_size), grid.data
    per = args.batch_size // dp_size
    for b in range(rows.batches):
        start = b * args.batch_size + dp_rank * per
        micro = get_batch(rows, list(range(start, start + per)), args.micro_batches, grid)
        PP.run_pipeline(chunks, fwd, micro, grid.pp_group, 1, seq_shards=args.tp if args.sp else 1,
                        check_group=grid.pp_check, peer_groups=grid.pp_peers,
                        hidden_size=chunks[0].config.hidden_size)
    return loss.reduce_log(grid.device).cpu()
