"""The trainer's process grid and failure reporting. setup makes the default process group and
picks the device. make_grid makes every group of the layout: tp innermost, then cp, dp, pp.
When a run fails, rank 0 prints one readable message and every rank exits non-zero. None hangs.

What it does
    setup        the default group: torchrun's (RANK / WORLD_SIZE), or a 1-rank group for a plain
                 `python train.py`. So the same collectives run in both cases, as no-ops in the
                 second. Each --max-restarts attempt gets a store namespace of its own. The device
                 is chosen here, once: CUDA and NCCL when available, else CPU and gloo.
    make_grid    every group of the layout, made at start-up by every rank in the same order
                 (`family`). With setup's device_id, each NCCL communicator starts then too.
                 Each pipeline neighbour pair gets a 2-rank group: NCCL serializes a group's P2P
                 (docs/pipeline-nccl.md). A degree-1 dimension gets `solo`: no one-rank NCCL
                 communicator. Two gloo groups carry checkpoint and export I/O waits
                 (--io-timeout) and the pipeline's host-side check.
    Grid         this rank, its device, its groups, and its coordinates `at`. `at` is a
                 checkpoint.Layout: what ZeRO shards over and checkpoints record.
    stage        a context that names the training stage where a collective failed or timed out,
                 or memory ran out (with the allocator's numbers): a StageError
    fail         one message on rank 0, the process group destroyed, exit status 2 on every rank

How train.py uses it
    configure calls setup first: validation needs the world size. load_data calls make_grid once
    the data is prepared; rank 0 prepares while the others wait (feed.py). Each collective phase
    of a step runs inside `stage`. Bad input stops the run with `fail`. train.py's __main__ turns
    a StageError into exit status 1, without waiting for peers stuck in a collective.

Run
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2          # tp 2 × dp 2 × pp 2
    torchrun --nproc_per_node 8 train.py --tp 2 --cp 2 --zero 1  # tp 2 × cp 2 × dp 2
    torchrun --nproc_per_node 8 train.py --init-from mixtral --ep 4  # dp 8, experts over 4 ranks

Invariants
    - rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank. So tp peers are neighbours, on
      the fastest links. Every group exists before the first step; none starts lazily in a hook.
    - Groups are arguments: no global process-group object. train.py passes the Grid's groups down.
    - Every rank makes the same new_group calls in the same order; only `solo` is members-only.
      No group of one rank uses the default backend. Under eager init every rank runs the same
      splits of the world communicator (tests/test_pp.py::test_grid_groups_and_neighbour_pairs).
    - Expert parallelism's groups come from `expert_groups`, a refinement at the end of the file.

Builds on: checkpoint.py (Layout: the coordinates checkpoints record), pp.py (the tied-embedding ranks)
"""
from __future__ import annotations

import contextlib
import datetime
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Callable

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
    pp_peers: dict[int, dist.ProcessGroup] = field(default_factory=dict)  # neighbour stage → its 2-rank group
    cp: int = 1  # context-parallel degree; `at` counts dp · cp replicas (see make_grid)
    # expert parallelism (refinement: expert_groups)
    ep: int = 1  # expert-parallel degree, inside the dp · cp ranks
    ep_group: dist.ProcessGroup | None = None  # ep consecutive dp·cp ranks: they exchange tokens
    replica_group: dist.ProcessGroup | None = None  # the dp·cp ranks holding this rank's experts

    @property
    def data(self) -> tuple[int, int]:
        """(rank, size) among the replicas that read different rows: dp. The cp ranks of a replica
        read the same rows, each its own tokens of them."""
        return self.at.dp_rank // self.cp, self.at.dp // self.cp

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group: it holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep)."""
        return self.at.dp_rank % self.ep


def setup(timeout_s: float = 600.0) -> Grid:
    """torchrun sets RANK/WORLD_SIZE. A plain `python train.py` becomes a 1-rank group, so the
    same collectives run in both cases, as no-ops in the second. A default group that a launcher
    already formed (the tests' forked ranks) is used as is."""
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
            # A torchrun restart (--max-restarts) reuses the agent's store. Without a namespace per
            # attempt, new ranks may read a dead rank's address and fail to connect (torch 2.13, gloo).
            store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        else:
            store, rank, world = dist.HashStore(), 0, 1
        # device_id (CUDA): the NCCL communicator starts here, and every new_group splits it at
        # once (make_grid). None starts lazily at its first collective, inside a backward hook.
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device if cuda else None)
    return Grid(dist.get_rank(), dist.get_world_size(), device)


