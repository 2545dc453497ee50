"""The trainer's process grid and failure reporting: the default process group and the device, every
group of the layout (tp innermost, then cp, then dp, then pp), and the ways a run stops — one readable
message and a non-zero exit on every rank, never a hang.

What it does
    setup        the default group: torchrun's (RANK / WORLD_SIZE; each --max-restarts attempt in a
                 store namespace of its own), or a 1-rank group for a plain `python train.py`, so the
                 same collectives run (as no-ops) in both cases; the device — CUDA + NCCL when
                 available, else CPU + gloo — is chosen here, once
    make_grid    every group of the layout, made at start-up by every rank in the same order (with
                 setup's device_id, each NCCL communicator too), plus two gloo groups: checkpoint /
                 export I/O waits (--io-timeout) and the pipeline's host-side check
    Grid         this rank, its device, its coordinates `at` (a checkpoint.Layout: what ZeRO shards
                 over and checkpoints record) and its groups
    stage        a context naming the training stage in which a collective failed or timed out, or
                 memory ran out (with the allocator's numbers): a StageError
    fail         one message on rank 0, the process group destroyed, exit status 2 on every rank

How train.py uses it
    main calls setup first (validation needs the world size), make_grid once the data is prepared
    (feed.py: rank 0 prepares while the others wait on a gloo group of their own), wraps each
    collective phase of the step in `stage`, and stops on bad input with `fail`; its __main__ turns a
    StageError into exit status 1 without waiting for peers that may be stuck in a collective.

Run
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2          # tp 2 × dp 2 × pp 2
    torchrun --nproc_per_node 8 train.py --tp 2 --cp 2 --zero 1  # tp 2 × cp 2 × dp 2

Invariants
    - rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank (tp peers are neighbours: the
      fastest links); every group exists before the first step, none starts lazily in a hook.
    - Groups are arguments: no global process-group object; train.py passes the Grid's groups down.

Builds on: checkpoint.py (Layout: the coordinates checkpoints record), pp.py (the tied-embedding ranks)
"""
from __future__ import annotations

import contextlib
import datetime
import os
import resource
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import checkpoint as CK
import pp as PP


# ------------------------------------------------------------------------------------------ setup
@dataclass
class Grid:
    rank: int
    world: int
    device: torch.device
    at: CK.Layout = CK.Layout()  # sizes and this rank's coordinates (also what checkpoints record)
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    embed_group: dist.ProcessGroup | None = None
    io_group: dist.ProcessGroup | None = None  # gloo, --io-timeout: checkpoint and export I/O waits
    cp_group: dist.ProcessGroup | None = None
    pp_check: dist.ProcessGroup | None = None  # gloo, the pp group's ranks: run_pipeline's host-side check
    cp: int = 1  # context-parallel degree; `at` counts dp · cp replicas (see make_grid)

    @property
    def data(self) -> tuple[int, int]:
        """(rank, size) among the replicas that read different rows: dp. The cp ranks of a replica
        read the same rows, each its own tokens of them."""
        return self.at.dp_rank // self.cp, self.at.dp // self.cp


def setup(timeout_s: float = 600.0) -> Grid:
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so the same
    collectives run (as no-ops) in both cases. A launcher that already formed the default group
    (the tests' forked ranks) is used as is."""
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:  # torchrun
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            # a torchrun restart (--max-restarts) reuses the agent's store: namespace each attempt,
            # or the new ranks may read a dead rank's address and fail to connect (torch 2.13, gloo)
            store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        else:
            store, rank, world = dist.HashStore(), 0, 1
        # device_id (CUDA): the NCCL communicator starts here, and every new_group splits it at
        # once (make_grid) — none starts lazily at its first collective, inside a backward hook
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device if cuda else None)
    return Grid(dist.get_rank(), dist.get_world_size(), device)


