"""The trainer's data path: the corpus prepared once, this rank's rows as micro-batches made a step
ahead and copied to the device without blocking the host, and the validation loss over the held-out
split.

What it does
    load_data, prepared_data   the pretraining rows (data.py): --data used as is when prepared,
                               else prepared next to the corpus (again when stale), or the default
                               corpus
    load_val, val_loss         the held-out split and its loss, forward only through the same
                               pipeline, tp and ZeRO code as training, normalized like its loss
    load_sft                   chats tokenized once into a cache every rank maps (sft.py)
    evaluate                   exact-match accuracy of greedy answers (model.generate) on sft chats
    prepared_once              the pattern both use: rank 0 prepares, the others wait
    host_batch                 a step's rows → micro-batches of host tensors: the cp rank's zigzag
                               tokens, packed rows' document boundaries, pinned memory on CUDA
    to_device, get_batch       the copies to the device, non_blocking
    Prefetcher                 the next step's batch, made by a thread while this step computes
    host_copy                  a device value (the loss) copied to host memory in stream order

How train.py uses it
    main: load_sft, or load_data and load_val, before make_grid; a Prefetcher over host_batch feeds
    the loop (its next() marks each step); host_copy takes the step's loss, read after the step's
    one sync; val_loss at each evaluation.

Run
    torchrun --nproc_per_node 4 train.py --data corpus.jsonl --eval-every 50   # rank 0 prepares
    torchrun --nproc_per_node 1 train.py --sft --packing ffd

Invariants
    - Only rank 0 prepares; the others wait on a gloo group with a DATA_WAIT timeout, never in a
      barrier of the default group (whose NCCL watchdog would kill them), and every rank checks that
      it reads the meta.json rank 0 wrote.
    - The rows of a step come from the sampler, sharded by dp rank only: tp and pp peers read the
      same rows; the cp ranks of a replica the same rows, each its zigzag share of their tokens.
    - Nothing here makes the training step wait for the device: batches are made on the host by a
      thread, pinned on CUDA and copied non_blocking; the loss comes back the same way.

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
    """Rank 0: the prepared folder of --data, preparing it when missing or stale (another corpus
    content, tokenizer or --val-fraction: data.is_prepared)."""
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
    """Rank 0 runs `prepare()` (find or make a prepared folder) while the others wait on a gloo group
    with a DATA_WAIT timeout — not in a barrier of the default group, whose NCCL watchdog would kill
    them after --timeout. Rank 0's outcome (the folder, or its error) reaches every rank; then every
    rank checks that it reads the very meta.json rank 0 wrote: a multi-node run needs the data on a
    shared filesystem."""
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
    """The held-out split of the prepared data and the global batches of it each evaluation reads;
    (None, 0) when there is none — an error if --eval-every asked for it."""
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
    """Mean token loss over the first `batches` global batches of the held-out split (the same rows
    at every evaluation), forward only through the same pipeline, tp and ZeRO code as training and
    normalized like its loss (sum of token losses / all target tokens): the single-process value in
    every layout."""
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
    """Chats from --data (no eval set) or the built-in arithmetic set (train + held-out eval), tokenized
    once by rank 0 into a cache every rank maps (sft.prepare_sft: next to --data, in ~/.cache/attotron
    for the built-in set), re-made when the data, the tokenizer or the chat template changes."""
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
             temperature: float = 0.0, samples: int = 1, seed: int = 0) -> float:
    """Exact-match accuracy over every assistant turn of eval_set, the earlier turns given as the
    reference chat. Greedy answers (model.generate) at temperature 0. Above it, `samples` sampled
    answers per turn (answer j of turn i draws with the seed of (seed, i, j)) and the mean of their
    exact matches: pass@1 estimated from `samples` draws, the RL literature's sampled accuracy.
    Prompts are batched shortest first, right-padded (generate's lengths); an answer must end with
    end_id within max_new_tokens."""
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
    """This rank's rows as micro-batches of (b, S) host tensors: input_ids, labels (already shifted)
    and, for packed SFT rows, position_ids (restarting per conversation) and `docs`, their document
    boundaries (attention.Documents: derived here, on the host, once per micro-batch, so no layer
    builds a mask and the step never waits for a device→host copy). Pinned on CUDA, so that
    `to_device` copies them without blocking the host."""
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
    if pin_batches(grid.device):  # contiguous first: pin_memory keeps strides, and a strided
        # pinned tensor's non_blocking copy goes through a pageable temporary (the host waits)
        micro = [{k: _pinned(v) for k, v in mb.items()} for mb in micro]
    return micro


def _pinned(v: torch.Tensor | M.Documents) -> torch.Tensor | M.Documents:
    return v.contiguous().pin_memory() if isinstance(v, torch.Tensor) else v.pin_memory()


def pin_batches(device: torch.device) -> bool:
    """Host batches in pinned memory, so that their non_blocking copies to `device` do not block
    (CUDA). A predicate so that tests/cuda_contract.py can point it at the meta device."""
    return device.type == "cuda"


def to_device(micro: list[dict], device: torch.device) -> list[dict]:
    """Start each micro-batch's copy to the device and return at once (non_blocking: from pinned
    memory the copy runs in stream order while the host goes on; on CPU the tensors themselves).
    Tensors and attention.Documents move; a plain list (GRPO's prompt rows, read on the host) stays."""
    return [{k: v if isinstance(v, list) else v.to(device, non_blocking=True) for k, v in mb.items()}
            for mb in micro]


def get_batch(ds: data.TokenDataset | sft.SFTDataset, rows: list[int], micro_batches: int,
              grid: G.Grid) -> list[dict]:
    """`host_batch` on the device: what evaluation reads (training prefetches: `Prefetcher`)."""
    return to_device(host_batch(ds, rows, micro_batches, grid), grid.device)


class Prefetcher:
    """The next steps' batches, made in a background thread while this step computes: the sampler's
    rows, the memmap reads, the micro-batch split, pinned host memory on CUDA (`host_batch`).
    `next()` hands the oldest one over with the sampler state after it — what a checkpoint of that
    step records, the thread being ahead — and starts its copies to the device (`to_device`). At
    most two batches wait (one queued, one made); an error in the thread is raised by next(). The
    thread owns the sampler from start to end (its state is loaded before: resume)."""

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
    """A device value copied to host memory without waiting (CUDA: into pinned memory, in stream
    order): read it after a later host sync — the step's grad norm — and the read costs nothing."""
    return t.detach().to("cpu", non_blocking=True)
