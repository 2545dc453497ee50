"""Check a launch line on this CPU before renting the GPUs: the same model kind, the same layout,
equal to one process, with its collectives counted and ordered.

What it does
    `python -m verify` takes train.py's flags (cli.parse_args) plus --nproc and --json.
    1. `shrink` cuts the model (a preset or --init-from's config.json) to a few layers and a narrow
       width. It keeps the family and every option that changes the math, and says what it cut.
    2. `run_layout` runs train.main on forked gloo ranks: once alone, once in the layout. The same
       seeded weights, the same rows, a few steps.
    3. `compare` checks each step's loss and grad norm, each parameter's gradient norm at each
       step, and each exported parameter at the end. A failure names the parameter.
    4. The ledger: every collective of a training step, per rank and group (op, dtype, bytes,
       count), next to `closed_form`'s count for the layout, then scaled to the real model.
    5. `order_check`: each communicator's members issue the same sequence. `deadlock_check` runs
       the step's collectives under NCCL's model (one stream per rank and communicator, blocking).
       The pipeline's messages go through pp_schedules.simulate.
    6. `plan`: the real model's memory per rank (zero_memory's table), its pipeline bubble, and the
       three largest byte counts of a step.

The core idea
    Every layout of attotron equals one process (fp32, ~1e-7). A bug in a layout breaks that
    equality at a small size as surely as at a large one. So a small copy of the user's own model
    in the user's own layout shows it, in minutes, on a laptop.

Run
    python -m verify --tp 2 --pp 2 --zero 1                     # 8 ranks: dp 2 beside ZeRO
    python -m verify --init-from ~/models/Qwen3-30B-A3B --tp 2 --pp 2 --zero 3 --ac --ep 2 --json v.json

Exit status: 0 exact and deadlock-free; 1 a mismatch, a deadlock or an order break; 2 bad input.

Invariants
    - The unchanged code passes; five mutations of known bug classes each fail, naming the place.
      Test: tests/test_verify.py.
    - The ledger equals the closed form for the layout.
      Test: tests/test_verify.py::test_readme_command_exits_0_with_the_ledger_equal_to_the_closed_form.

Builds on: cli.py, data.py, grid.py, model.py, pp_schedules.py, precision.py, tp.py, train.py,
    weights.py, zero_memory.py. It forks ranks itself (no tests/ import): this file stands alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import inspect
import json
import math
import os
import queue
import re
import sys
import sysconfig
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cli
import data
import grid as G
import model as M
import pp_schedules as PS
import precision as P
import tp as TP
import train
import weights as W
import zero_memory as ZM

RTOL = 1e-5  # fp32: a layout changes only the order of the same sums (measured ≤ 3e-7)
STEPS = 3  # steps run: step 1 names a wrong gradient; 2-3 show it in the loss
MAX_WORLD = 16  # ranks this machine forks at most (2-16 cores: one intra-op thread each)
LAYOUT_FLAGS = ("tp", "cp", "sp", "pp", "ep", "schedule", "virtual_stages", "zero", "ac", "ac_mode",
                "ac_every", "prefetch")


# ------------------------------------------------------------------------------------------ the shrunk model
def divisible_seq(args: argparse.Namespace, want: int) -> int:
    """The shortest --seq-len >= want that cp's 2·cp chunks and sp's tp shards divide."""
    base = 2 * args.cp * (args.tp if args.sp else 1)
    return base * math.ceil(want / base)


def shrink(cfg: M.LlamaConfig, args: argparse.Namespace, seq_len: int) -> tuple[M.LlamaConfig, list, list]:
    """A small config of the same kind: (config, what was kept, what was cut).
    Kept: family, GQA ratio, head_dim, norms, biases, tying, rope, experts, top-k, router options.
    Cut: layers to what pp · virtual stages need, width, intermediate sizes, vocabulary (the
    byte tokenizer's 260), a window longer than the short rows."""
    tp, stages = args.tp, args.pp * cli.virtual_stages(args)
    ratio = cfg.num_attention_heads // cfg.num_key_value_heads
    kv = tp  # the fewest kv heads tp divides
    layers = max(stages, 2, cfg.decoder_sparse_step if cfg.num_experts else 1)
    new = dict(num_key_value_heads=kv, num_attention_heads=kv * ratio, num_hidden_layers=layers,
               hidden_size=min(cfg.hidden_size, 64), vocab_size=data.ByteTokenizer.vocab_size,
               intermediate_size=tp * math.ceil(min(cfg.intermediate_size, 96) / tp),
               bos_token_id=None, eos_token_id=None)
    if cfg.moe_intermediate_size:  # Mixtral and OLMoE size their experts by intermediate_size
        same = cfg.moe_intermediate_size == cfg.intermediate_size
        new["moe_intermediate_size"] = new["intermediate_size"] if same else min(cfg.moe_intermediate_size, 32)
    if cfg.layer_types:  # a prefix of the pattern, with every kind of layer the model has
        types = list(cfg.layer_types[:layers])
        for kind in sorted(set(cfg.layer_types) - set(types)):
            types[-1 - sorted(set(cfg.layer_types) - set(types)).index(kind)] = kind
        new["layer_types"] = tuple(types)
    if cfg.mlp_only_layers:
        dense = tuple(i for i in cfg.mlp_only_layers if i < layers)
        new["mlp_only_layers"] = dense or (0,)
    if cfg.sliding_window is not None and cfg.sliding_window >= seq_len:
        # a window the short rows never reach would test nothing: make it act (cp needs >= seq-len)
        new["sliding_window"] = seq_len if args.cp > 1 else seq_len // 2
    if cfg.qk_norm_whole:  # OLMoE's q/k norm spans the whole projection: hidden = heads · head_dim
        new["hidden_size"] = new["num_attention_heads"] * cfg.head_dim
    small = dataclasses.replace(cfg, **new)
    cut = [f"{k} {getattr(cfg, k)} → {v}" for k, v in new.items() if getattr(cfg, k) != v]
    moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "router_aux_loss_coef", "output_router_logits", "mlp_only_layers", "decoder_sparse_step")
    kept = [f"{f.name} {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
            if f.name not in new and f.name not in ("initializer_range", "max_position_embeddings")
            and (cfg.num_experts or f.name not in moe_fields)]  # a dense model: no expert fields
    kept.append(f"GQA ratio {ratio}")
    return small, kept, cut


def implied_world(args: argparse.Namespace) -> int:
    """The smallest world of the flags: tp · cp · pp · dp, dp 2 under ZeRO, ep dividing dp · cp."""
    dp = 2 if args.zero else 1
    while (dp * args.cp) % args.ep:
        dp += 1
    return args.tp * args.cp * args.pp * dp