def make_grid(grid: Grid, tp: int, pp: int, timeout_s: float = 600.0, io_timeout_s: float = 3600.0,
              cp: int = 1, ep: int = 1) -> None:
    """rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank. The most frequent traffic gets
    the fastest links:
      tp innermost: all-reduces in every layer;
      then cp: a ring of P2P every layer;
      then dp: one reduction per step;
      then pp: point-to-point between stages, where the slowest links will do.
    The cp ranks hold the same parameters as dp replicas and reduce gradients with them. So `at`
    counts dp·cp replicas, index dp_rank·cp + cp_rank, and grid.dp_group spans them all. (`at` is
    what ZeRO shards over and checkpoints record.) Every group is made now, before any training,
    by `family`: every rank makes the same calls, in the same order. A degree-1 dimension gets
    `solo`, this rank alone. Then come the pipeline's neighbour pairs (pp.neighbour_pairs). On
    NCCL each pair needs a communicator of its own. Last, two gloo groups: checkpoint and export
    I/O waits (long timeout), and the pipeline's host-side check."""
    w = grid.world
    dpn = w // (tp * pp)  # dp · cp
    grid.at = CK.Layout(tp, dpn, pp, grid.rank % tp, grid.rank // tp % dpn, grid.rank // (tp * dpn))
    grid.cp = cp
    timeout = datetime.timedelta(seconds=timeout_s)
    one: list[dist.ProcessGroup] = []  # solo, made at the first degree-1 dimension

    def mine(rank_lists: list[list[int]], backend: str | None = None) -> dist.ProcessGroup | None:
        if all(len(r) == 1 for r in rank_lists):  # degree 1: no communicator, no split of the world's
            one[:] = one or [solo(grid.rank, timeout)]
            return one[0]
        groups = family(rank_lists, w, timeout, backend)
        return next((g for r, g in zip(rank_lists, groups) if grid.rank in r), None)

    at = lambda p, d, t: CK.Layout(tp, dpn, pp, t, d, p).rank  # noqa: E731
    grid.tp_group = mine([[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dpn)])
    dp_lists = [[at(p, d, t) for d in range(dpn)] for p in range(pp) for t in range(tp)]
    grid.dp_group = mine(dp_lists)
    pp_lists = [[at(p, d, t) for p in range(pp)] for d in range(dpn) for t in range(tp)]
    grid.pp_group = mine(pp_lists)
    grid.cp_group = mine([[at(p, d + c, t) for c in range(cp)] for p in range(pp)
                          for d in range(0, dpn, cp) for t in range(tp)])
    expert_groups(grid, ep, dp_lists, mine)  # refinement at the end: expert parallelism
    grid.embed_group = mine(PP.tied_embedding_ranks(w, pp)) if pp > 1 else None
    pairs = PP.neighbour_pairs(pp_lists)
    stage = {r: s for ranks in pp_lists for s, r in enumerate(ranks)}
    grid.pp_peers = {stage[r]: g for ranks, g in zip(pairs, family(pairs, w, timeout)) if grid.rank in ranks
                     for r in ranks if r != grid.rank}
    grid.io_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=io_timeout_s))
    grid.pp_check = mine(pp_lists, backend="gloo")


def family(rank_lists: list[list[int]], world: int, timeout: datetime.timedelta,
           backend: str | None = None) -> list[dist.ProcessGroup | None]:
    """One group per list. Every rank calls dist.new_group for every list, in this order, and gets
    its own; the others are NON_GROUP_MEMBER. Under eager init (setup's device_id), torch makes
    each new group by ncclCommSplit of the world's communicator. That is a collective of all ranks.
    An NCCL group's members split with a colour, every other rank with none. So every rank runs
    one split per call, whatever the membership (distributed_c10d.py, _new_process_group_helper).
    A gloo group's members split nothing, but its non-members still run the no-colour split. So a
    gloo family is made as a partition of the world: the ranks in no list form one group more.
    Then every rank runs the same number of splits. Lists of a gloo family must not overlap."""
    lists = [list(r) for r in rank_lists]
    if backend == "gloo":
        seen = [r for ranks in lists for r in ranks]
        if len(seen) != len(set(seen)):
            raise ValueError(f"a gloo family's lists must not overlap (each rank in at most one): {lists}")
        rest = [r for r in range(world) if r not in set(seen)]
        lists += [rest] if rest else []
    return [dist.new_group(r, timeout=timeout, backend=backend) for r in lists][:len(rank_lists)]


def solo(rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The group of this rank alone, for every degree-1 dimension. It is gloo and members only
    (use_local_synchronization): the other ranks do not call it, and it splits no communicator.
    Code that takes a group runs no collective on a group of one (tests/test_step_comm.py). So
    this group never carries data. It answers size 1 and rank 0, and costs no NCCL communicator."""
    return dist.new_group([rank], timeout=timeout, backend="gloo", use_local_synchronization=True)


class StageError(RuntimeError):
    """A collective failed or timed out; the message names the training stage."""


@contextlib.contextmanager
def stage(name: str, grid: Grid, collectives: bool = True):
    """Name the training stage where a collective failed or timed out: a peer died, hung, or
    disagreed. A bare gloo/NCCL timeout does not say where the run was. Out of memory is reported
    as such, with the memory numbers. It is a RuntimeError too, but no peer is to blame.
    collectives=False (building the model) reports only out of memory. Other errors pass as they
    are: they are not a peer's."""
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


# ---- refinement: expert parallelism (--ep) adds two groups inside the dp·cp ranks
def expert_groups(grid: Grid, ep: int, dp_lists: list[list[int]], mine: Callable) -> None:
    """ep divides dp·cp. The dp·cp ranks of each (pp, tp) cell split into blocks of ep consecutive
    ones: `ep_group`, the token exchange on the nearest links. Ep strided `replica_group`s hold the
    same experts and sum their gradients (as moe.ep_groups does). At ep = 1 the replica group IS
    dp_group, the same object: one gradient reduction for all parameters. The ep group is then
    `solo`. At ep = dp·cp the ep group is dp_group and the replica group `solo`. `mine` is
    make_grid's maker, so every rank makes these groups at the same point of its calls."""
    dpn = len(dp_lists[0])
    grid.ep = ep
    grid.ep_group = grid.dp_group if ep == dpn else mine(
        [ranks[b:b + ep] for ranks in dp_lists for b in range(0, dpn, ep)])
    grid.replica_group = grid.dp_group if ep == 1 else mine([ranks[j::ep] for ranks in dp_lists for j in range(ep)])
