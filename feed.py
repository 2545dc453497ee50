"""The trainer's data path. The corpus is prepared once. This rank's rows become micro-batches,
made a step ahead and copied to the device without blocking the host. Also here: the validation
loss over the held-out split.

What it does
    load_data, prepared_data   the pretraining rows (data.py). A prepared --data is used as is.
                               Otherwise it is prepared next to the corpus, again when stale.
                               Without --data: the default corpus.
    load_val, val_loss         the held-out split and its loss. The forward runs through the same
                               pipeline, tp and ZeRO code as training, normalized like its loss.
    load_sft                   chats tokenized once into a cache every rank maps (sft.py)
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

Builds on: grid.py, cp.py, data.py, dp.py, model.py, pp.py, precision.py, sft.py
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import cp as CP
import data
import dp
import grid as G
import model as M
import pp as PP
import precision as P
import sft


# ------------------------------------------------------------------------------------------ data
# Ranks wait this long for rank 0 to prepare --data (tokenizing a large corpus takes hours).
DATA_WAIT = datetime.timedelta(hours=24)


def prepared_data(args: argparse.Namespace) -> Path:
    """Rank 0: the prepared folder of --data, prepared when missing or stale. Stale means another
    corpus content, tokenizer or --val-fraction (data.is_prepared)."""
    if args.data is None:
        return data.default_corpus(val_fraction=args.val_fraction)
    want = str(Path(args.tokenizer).resolve()) if args.tokenizer not in (None, "bytes") else None
    if (Path(args.data) / "meta.json").is_file():  # already prepared: used as is
        got = data.read_meta(Path(args.data)).get("tokenizer_path")
        if args.tokenizer is not None and got != want:
            raise ValueError(f"--data {args.data} was prepared with the tokenizer {got or 'bytes'}, not "
                             f"--tokenizer {args.tokenizer}: drop --tokenizer, or prepare the corpus again")
        return Path(args.data)
    path = Path(str(args.data).rstrip("/") + ".attotron")  # prepared next to the corpus
    if not data.is_prepared(path, args.data, args.tokenizer, val_fraction=args.val_fraction):
        print(f"preparing {args.data} into {path}", flush=True)
        try:
            data.prepare(args.data, path, args.tokenizer, val_fraction=args.val_fraction)
        except PermissionError as e:
            raise ValueError(f"cannot write the prepared data {path} next to the corpus ({e.strerror}): "
                             f"prepare it where you can write (python -c \"import data; data.prepare("
                             f"'{args.data}', 'OUT')\") and pass --data OUT") from None
    return path


def prepared_once(prepare: Callable[[], Path], grid: G.Grid) -> Path:
    """Rank 0 runs `prepare()`, which finds or makes a prepared folder. The others wait on a gloo
    group with a DATA_WAIT timeout. A barrier of the default group would not do: its NCCL watchdog
    kills them after --timeout. Rank 0's outcome, the folder or its error, reaches every rank. Then
    every rank checks that it reads the very meta.json rank 0 wrote. So a multi-node run needs the
    data on a shared filesystem."""
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
                         f"{views[blind[0]]}): a multi-node run needs --data on a filesystem every "
                         f"node shares, or the prepared folder copied to the same path on each node")
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
    """Chats from --data (no eval set), or the built-in arithmetic set (train + held-out eval).
    Rank 0 tokenizes them once into a cache every rank maps (sft.prepare_sft). The cache sits next
    to --data, or in ~/.cache/attotron for the built-in set. A new data file, tokenizer or chat
    template remakes it."""
    tok = data.load_tokenizer(args.tokenizer)
    tpl = sft.chat_template(tok, args.reply_end)
    if args.data:
        out = Path(str(args.data).rstrip("/") + ".attotron-sft")
        key = lambda: {"sha256": sft.file_digest(args.data), "skip_bad": args.skip_bad}  # noqa: E731
        load = lambda: sft.load_jsonl(args.data, skip_bad=args.skip_bad)  # noqa: E731
        eval_set = []
    else:
        convs, eval_set = sft.arithmetic_chats()
        out = Path.home() / ".cache" / "attotron" / "sft-arithmetic"
        key = lambda: hashlib.sha256(json.dumps(convs).encode()).hexdigest()  # noqa: E731
        load = lambda: (convs, 0)  # noqa: E731
    def prepare() -> Path:
        sft.prepare_sft(out, key, load, tpl)
        return out
    tokenized = sft.read_cache(prepared_once(prepare, grid))
    if tokenized is None:  # prepared_once checked its meta.json: only its arrays can be missing
        raise ValueError(f"the SFT cache {out} rank 0 wrote is incomplete on rank {grid.rank}")
    ds = sft.SFTDataset(tokenized, tok, args.seq_len, args.packing, args.overlong, template=tpl)
    if grid.rank == 0:
        bad = tokenized.skipped
        print(ds.report() + (f"\n  {bad} malformed lines skipped" if bad else ""), flush=True)
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