def write_init(cfg: M.LlamaConfig, out: Path, seed: int) -> None:
    """Seeded weights as an HF folder. Norms and biases move off 1 and 0, so a lost one shows."""
    model = W.materialize(M.build(cfg), "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, p in model.named_parameters():
        state[name] = (p.detach() + 0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1 else p.detach()
    W.save_hf(state, cfg, out)


def write_corpus(out: Path) -> Path:
    """A small pretraining set: the first 60,000 characters of the stdlib's sources, byte-tokenized."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("[a-c]*.py")))
    (out / "corpus.txt").write_text(text[:60_000])
    data.prepare(out / "corpus.txt", out / "data")
    return out / "data"


def varied_reward(reply: str, gold: str) -> float:
    """The GRPO verifier verify uses: a random model never answers right, so exact match would give
    every reply 0 and every gradient 0. This one varies with the reply."""
    return float(sum(map(ord, reply)) % 7) / 7


# ------------------------------------------------------------------------------------------ forked ranks
# A trimmed copy of tests/dist.py's harness: this file must stand alone. Ranks fork from this
# process, one intra-op thread each. A rank's stdout and stderr go to its own log file.
def _worker(fn: Callable, rank: int, world: int, port: Any, ready: Any, q: Any, log: str) -> None:
    try:
        faulthandler.disable()  # a rank killed in a stuck collective dumps nothing on the caller's stderr
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # also past a test's capture
        torch.set_num_threads(1)
        if rank == 0:  # rank 0 serves the store on a port the OS picks; the others read it
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            port.value = store.port
            ready.set()
        elif not ready.wait(timeout=120):
            raise TimeoutError("rank 0 opened no store within 120 s")
        else:
            store = dist.TCPStore("127.0.0.1", port.value, world, is_master=False)
        dist.init_process_group("gloo", store=dist.PrefixStore("verify/", store), rank=rank, world_size=world)
        fn(rank, world)
        q.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        q.put((rank, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        q.close()
        q.join_thread()
        os._exit(0)


def run_ranks(fn: Callable, world: int, logs: Path, timeout: float, stall: float) -> tuple[dict[int, str], list[int]]:
    """fn(rank, world) on `world` forked gloo ranks. Returns (rank → traceback of each failed rank,
    the ranks that never answered). Ranks are killed after `timeout` seconds, 10 s after a failure,
    or once no rank wrote to its files in `stall` seconds (all stuck in collectives)."""
    ctx = mp.get_context("fork")
    q, port, ready = ctx.Queue(), ctx.Value("i", 0), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, ready, q, str(logs / f"rank{r}.log")),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    errors, answered, start = {}, set(), time.time()
    last = lambda: max((f.stat().st_mtime for f in logs.iterdir()), default=start)  # noqa: E731
    while len(answered) < world:
        try:
            rank, error = q.get(timeout=1.0)
        except queue.Empty:
            now = time.time()
            # one process cannot wait on a peer: only a world of several stalls
            quiet = now - max(last(), start) > (10.0 if errors else stall if world > 1 else math.inf)
            if now - start > timeout or quiet:
                break
            continue
        answered.add(rank)
        if error:
            errors[rank] = error
    for p in procs:
        p.join(timeout=0 if len(answered) < world else 5)
        if p.is_alive():
            p.kill()
            p.join()
    return errors, sorted(set(range(world)) - answered)


# ------------------------------------------------------------------------------------------ inside a rank
# Every collective of a training step, in issue order, one JSON line each, flushed before the call:
# a rank stuck in one still left its record. Bytes: the full buffer (all-reduce: the tensor;
# reduce-scatter: its input; all-gather: its output; all-to-all and send: what this rank sends).
BUFFER = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather_into_tensor": "output_tensor",
          "all_gather_single": "output_tensor", "reduce_scatter_tensor": "input",
          "reduce_scatter_single": "input", "all_to_all_single": "input"}
ROLES = (("tp_group", "tp"), ("cp_group", "cp"), ("dp_group", "dp"), ("ep_group", "ep"),
         ("replica_group", "replica"), ("pp_group", "pp"), ("embed_group", "embed"), ("pp_check", "pp_check"),
         ("io_group", "io"))


class Recorder:
    """This rank's ledger file, its step, its groups' roles and each parameter's squared grad norm."""

    def __init__(self, path: str):
        self.out = open(path, "w", buffering=1)
        self.step: int | None = None
        self.depth = 0  # a wrapped call inside a wrapped call records once
        self.roles: dict[str, str] = {}
        self.update = 0  # optimizer steps so far

    def group(self, g: Any) -> tuple[str, list[int]]:
        g = g or dist.group.WORLD
        return g.group_name, dist.get_process_group_ranks(g)

    def write(self, op: str, group: Any, t: torch.Tensor | None, scale: int = 1, peer: int | None = None) -> None:
        name, ranks = self.group(group)
        self.out.write(json.dumps({"step": self.step, "group": name, "role": self.roles.get(name, "world"),
                                   "ranks": ranks, "op": op, "dtype": str(t.dtype).removeprefix("torch.") if
                                   t is not None else "-", "numel": t.numel() * scale if t is not None else 0,
                                   "bytes": t.numel() * t.element_size() * scale if t is not None else 0,
                                   "peer": peer}) + "\n")

    def wrap(self, op: str, fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        def call(*a: Any, **k: Any) -> Any:
            if self.step is not None and not self.depth:
                got = sig.bind(*a, **k).arguments
                if op == "batch_isend_irecv":
                    for o in got["p2p_op_list"]:
                        self.write("send" if "send" in o.op.__name__ else "recv", o.group, o.tensor, peer=o.peer)
                elif op == "all_gather":
                    self.write(op, got.get("group"), got["tensor"], len(got["tensor_list"]))
                else:
                    self.write(op, got.get("group"), got.get(BUFFER.get(op, ""), None))
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
        return call

    def install(self, sq: dict) -> None:
        """Wrap torch.distributed's collectives, tp's functional all-reduce, the step, the grid's
        groups and the grad norm's per-parameter squares. Evaluation is skipped: verify compares
        training. Only this forked rank is changed."""
        for op in (*BUFFER, "all_gather", "barrier", "batch_isend_irecv", "all_gather_object",
                   "broadcast_object_list"):
            setattr(dist, op, self.wrap(op, getattr(dist, op)))
        functional = TP._all_reduce

        def tp_all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
            if self.step is not None and not self.depth:
                self.write("all_reduce", group, x)
            return functional(x, group)
        TP._all_reduce = tp_all_reduce
        one_step, make_grid = train.one_step, G.make_grid

        def step(r: Any, i: int, micro: list) -> Any:
            self.step = i
            try:
                return one_step(r, i, micro)
            finally:
                self.step = None
        train.one_step = step

        def grid(g: G.Grid, *a: Any, **k: Any) -> None:
            make_grid(g, *a, **k)
            for attr, role in ROLES:
                if role == "replica" and g.replica_group is g.dp_group:
                    continue  # at ep = 1 it is the dp group itself
                if getattr(g, attr, None) is not None and dist.get_world_size(getattr(g, attr)) > 1:
                    name = getattr(g, attr).group_name
                    self.roles[name] = self.roles[name] + "/" + role if name in self.roles else role
            for group in g.pp_peers.values():
                self.roles.setdefault(group.group_name, "pp_pair")
        G.make_grid = grid
        train.evaluate = lambda *a, **k: None
        train.held_out_eval = lambda *a, **k: {}  # GRPO's "before" evaluation too
        square_sum, opt_step = P.MixedPrecisionOptimizer._square_sum, P.MixedPrecisionOptimizer.step

        def squares(opt: Any, grads: list, counted: list) -> torch.Tensor:
            for name, g, c in zip(opt.names, grads, counted):
                if g is not None and c:
                    key = f"{self.update}:{name}"
                    sq[key] = sq.get(key, 0.0) + float(g.double().square().sum())
            return square_sum(opt, grads, counted)

        def counted_step(opt: Any, lr: float) -> float:
            try:
                return opt_step(opt, lr)
            finally:
                self.update += 1
        P.MixedPrecisionOptimizer._square_sum = squares
        P.MixedPrecisionOptimizer.step = counted_step


def rank_main(argv: list[str], out: Path, patch: Callable[[int], None] | None) -> Callable:
    """The function each forked rank runs: record, apply the test's mutation, train, save the squares."""
    def fn(rank: int, world: int) -> None:
        rec, sq = Recorder(str(out / f"ledger{rank}.jsonl")), {}
        rec.install(sq)
        if patch is not None:
            patch(rank)
        try:
            train.main(argv)
        finally:
            (out / f"squares{rank}.json").write_text(json.dumps(sq))
    return fn


# ------------------------------------------------------------------------------------------ the two runs
@dataclasses.dataclass
class Setup:
    """What verify runs: the real run's flags and model, the small ones, and the world."""
    args: argparse.Namespace  # the real run's flags (cli.parse_args)
    cfg: M.LlamaConfig  # the real model
    small: M.LlamaConfig
    world: int  # ranks of the layout run
    real_world: int  # ranks of the real run (--nproc, else the implied world)
    seq_len: int
    micro: int  # micro-batches per dp rank in the layout run
    kept: list
    cut: list
    notes: list
    layout_args: argparse.Namespace | None = None  # the layout run's flags, parsed
    collective_timeout: float = 60.0


def plan_setup(args: argparse.Namespace, cfg: M.LlamaConfig, nproc: int | None) -> tuple[Setup | None, list[str]]:
    """Check the real run's flags (cli.validate at its world), then size the small one."""
    real_world = nproc or implied_world(args)
    errors = cli.validate(args, cfg, argparse.Namespace(world=real_world, device=torch.device("cpu")))  # the CPU run's checks
    if errors:
        return None, errors
    notes, world = [], real_world
    cells = args.tp * args.cp * args.pp
    if world > MAX_WORLD:  # dp is free: the fewest dp replicas that keep ZeRO's and ep's rules
        dp = 2 if args.zero else 1
        while (dp * args.cp) % args.ep:
            dp += 1
        if cells * dp > MAX_WORLD:
            return None, [f"tp × cp × pp × dp = {cells * dp} ranks: more than this machine forks ({MAX_WORLD})"]
        world = cells * dp
        notes.append(f"world cut from {real_world} to {world} ranks (dp {real_world // cells} → {dp})")
    dp = world // cells
    seq = divisible_seq(args, 64 if args.sft or args.dpo or args.grpo else 32)
    micro = min(cli.micro_batches(args, real_world), 8)
    if args.pp > 1 and micro < args.pp:
        micro = args.pp
    small, kept, cut = shrink(cfg, args, seq)
    cut.insert(0, f"seq_len {args.seq_len} → {seq}")
    cut.append(f"rows per step {args.batch_size} → {dp * micro} (dp {dp} × {micro} micro-batches of one row)")
    if args.compile:
        notes.append("--compile left out: the layers run eagerly (tests/test_compile.py checks compiled layers)")
    if args.dtype == "bf16" or args.reduce_dtype == "bf16":
        notes.append("bf16 checked in fp32: equality to one process is exact only in fp32")
    return Setup(args, cfg, small, world, real_world, seq, micro, kept, cut, notes), []


def train_argv(s: Setup, d: Path, layout: bool) -> list[str]:
    """train.py's flags for one of the two runs: the small model, the run's kind of data, verify's
    steps and outputs; the layout's flags only for the layout run. The reference runs the same rows
    per forward (its micro-batches are the layout's times dp: MoE's aux loss is per forward)."""
    a = s.args
    dp = s.world // (a.tp * a.cp * a.pp)
    name = "layout" if layout else "single"
    argv = ["--init-from", str(d / "init"), "--steps", str(STEPS), "--seq-len", str(s.seq_len),
            "--batch-size", str(dp * s.micro), "--micro-batches", str(s.micro if layout else s.micro * dp),
            "--lr", str(a.lr), "--min-lr", str(a.min_lr), "--warmup", str(a.warmup),
            "--weight-decay", str(a.weight_decay), "--clip", str(a.clip), "--seed", str(a.seed),
            "--dtype", "fp32", "--timeout", str(s.collective_timeout), "--metrics", str(d / f"{name}.jsonl"),
            "--export-hf", str(d / f"{name}-export"), "--log-every", str(STEPS)]
    if a.sft:
        argv += ["--sft", "--packing", a.packing, "--overlong", a.overlong]
    elif a.dpo:
        argv += ["--dpo", "--dpo-beta", str(a.dpo_beta), "--packing", a.packing]
    elif a.grpo:
        argv += ["--grpo", "--verifier", "verify:varied_reward"]
        argv += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in cli.GRPO_DEFAULTS if k != "verifier"]
    else:
        argv += ["--data", str(d / "data")]
    if layout:
        argv += ["--tp", str(a.tp), "--cp", str(a.cp), "--pp", str(a.pp), "--ep", str(a.ep), "--zero", str(a.zero),
                 "--schedule", a.schedule, "--virtual-stages", str(cli.virtual_stages(a)), "--prefetch", str(a.prefetch),
                 "--bucket-mb", "0.02"]  # ~5,000 fp32 elements a bucket: several buckets even when small
        argv += ["--sp"] * a.sp + (["--ac-mode", a.ac_mode or "selective", "--ac-every", str(a.ac_every)]
                                   if a.ac or a.ac_mode else [])
    return argv


def run_layout(s: Setup, d: Path, layout: bool, patch: Callable | None, timeout: float) -> dict:
    """One of the two runs, its ledger and squares read back."""
    out = d / ("layout" if layout else "single")
    out.mkdir()
    world = s.world if layout else 1
    t0 = time.time()
    errors, missing = run_ranks(rank_main(train_argv(s, d, layout), out, patch if layout else None),
                                world, out, timeout, s.collective_timeout)
    result = {"world": world, "wall_s": time.time() - t0, "errors": errors, "missing": missing,
              "ledger": [], "squares": []}
    for r in range(world):
        f = out / f"ledger{r}.jsonl"
        result["ledger"].append([json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else [])
        f = out / f"squares{r}.json"
        result["squares"].append(json.loads(f.read_text()) if f.exists() else {})
    result["log_tail"] = {r: (out / f"rank{r}.log").read_text()[-1500:] for r in sorted({*errors, *missing} or {0})
                          if (out / f"rank{r}.log").exists()}
    return result


# ------------------------------------------------------------------------------------------ comparison
def _close(got: float, want: float, scale: float = 0.0) -> bool:
    return abs(got - want) <= RTOL * max(abs(want), scale)


def _layer_order(name: str) -> tuple:
    """Parameters in model order: embedding, layers by index, then the rest."""
    parts = name.split(".")
    idx = next((int(p) for p in parts if p.isdigit()), -1)
    return (0 if "embed" in name else 2 if idx < 0 else 1, idx, name)


def grad_norms(squares: list[dict], s: Setup, layout: bool) -> dict[str, float]:
    """Per (update, parameter) the global grad norm. ZeRO-0's dp replicas each hold the whole
    gradient: their squares divide by the replicas (dp·cp, and dp·cp/ep for experts)."""
    a, total = s.args, defaultdict(float)
    dpn = s.world // (a.tp * a.pp) if layout else 1
    for sq in squares:
        for key, v in sq.items():
            reps = 1 if a.zero or not layout else dpn // (a.ep if W.expert_tensor(key.split(":", 1)[1]) else 1)
            total[key] += v / reps
    return {k: math.sqrt(v) for k, v in total.items()}


def compare(s: Setup, d: Path, single: dict, layout: dict) -> dict:
    """Each step's loss and grad norm, each parameter's grad norm at each update, each exported
    parameter. The first step where a parameter's gradient parts ways names it."""
    out = {"tolerance": f"{RTOL:g} relative (fp32: a layout changes only summation orders)",
           "steps": [], "gradients": [], "parameters": [], "exact": True}
    read = lambda n: [r for r in map(json.loads, (d / f"{n}.jsonl").read_text().splitlines())  # noqa: E731
                      if "loss" in r]  # (GRPO writes a step-0 record for its evaluation)
    ref, got = read("single"), read("layout")
    for r, g in zip(ref, got):
        # a loss near 0 (GRPO's surrogate at ratio 1) is compared to 1e-6 absolute
        ok = _close(g["loss"], r["loss"], 0.1) and _close(g["grad_norm"], r["grad_norm"])
        out["steps"].append({"step": r["step"], "loss": [r["loss"], g["loss"]],
                             "grad_norm": [r["grad_norm"], g["grad_norm"]], "ok": ok})
        out["exact"] &= ok
    first_loss = next((st["step"] for st in out["steps"] if "loss" in st and not _close(*st["loss"][::-1], 0.1)),
                      None)
    if len(ref) != len(got):
        out["exact"] = False
        out["steps"].append({"error": f"{len(got)} steps logged by the layout, {len(ref)} by one process"})
    rn, gn = grad_norms(single["squares"], s, False), grad_norms(layout["squares"], s, True)
    by_update = defaultdict(list)
    for key in sorted(set(rn) | set(gn), key=lambda k: (int(k.split(":")[0]), _layer_order(k.split(":", 1)[1]))):
        by_update[int(key.split(":")[0])].append(key)
    for u, keys in sorted(by_update.items()):
        top = max((rn.get(k, 0.0) for k in keys), default=0.0)
        bad = [(k.split(":", 1)[1], rn.get(k), gn.get(k)) for k in keys
               if k not in rn or k not in gn or not _close(gn[k], rn[k], 1e-3 * top)]
        if bad:
            out["exact"] = False
            out["gradients"] = [{"update": u + 1, "parameter": n, "single": a, "layout": b} for n, a, b in bad]
            # backward meets the parameters from the last to the first: the last wrong one in the
            # forward order is where the gradients start to part
            order = {n: i for i, n in enumerate(M.global_shapes(s.small))}
            out["origin"] = max((g["parameter"] for g in out["gradients"]), key=lambda n: order.get(n, -1))
            break  # the first update where they part: later ones follow from it
    first_grad = out["gradients"][0]["update"] if out["gradients"] else None
    if first_loss is not None and (first_grad is None or first_loss <= first_grad):
        # the loss parts before any gradient did: the forward or the loss's normalization
        out["loss_origin"] = f"step {first_loss}'s loss, with every earlier gradient equal: the forward " \
                             f"or the loss's normalization"
    # An element whose gradient lies within rounding of 0 can take another Adam step (its update
    # is m/√v, near ±lr whatever the size): 5% of the summed lr covers that (measured up to 0.3%).
    slack = 0.05 * sum(cli.lr_at(i, s.layout_args) for i in range(STEPS))
    out["parameters"] = compare_exports(d / "single-export", d / "layout-export", slack)
    out["parameter_tolerance"] = f"{RTOL:g} × the tensor's largest value + {slack:.3g} (5% of the summed lr)"
    out["exact"] &= not out["parameters"]
    return out


def compare_exports(ref_dir: Path, got_dir: Path, slack: float) -> list[dict]:
    """Each exported tensor (transformers' names, one per expert), largest difference first."""
    from safetensors.torch import load_file
    load = lambda p: {k: v for f in sorted(p.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    if not ref_dir.exists() or not got_dir.exists():
        return [{"parameter": "-", "error": "an export is missing"}]
    ref, got = load(ref_dir), load(got_dir)
    bad = []
    for name in sorted(set(ref) | set(got), key=_layer_order):
        if name not in ref or name not in got or ref[name].shape != got[name].shape:
            bad.append({"parameter": name, "error": "missing or of another shape"})
            continue
        diff = float((got[name].double() - ref[name].double()).abs().max()) if ref[name].numel() else 0.0
        scale = float(ref[name].double().abs().max()) if ref[name].numel() else 0.0
        if diff > RTOL * scale + slack:
            bad.append({"parameter": name, "max_abs_diff": diff, "max_abs": scale})
    return bad


# ------------------------------------------------------------------------------------------ the ledger
def ledger(records: list[list[dict]], step: int) -> list[dict]:
    """One row per (rank, group, op, dtype) of one training step: count and bytes."""
    rows: dict[tuple, dict] = {}
    for rank, recs in enumerate(records):
        for x in recs:
            if x["step"] != step:
                continue
            key = (rank, x["role"], tuple(x["ranks"]), x["op"], x["dtype"])
            row = rows.setdefault(key, {"rank": rank, "role": x["role"], "ranks": x["ranks"], "op": x["op"],
                                        "dtype": x["dtype"], "count": 0, "bytes": 0})
            row["count"] += 1
            row["bytes"] += x["bytes"]
    return list(rows.values())


def per_role(rows: list[dict]) -> dict[str, dict]:
    """The ledger per (role, op): the most any rank issues, count and bytes."""
    out: dict[str, dict] = {}
    by_rank = defaultdict(lambda: [0, 0])
    for r in rows:
        c = by_rank[(r["role"], r["op"], r["rank"])]
        c[0] += r["count"]
        c[1] += r["bytes"]
    for (role, op, _), (count, nbytes) in by_rank.items():
        k = f"{role} {op}"
        old = out.get(k, {"count": 0, "bytes": 0})
        out[k] = {"count": max(old["count"], count), "bytes": max(old["bytes"], nbytes)}
    return dict(sorted(out.items()))


# ---- the closed form: what the layout must issue, from the config and the flags alone
TP_SHARDED = re.compile(r".*(q_proj|k_proj|v_proj|o_proj\.weight|gate_proj|up_proj|down_proj|embed_tokens|lm_head).*")


def rank_params(cfg: M.LlamaConfig, args: argparse.Namespace, stage: int) -> tuple[int, int]:
    """Parameters one rank of pipeline stage `stage` holds: its layers (and embedding or head),
    tp's share of the sharded matrices (the vocab padded to tp; a whole-projection q/k norm too),
    ep's share of the experts.
    Returns (the rest, the experts): they reduce over different groups."""
    ranges = cli.layer_ranges(args, cfg)
    layers = {i for k, r in enumerate(ranges) if k % args.pp == stage for i in r}
    n, experts, last = 0, 0, args.pp - 1
    for name, shape in M.global_shapes(cfg).items():
        idx = re.search(r"layers\.(\d+)\.", name)
        if idx and int(idx.group(1)) not in layers or not idx and (
                "embed_tokens" in name and stage != 0 and not (cfg.tie_word_embeddings and stage == last)
                or ("lm_head" in name or name == "model.norm.weight") and stage != last):
            continue
        size = math.prod(shape)
        if W.expert_tensor(name):
            experts += size // args.ep
            continue
        if (TP_SHARDED.fullmatch(name) or cfg.qk_norm_whole and re.search(r"[qk]_norm", name)) \
                and "experts" not in name:
            if "embed_tokens" in name or "lm_head" in name:
                size = math.ceil(cfg.vocab_size / args.tp) * cfg.hidden_size
            else:
                size //= args.tp
        n += size
    return n, experts


def closed_form(cfg: M.LlamaConfig, args: argparse.Namespace, world: int, micro: int, seq: int) -> dict[str, dict]:
    """Per (group, op): the most one rank issues in a step, count and bytes (fp32), by formula.
    tp: 2 all-reduces per layer forward and 2 backward (Megatron's f and g), the vocab-parallel
    embedding's 1, the fused loss's 3 forward and 1 backward, the grad norm's 1.
    pp: per micro-batch, each chunk boundary a message forward and one back (with MoE's router
    statistics beside the hidden state). dp: the step's target count, its loss and (ZeRO) the grad
    norm; stage 0's all-reduce or ZeRO-1/2's reduce-scatter and all-gather of the rank's Ψ.
    ep: per sparse layer and micro-batch the counts and four exchanges of N·k rows of H (bytes:
    the ep group's mean, as a rank's rows vary). ZeRO-3 gives estimates only (2 gathers and a
    reduce-scatter of each unit per micro-batch; the embedding's unit is gathered more often).
    sp: dense models without q/k norms. cp: the ring of a dense model (tokens are T/cp).
    Layouts without a formula here: sp and cp on the rest."""
    tp, pp, v, ep = args.tp, args.pp, cli.virtual_stages(args), args.ep
    dp = world // (tp * pp * args.cp)
    ranges = cli.layer_ranges(args, cfg)
    tokens, H, f4 = seq // args.cp, cfg.hidden_size, 4  # one row per micro-batch
    full_ac = args.ac_mode == "full"
    out: dict[str, dict] = {}

    def put(key: str, count: int, nbytes: int) -> None:
        old = out.get(key, {"count": 0, "bytes": 0})
        out[key] = {"count": max(old["count"], count), "bytes": max(old["bytes"], nbytes)}
    for s in range(pp):
        layers = [i for k, r in enumerate(ranges) if k % pp == s for i in r]
        if tp > 1 and not args.sp and not args.grpo:  # (GRPO's rollouts decode in the step)
            # per layer: attention's f and g; a dense MLP's f and g (an MoE block has none: its
            # experts are whole on every rank); a per-head q/k norm's 2 weight-gradient sums of
            # head_dim; a whole-projection q/k norm's statistics, 2 forward and 2 backward, of
            # one number a token; full AC repeats the forward's g's
            sparse = sum(cfg.is_sparse(i) for i in layers)
            head = cfg.qk_norm and not cfg.qk_norm_whole
            acts = (len(layers) + len(layers) - sparse) * (2 + full_ac) * micro
            calls = acts + 2 * len(layers) * micro * head + 4 * len(layers) * micro * cfg.qk_norm_whole
            nbytes = acts * tokens * H * f4 + 2 * len(layers) * micro * head * cfg.head_dim * f4 + \
                4 * len(layers) * micro * cfg.qk_norm_whole * tokens * f4
            if s == 0:
                calls, nbytes = calls + micro, nbytes + micro * tokens * H * f4
            if s == pp - 1:
                calls, nbytes = calls + 4 * micro, nbytes + micro * (3 * tokens * f4 + tokens * H * f4)
            put("tp all_reduce", calls + 1, nbytes + 4)
        if tp > 1 and args.sp and args.cp == 1 and not args.grpo and not cfg.num_experts and not cfg.qk_norm:
            # sp: each layer gathers before attention and the MLP and reduce-scatters after them,
            # backward the reverse; AC's recompute gathers again (full AC also reduce-scatters once);
            # the embedding reduce-scatters, the head gathers; the norms' weight gradients and the
            # loss's 3 statistics all-reduce
            ac = bool(args.ac or args.ac_mode)
            ends = (s == 0) + (s == pp - 1)
            gathers, scatters = ((4 + 2 * ac) * len(layers) + ends) * micro, ((4 + full_ac) * len(layers) + ends) * micro
            put("tp all_gather", gathers, gathers * tokens * H * f4)
            put("tp reduce_scatter_single", scatters, scatters * tokens * H * f4)
            last = s == pp - 1
            put("tp all_reduce", (3 * last + 2 * len(layers) + last) * micro + 1,
                micro * (3 * last * tokens * f4 + (2 * len(layers) + last) * H * f4) + 4)
        if args.cp > 1 and not cfg.num_experts:
            # the ring, per layer and micro-batch: cp-1 K/V blocks forward, cp-1 again and cp dK/dV
            # hops backward (full AC: the forward's again), each 2·(kv heads / tp)·(T/cp)·head_dim
            hops = len(layers) * micro * (3 * args.cp - 2 + (args.cp - 1) * full_ac)
            kv = 2 * cfg.num_key_value_heads // tp * tokens * cfg.head_dim * f4
            put("cp send", hops, hops * kv)
            put("cp recv", hops, hops * kv)
        if pp > 1:
            msgs = sum((k < pp * v - 1) + (k > 0) for k in range(s, pp * v, pp)) * micro
            side = (2 * cfg.num_experts + 2) * f4 if cfg.num_experts else 0
            nbytes = msgs * (tokens * H * f4 // (tp if args.sp else 1) + side)
            put("pp_pair send", msgs * (2 if side else 1), nbytes)
            put("pp_pair recv", msgs * (2 if side else 1), nbytes)
        psi, experts = rank_params(cfg, args, s)
        if dp * args.cp > 1 and args.zero in (1, 2):
            put("dp reduce_scatter_single", 0, psi * f4)
            put("dp all_gather_single", 0, psi * f4)
            if experts and dp * args.cp // ep > 1:
                put("replica reduce_scatter_single", 0, experts * f4)
                put("replica all_gather_single", 0, experts * f4)
        if dp * args.cp > 1 and args.zero == 3:  # estimates: each unit gathered forward and backward
            put("dp all_gather_single (estimate)", 0, 2 * micro * psi * f4)
            put("dp reduce_scatter_single (estimate)", 0, micro * psi * f4)
        sparse = sum(cfg.is_sparse(i) for i in layers)
        if ep > 1 and sparse:
            put("ep all_to_all_single", 5 * sparse * micro,
                sparse * micro * (4 * tokens * cfg.num_experts_per_tok * H * f4 + cfg.num_experts * 8))
    if cfg.tie_word_embeddings and pp > 1:  # the tied copies' gradient sum: ZeRO's piece, or all of it
        put("embed all_reduce", 1, math.ceil(cfg.vocab_size / tp) * H * f4 // (dp * args.cp if args.zero else 1))
    if dp * args.cp > 1:  # stage 0 adds its gradient buckets' all-reduces (a count of buckets)
        psi = max(rank_params(cfg, args, s)[0] for s in range(pp))
        grpo = 72 if args.grpo else 0  # GRPO's log: one all-reduce of 9 float64 sums
        put("dp all_reduce", 0 if not args.zero else 3 + bool(grpo), 12 + grpo + (4 if args.zero else psi * f4))
    return out


def ep_size(rows: list[dict]) -> int:
    """The ep group's size, from the ledger's rows."""
    return max((len(r["ranks"]) for r in rows if "ep" in r["role"].split("/")), default=1)


def ledger_vs_formula(measured: dict, rows: list[dict], formula: dict) -> list[dict]:
    """Each formula row beside the ledger. An ep all-to-all's bytes are the ep group's mean. ZeRO's
    buffers are padded to a multiple of N per bucket (and its count is the buckets): bytes within
    0.5%, count not compared."""
    out = []
    for key, want in formula.items():
        if key.endswith("(estimate)"):
            continue
        role, op = key.split(" ", 1)
        got = next((v for k, v in measured.items() if k.split(" ", 1)[1] == op and role in k.split(" ")[0].split("/")),
                   {"count": 0, "bytes": 0})
        if role == "ep":
            groups = defaultdict(int)
            for r in rows:
                if r["op"] == op and "ep" in r["role"].split("/"):
                    groups[tuple(r["ranks"])] += r["bytes"]
            # a rank's share of the rows varies: the group's mean
            got = {"count": got["count"], "bytes": max(groups.values(), default=0) // max(ep_size(rows), 1)}
        padded = want["count"] == 0  # a count of buckets: bytes only, up to ZeRO's padding
        if padded:
            got = {"count": 0, "bytes": got["bytes"]}
        equal = (abs(got["bytes"] - want["bytes"]) <= 0.005 * want["bytes"] if padded else got == want)
        out.append({"what": key, "formula": want, "ledger": got, "equal": equal})
    return out


# ------------------------------------------------------------------------------------------ order and deadlock
def _sig(x: dict) -> tuple:
    """What the members of a communicator must agree on: the op, the dtype, and the size where
    the op needs equal sizes (an all-to-all's splits differ by rank)."""
    sized = x["op"] not in ("all_to_all_single", "all_gather_object", "broadcast_object_list", "barrier")
    return (x["step"], x["op"], x["dtype"], x["numel"] if sized else None)


def _name(x: dict | None) -> str:
    if x is None:
        return "nothing (it never got there)"
    return f"{x['op']} {x['dtype']} {x['numel']} elements (step {x['step'] + 1})"


def order_check(records: list[list[dict]]) -> list[str]:
    """Each communicator's members issue the same sequence; each pair's sends meet the peer's
    receives in order. Returns one line per break, naming the group, the ranks and the ops."""
    seqs: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    members, roles, lanes = {}, {}, defaultdict(lambda: ([], []))
    for rank, recs in enumerate(records):
        for x in recs:
            if x["op"] in ("send", "recv"):
                src, dst = (rank, x["peer"]) if x["op"] == "send" else (x["peer"], rank)
                lanes[(x["group"], src, dst)][x["op"] == "recv"].append(x)
                continue
            seqs[x["group"]][rank].append(x)
            members[x["group"]], roles[x["group"]] = x["ranks"], x["role"]
    breaks = []
    for g, by_rank in seqs.items():
        n = max(len(v) for v in by_rank.values())
        for i in range(n):
            at = {r: (by_rank[r][i] if i < len(by_rank[r]) else None) for r in members[g]}
            if len({_sig(x) if x else None for x in at.values()}) > 1:
                breaks.append(f"{roles[g]} group {members[g]}, collective #{i + 1}: " + "; ".join(
                    f"rank {r} issues {_name(x)}" for r, x in at.items()))
                break
    for (g, src, dst), (sends, recvs) in lanes.items():
        for i in range(max(len(sends), len(recvs))):
            s_, r_ = (sends[i] if i < len(sends) else None), (recvs[i] if i < len(recvs) else None)
            if s_ is None or r_ is None or s_["numel"] != r_["numel"]:
                breaks.append(f"pipeline pair {src} → {dst}, message #{i + 1}: rank {src} sends {_name(s_)}; "
                              f"rank {dst} receives {_name(r_)}")
                break
    return breaks


def deadlock_check(records: list[list[dict]]) -> str | None:
    """The step's collectives under NCCL's model: one stream per rank and communicator, each rank
    blocking in its collectives in issue order (the strictest host). A collective runs once all its
    members reached it. None if every rank finishes; else the cycle, each stuck rank and its op.
    Pipeline messages are left to pp_schedules.simulate (batched P2P does not block the host)."""
    seq = [[x for x in recs if x["op"] not in ("send", "recv")] for recs in records]
    pc = [0] * len(seq)
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(seq):
            if pc[rank] >= len(ops):
                continue
            x = ops[pc[rank]]
            # a collective runs once all members reached it, the same op of the same size
            if all(pc[m] < len(seq[m]) and seq[m][pc[m]]["group"] == x["group"] and _sig(seq[m][pc[m]]) == _sig(x)
                   for m in x["ranks"]):
                for m in x["ranks"]:
                    pc[m] += 1
                progress = True
    stuck = [r for r in range(len(seq)) if pc[r] < len(seq[r])]
    if not stuck:
        return None
    return "cycle: " + "; ".join(f"rank {r} waits in {seq[r][pc[r]]['role']} {seq[r][pc[r]]['ranks']} "
                                 f"#{pc[r] + 1} {_name(seq[r][pc[r]])}" for r in stuck)


def pipeline_verdict(args: argparse.Namespace, micro: int) -> str | None:
    """pp_schedules.simulate over the run's schedule, one communicator per neighbour pair (pp.py)."""
    if args.pp == 1:
        return None
    import pp as PP
    v = cli.virtual_stages(args)
    try:
        sim = PS.simulate([PP.SCHEDULES[args.schedule](micro, s, args.pp, v) for s in range(args.pp)], 1,
                          1 if args.schedule == "zb" else 2, 1, communicator=PS.pair_groups)
    except (RuntimeError, ValueError) as e:
        return f"pipeline: {e}"
    return None if sim else "pipeline: no result"


# ------------------------------------------------------------------------------------------ the plan
def activation_bytes(cfg: M.LlamaConfig, args: argparse.Namespace, rows: int) -> float:
    """Bytes one layer keeps for backward per micro-batch in bf16 (docs/ac.md's table), divided by
    tp (heads and MLP columns; sp also the norms), the tokens by cp. An MoE layer counts its k
    experts' activations as its MLP's."""
    s, h, a = args.seq_len // args.cp, cfg.hidden_size, cfg.num_attention_heads
    g = cfg.num_key_value_heads / a
    i = cfg.num_experts_per_tok * (cfg.moe_intermediate_size or cfg.intermediate_size) if cfg.num_experts \
        else cfg.intermediate_size
    mode = args.ac_mode or ("selective" if args.ac else "none")
    per = {"none": s * rows * h * (12 + 4 * g + 6 * i / h) + 4 * s * rows * a + 8 * s * rows,
           "selective": s * rows * h * (8 + 4 * g + 4 * i / h) + 4 * s * rows * a + 8 * s * rows,
           "full": 2 * s * rows * h}[mode]
    return per / args.tp


def zero_extras(cfg: M.LlamaConfig, args: argparse.Namespace, stage: int, n: int) -> float:
    """zero_memory.peak_extras' backward bound on a GPU, from the config: k = 2 buckets in flight of
    B elements, bf16 compute (c = 2) and fp32 reductions (r = 4): (k+2)·B·r + k·(B/N)·r. At
    ZeRO-3 the bucket is the largest unit (a layer, or the embedding), and prefetch + 1 gathered
    units plus the one in backward come on top: (prefetch+2)·B·c."""
    c, r, k = 2, 4, 2
    if args.zero == 3:
        layer = sum(math.prod(sh) for name, sh in M.global_shapes(cfg).items() if ".layers.0." in name) // args.tp
        embed = math.ceil(cfg.vocab_size / args.tp) * cfg.hidden_size if stage in (0, args.pp - 1) else 0
        B = max(embed, layer)
        return (args.prefetch + 2) * B * c + (k + 2) * B * r + k * B / n * r
    B = args.bucket_mb * 2**20 / r
    return (k + 2) * B * r + k * B / n * r if n > 1 or args.zero == 0 else 0.0


def _meta_counts(cfg: M.LlamaConfig, args: argparse.Namespace, q: Any) -> None:
    """In a forked process: each stage of the real model built on the meta device (no memory), split
    and tp-sharded under torch's fake process group of tp ranks; its parameters counted (the
    experts ÷ ep, as shard_experts keeps them)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import pp as PP
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.tp)
        counts = []
        for stage in range(args.pp):
            model = M.build(cfg)
            PP.split_stage(model, stage, args.pp, cli.layer_ranges(args, cfg))
            TP.apply_tp(model, None, sequence_parallel=args.sp)
            counts.append(sum(p.numel() // (args.ep if W.expert_tensor(n) else 1)
                              for n, p in model.named_parameters()))
        q.put(counts)
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put(traceback.format_exc())
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def meta_check(cfg: M.LlamaConfig, args: argparse.Namespace) -> dict:
    """One rank per stage at the real size, without allocating it: its parameters beside the
    closed form's (rank_params), which the plan's memory rests on."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_meta_counts, args=(cfg, args, q), daemon=True)
    proc.start()
    try:
        got = q.get(timeout=600)
    except queue.Empty:
        got = "no answer within 600 s"
    proc.join(timeout=5)
    if isinstance(got, str):
        return {"error": got[-800:]}
    want = [sum(rank_params(cfg, args, s)) for s in range(args.pp)]
    return {"built": got, "formula": want, "equal": got == want}


def plan(cfg: M.LlamaConfig, args: argparse.Namespace, world: int, ledger_real: dict) -> dict:
    """The real run's memory per rank (its largest stage), pipeline bubble and three largest byte
    counts of a step. Memory: zero_memory's table for the rank's parameters (ep_formula_bytes: the
    experts shard over their replicas), plus the saved activations of the micro-batches the
    schedule keeps in flight (pp_schedules.simulate), plus ZeRO-3's gathered units in bf16."""
    import pp as PP
    micro, v = cli.micro_batches(args, world), cli.virtual_stages(args)
    n = world // (args.tp * args.pp)  # the ZeRO group: dp · cp
    dp = n // args.cp
    rows = max(args.batch_size // (dp * micro), 1)
    sim = PS.simulate([PP.SCHEDULES[args.schedule](micro, s, args.pp, v) for s in range(args.pp)], 1,
                      1 if args.schedule == "zb" else 2, 1)
    ranges, stages = cli.layer_ranges(args, cfg), []
    for s in range(args.pp):
        dense, experts = rank_params(cfg, args, s)
        state = ZM.ep_formula_bytes(args.zero, dense, experts * args.ep, n, args.ep)
        chunk_layers = max(len(r) for k, r in enumerate(ranges) if k % args.pp == s)
        acts = sim.peak_in_flight[s] * chunk_layers * activation_bytes(cfg, args, rows)
        extras = zero_extras(cfg, args, s, n)
        stages.append({"stage": s, "params": dense + experts, "state_bytes": state, "activation_bytes": acts,
                       "extras_bytes": extras, "peak_bytes": state + acts + extras,
                       "micro_batches_in_flight": sim.peak_in_flight[s]})
    costs = sorted(ledger_real.items(), key=lambda kv: -kv[1]["bytes"])[:3]
    return {"per_stage": stages, "peak_bytes": max(st["peak_bytes"] for st in stages),
            "bubble": float(sim.bubble), "micro_batches": micro,
            "largest_costs": [f"{k}: {v['bytes'] / 2**30:,.2f} GiB a step per rank "
                              f"({v['count'] or 'one per bucket'} calls)" for k, v in costs],
            "assumes": "bf16 params and grads, fp32 masters and Adam moments (zero_memory); activations in "
                       "bf16 by docs/ac.md; no allocator fragmentation or kernel workspaces"}


# ------------------------------------------------------------------------------------------ the verdict
def verify(argv: list[str], nproc: int | None = None, patch: Callable[[int], None] | None = None,
           timeout: float = 300.0, workdir: str | None = None, collective_timeout: float = 60.0) -> dict:
    """The whole check of train.py's flags `argv`; returns the report (see `main`). `patch(rank)`
    runs in each rank of the layout run before training: the tests' mutations. `timeout`: seconds
    a run may take; `collective_timeout`: seconds a collective waits (train.py's --timeout).
    Raises ValueError on bad input, naming the flag or file."""
    t0 = time.time()
    try:
        args = cli.parse_args(argv)
    except SystemExit as e:
        if not e.code:  # --help
            raise
        raise ValueError("train.py's flags: see the message above") from None
    cfg = W.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    s, errors = plan_setup(args, cfg, nproc)
    if s is not None:
        s.collective_timeout = collective_timeout
    if errors:
        raise ValueError("\n  ".join(["invalid configuration:"] + errors))
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        d = Path(tmp)
        write_init(s.small, d / "init", args.seed)
        if not (args.sft or args.dpo or args.grpo):
            write_corpus(d)
        single = run_layout(s, d, False, None, timeout)
        if single["errors"] or single["missing"]:
            raise RuntimeError(f"the one-process run failed: {single['errors'] or single['missing']}\n"
                               f"{single['log_tail']}")
        s.layout_args = cli.parse_args(train_argv(s, d, True))
        layout = run_layout(s, d, True, patch, timeout)
        failed = bool(layout["errors"] or layout["missing"])
        report = {"argv": argv, "world": s.world, "real_world": s.real_world,
                  "layout": {k: getattr(args, k) for k in LAYOUT_FLAGS} | {"micro_batches": s.micro},
                  "model": {"family": cfg.model_type, "kept": s.kept, "cut": s.cut}, "notes": s.notes,
                  "wall_s": {"single": single["wall_s"], "layout": layout["wall_s"]}}
        report["run"] = {"failed_ranks": sorted(layout["errors"]), "unanswered_ranks": layout["missing"],
                         "log_tail": layout["log_tail"] if failed else {}}
        report["comparison"] = compare(s, d, single, layout) if not failed else {"exact": False}
    records = layout["ledger"]
    last = max((x["step"] for recs in records for x in recs), default=0)  # a stopped run: its last step
    rows = ledger(records, last)
    report["ledger"] = {"step": last + 1, "per_role": per_role(rows), "rows": rows,
                        "bytes_convention": "all-reduce: the tensor; reduce-scatter: its input; all-gather: "
                                            "its output; all-to-all and send: what the rank sends"}
    report["ledger"]["closed_form"] = [] if failed else ledger_vs_formula(  # a stopped step: not comparable
        report["ledger"]["per_role"], rows, closed_form(s.small, s.layout_args, s.world, s.micro, s.seq_len))
    report["ledger"]["real"] = closed_form(cfg, args, s.real_world, cli.micro_batches(args, s.real_world), args.seq_len)
    report["plan"] = plan(cfg, args, s.real_world, report["ledger"]["real"])
    report["plan"]["meta_check"] = meta_check(cfg, args)
    report["order"] = order_check(records)
    report["deadlock"] = deadlock_check(records) or pipeline_verdict(args, cli.micro_batches(args, s.real_world)) or (
        f"the layout run hung: ranks {layout['missing']} never finished" if layout["missing"] else None)
    report["exact"] = report["comparison"]["exact"] and not failed
    report["ok"] = report["exact"] and not report["order"] and not report["deadlock"]
    report["wall_s"]["total"] = time.time() - t0
    return report


def summary(rep: dict) -> str:
    """The few lines a user reads: what was checked, the verdict, where it parted ways."""
    lay = rep["layout"]
    dp = rep["world"] // (lay["tp"] * lay["cp"] * lay["pp"])
    shape = (f"tp {lay['tp']} · cp {lay['cp']} · dp {dp} · pp {lay['pp']} ({lay['schedule']}, {lay['micro_batches']} "
             f"micro-batches) · ep {lay['ep']} · ZeRO-{lay['zero']}" + (" · sp" if lay["sp"] else "")
             + (f" · AC {lay['ac_mode'] or 'selective'}" if lay["ac"] or lay["ac_mode"] else ""))
    lines = [f"verify: {rep['model']['family']} at world {rep['world']} = {shape}, "
             f"{STEPS} steps against one process, {rep['wall_s']['total']:.0f} s"]
    lines.append("  kept: " + ", ".join(rep["model"]["kept"]))
    lines.append("  cut:  " + ", ".join(rep["model"]["cut"]))
    lines += [f"  note: {n}" for n in rep["notes"]]
    c = rep["comparison"]
    for st in c.get("steps", []):
        if "error" in st:
            lines.append(f"  {st['error']}")
        else:
            lines.append(f"  step {st['step']}: loss {st['loss'][0]:.7f} vs {st['loss'][1]:.7f}, grad norm "
                         f"{st['grad_norm'][0]:.7f} vs {st['grad_norm'][1]:.7f} {'ok' if st['ok'] else 'DIFFERENT'}")
    if c.get("loss_origin"):
        lines.append(f"  first difference: {c['loss_origin']}")
    if c.get("origin"):
        lines.append(f"  first wrong gradient (backward order): {c['origin']}")
    for g in c.get("gradients", [])[:8]:
        lines.append(f"  gradient of {g['parameter']} at update {g['update']}: norm {g['single']} alone, "
                     f"{g['layout']} in the layout")
    for p in c.get("parameters", [])[:8]:
        lines.append(f"  parameter {p['parameter']} after {STEPS} steps: {p.get('error') or p}")
    if rep["run"]["failed_ranks"] or rep["run"]["unanswered_ranks"]:
        lines.append(f"  the layout run failed: ranks {rep['run']['failed_ranks']} raised, ranks "
                     f"{rep['run']['unanswered_ranks']} never finished (stuck in a collective)")
    lines.append("  ledger (step %d, the most any rank issues):" % rep["ledger"]["step"])
    for k, v in rep["ledger"]["per_role"].items():
        lines.append(f"    {k}: {v['count']} calls, {v['bytes']:,} bytes")
    for c in rep["ledger"]["closed_form"]:
        lines.append(f"    closed form {c['what']}: {c['formula']['count'] or 'one per bucket:'} calls, "
                     f"{c['formula']['bytes']:,} bytes "
                     f"{'= ledger' if c['equal'] else '≠ ledger ' + str(c['ledger'])}")
    lines.append("  the real run's bytes per step and rank, by the closed form:")
    for k, v in rep["ledger"]["real"].items():
        lines.append(f"    {k}: {v['count'] or 'one per bucket:'} calls, {v['bytes'] / 2**20:,.1f} MiB")
    p = rep["plan"]
    top = max(p["per_stage"], key=lambda x: x["peak_bytes"])
    lines.append(f"  the real run (world {rep['real_world']}): peak ≤ {p['peak_bytes'] / 2**30:.2f} GiB per rank "
                 f"(stage {top['stage']}: state {top['state_bytes'] / 2**30:.2f} + activations "
                 f"{top['activation_bytes'] / 2**30:.2f} + in-flight buffers {top['extras_bytes'] / 2**30:.2f} GiB), "
                 f"pipeline bubble "
                 f"{p['bubble']:.1%} at {p['micro_batches']} micro-batches")
    lines += [f"    largest: {c}" for c in p["largest_costs"]]
    m = p.get("meta_check", {})
    if "error" in m:
        lines.append(f"  meta build at the real size failed: {m['error'].splitlines()[-1]}")
    elif m:
        lines.append(f"  parameters per rank, each stage built on meta at the real size: {m['built']} "
                     f"{'= the formula' if m['equal'] else '≠ the formula ' + str(m['formula'])}")
    lines += [f"  order: {b}" for b in rep["order"]]
    if rep["deadlock"]:
        lines.append(f"  deadlock: {rep['deadlock']}")
    lines.append(verdict(rep))
    return "\n".join(lines)


def verdict(rep: dict) -> str:
    """The last line: exact or not, deadlock-free or not, the order, fits or not (with --gpu-gib)."""
    p = rep.get("plan", {})
    fits = "" if "fits" not in p else (f", fits {p['gpu_gib']:g} GiB" if p["fits"] else
                                       f", does NOT fit {p['gpu_gib']:g} GiB ({p['peak_bytes'] / 2**30:.1f})")
    return (f"verdict: {'exact' if rep['exact'] else 'NOT exact'} (tolerance {RTOL:g} relative), "
            f"{'deadlock-free' if not rep['deadlock'] else 'DEADLOCK'}, "
            f"{'collective order agrees' if not rep['order'] else 'collective ORDER BREAKS'}{fits}")


def all_layouts(argv: list[str], nproc: int | None) -> list[dict]:
    """`verify` for every (tp, cp, pp) whose product divides the world; dp is what is left. The other
    flags stay. A layout cli.validate refuses is listed with its reason, not run."""
    args = cli.parse_args(argv)
    world = nproc or implied_world(args)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for tp in divisors:
        for cp in divisors:
            for pp in divisors:
                if world % (tp * cp * pp):
                    continue
                layout = ["--tp", str(tp), "--cp", str(cp), "--pp", str(pp)]  # argparse: the last one wins
                try:
                    out.append({"layout": " ".join(layout), "report": verify(argv + layout, world)})
                except ValueError as e:
                    out.append({"layout": " ".join(layout), "skipped": str(e).replace("\n", " ")})
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m verify [train.py's flags] [--nproc N] [--json FILE] [--gpu-gib G] [--all-layouts]`.
    Exit 0, 1 or 2.
    --gpu-gib: one GPU's memory; the verdict says whether the plan's peak fits (it leaves the exit
    status alone: the peak is a bound)."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--nproc", type=int, default=None)
    own.add_argument("--json", default=None)
    own.add_argument("--all-layouts", action="store_true")  # every (tp, cp, pp) of the world
    own.add_argument("--gpu-gib", type=float, default=80.0)  # the memory of one GPU, for "fits or not"
    mine, rest = own.parse_known_args(argv)
    if not mine.gpu_gib > 0:
        print(f"error: --gpu-gib must be > 0, got {mine.gpu_gib}", file=sys.stderr)
        return 2
    if mine.json and not Path(mine.json).resolve().parent.is_dir():
        print(f"error: --json {mine.json}: its folder does not exist", file=sys.stderr)
        return 2
    if mine.all_layouts:
        try:
            reps = all_layouts(rest, mine.nproc)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for r in reps:
            print(f"{r['layout']}: " + (f"skipped ({r['skipped']})" if "skipped" in r else verdict(r["report"])),
                  flush=True)
        if mine.json:
            Path(mine.json).write_text(json.dumps(reps, indent=1, default=str))
        ran = [r["report"] for r in reps if "report" in r]
        return 2 if not ran else 0 if all(r["ok"] for r in ran) else 1
    try:
        rep = verify(rest, mine.nproc)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the one-process run itself failed: nothing to compare with
        print(f"error: {e}", file=sys.stderr)
        return 1
    rep["plan"]["fits"] = rep["plan"]["peak_bytes"] <= mine.gpu_gib * 2**30
    rep["plan"]["gpu_gib"] = mine.gpu_gib
    print(summary(rep), flush=True)
    if mine.json:
        Path(mine.json).write_text(json.dumps(rep, indent=1, default=str))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