def make_grid(grid: Grid, tp: int, pp: int, timeout_s: float = 600.0, io_timeout_s: float = 3600.0,
              cp: int = 1) -> None:
    """rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank: tp innermost (its all-reduces are
    the most frequent: the fastest links), then cp (a ring of P2P every layer), then dp (one
    reduction per step), then pp (point-to-point between stages: the slowest links will do). The
    cp ranks hold the same parameters as dp replicas do and reduce gradients with them, so `at` —
    what ZeRO shards over and checkpoints record — counts dp·cp replicas, index dp_rank·cp + cp_rank,
    and grid.dp_group spans them all. Every rank creates every group, in the same order (new_group
    is collective), and keeps the ones it belongs to: all of them here, before any training (with
    setup's device_id, each NCCL communicator is made now, by splitting the default one). Then two
    gloo groups: checkpoint/export I/O waits (long timeout) and the pipeline's host-side check."""
    w = grid.world
    dpn = w // (tp * pp)  # dp · cp
    grid.at = CK.Layout(tp, dpn, pp, grid.rank % tp, grid.rank // tp % dpn, grid.rank // (tp * dpn))
    grid.cp = cp

    def mine(rank_lists: list[list[int]], backend: str | None = None) -> dist.ProcessGroup | None:
        found = None
        for ranks in rank_lists:
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
            found = g if grid.rank in ranks else found
        return found

    at = lambda p, d, t: CK.Layout(tp, dpn, pp, t, d, p).rank  # noqa: E731
    grid.tp_group = mine([[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dpn)])
    grid.dp_group = mine([[at(p, d, t) for d in range(dpn)] for p in range(pp) for t in range(tp)])
    pp_lists = [[at(p, d, t) for p in range(pp)] for d in range(dpn) for t in range(tp)]
    grid.pp_group = mine(pp_lists)
    grid.cp_group = mine([[at(p, d + c, t) for c in range(cp)] for p in range(pp)
                          for d in range(0, dpn, cp) for t in range(tp)])
    grid.embed_group = mine(PP.tied_embedding_ranks(w, pp))
    grid.io_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=io_timeout_s))
    grid.pp_check = mine(pp_lists, backend="gloo")


class StageError(RuntimeError):
    """A collective failed or timed out; the message names the training stage."""


@contextlib.contextmanager
def stage(name: str, grid: Grid, collectives: bool = True):
    """Name the training stage in which a collective failed or timed out (a peer died, hung, or
    disagreed) — a bare gloo/NCCL timeout does not say where the run was. Out of memory is reported
    as such, with the memory numbers (it is a RuntimeError too, but no peer is to blame).
    collectives=False (building the model): only out of memory is reported; other errors pass as
    they are (they are not a peer's)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise StageError(f"rank {grid.rank}: out of memory during {name}: {memory_report(grid.device)}. "
                         f"Lower the memory per rank: more --micro-batches (smaller micro-batches), "
                         f"--ac, --zero 2/3, a larger --tp or --pp. ({str(e).splitlines()[0]})") from e
    except (RuntimeError, dist.DistError) as e:
        if not collectives:
            raise
        raise StageError(f"rank {grid.rank}: distributed operation failed during {name}: {e}") from e


def memory_report(device: torch.device) -> str:
    """What the allocator holds when memory ran out (CUDA), or the process's peak RSS (CPU)."""
    if device.type != "cuda":
        return f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MB"
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    free, total = torch.cuda.mem_get_info(device)
    cuda = torch.cuda
    return (f"{mib(cuda.memory_allocated(device))} allocated, {mib(cuda.memory_reserved(device))} reserved, "
            f"peak {mib(cuda.max_memory_allocated(device))} allocated; {mib(free)} free of {mib(total)} "
            f"on {cuda.get_device_name(device)}")


def fail(msg: str, grid: Grid | None = None) -> None:
    """One readable message on rank 0 and a non-zero exit on every rank — never a hang."""
    if grid is None or grid.rank == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)
