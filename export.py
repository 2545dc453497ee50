"""Streaming HF export from any layout: each pipeline stage's writer streams its own shard.

What it does
    `export_hf` writes a model trained under any tp/pp/dp/ZeRO layout as an HF folder.
    `AutoModelForCausalLM.from_pretrained` loads that folder.
    The model is never assembled. Each pipeline stage has one writer, its (dp 0, tp 0) rank.
    The writer streams its stage's tensors into its own safetensors files, one full tensor at a time.
    A tp-sharded tensor is all-gathered over tp first. ZeRO-3 gathers one unit at a time over dp.
    Rank 0 writes the index from the writers' reports.
    Then it writes config.json, generation_config.json and the tokenizer (weights.finish_hf).
    Last, it swaps the folder in.
    Peak memory per rank: one ZeRO-3 unit plus one full tensor (and its CPU copy on a GPU).

Reference
    transformers' sharded checkpoints: `model-0000i-of-0000n.safetensors` and a `weight_map`.
    As in checkpoint.py, each piece is written by its owner, and one rank writes the index.

Run
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 3 --export-hf out/pretrained

Invariants (tests/test_export.py)
    - Nothing is pickled. Only file names go through rank 0.
      The writers' reports are JSON, exchanged over `group` (checkpoint.exchange).
      Ranks wait there for slow writers: give `group` a long timeout (train.py's io group).
    - Every rank of a stage runs the same gathers to the end, whatever its writer met.
      A full disk is reported, not raised alone. So no rank is left waiting in a collective.
      A failure anywhere raises the same OSError on every rank, and leaves no partial export.
    - A tied embedding is exported once, from the first stage. The last stage's copy is skipped.
    - The export owns its folder (weights.begin_export / commit_export).
      No file of an older export survives, and a crash leaves the older one whole.
    - Expert tensors (moe.py) are gathered over the ep group, as tp-sharded ones over tp.

Builds on: model.py, checkpoint.py, tp.py, weights.py (and zero3.Zero3Optimizer's `each_unit_gathered`)
"""
from __future__ import annotations

import itertools
import shutil
from typing import Any, Iterator

import torch
import torch.distributed as dist

import weights as W
from checkpoint import Layout, exchange, raise_errors
from model import Llama, LlamaConfig, Shard, global_shapes
from tp import gather_tensor


def _stage_tensors(model: Llama, opt: Any, shards: dict[str, Shard], cfg: LlamaConfig, at: Layout,
                   tp_group: dist.ProcessGroup | None, order: list[str],
                   ep_group: dist.ProcessGroup | None = None) -> Iterator[torch.Tensor]:
    """This stage's full tensors, in `order`, one at a time.

    Every rank of the stage runs it to the end, so the collectives match.
    ZeRO-3 gathers one unit at a time over dp. dp rank 0's tp ranks gather each tp-sharded tensor.
    Its ep group gathers each expert tensor. Those ep peers are dp ranks [0, ep).
    They join that gather only. The ranks of other dp ranks yield nothing."""
    shapes = global_shapes(cfg)
    params = W.named_state(model)  # the parameters and the state buffers (DeepSeek's router bias)
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    each = getattr(opt, "each_unit_gathered", None)  # ZeRO-3: parameters are shards between uses
    # ZeRO-3's units hold every parameter, a frozen base (lora.py) too. What is left is whole on
    # every dp rank: one more unit (state buffers: DeepSeek's router bias)
    rest = [n for n, p in params.items() if not isinstance(p, torch.nn.Parameter)]
    units = itertools.chain(each(), [rest]) if each else [list(params)]
    ready, k = {}, 0
    for names in units:
        if at.dp_rank >= ep:
            continue
        for n in (n for n in names if n in shapes):  # a last stage's tied copy is not exported
            shard, expert = shards.get(n), W.expert_tensor(n)
            if at.dp_rank != 0 and not (expert and shard is not None):
                continue  # dp rank 0's ep peer: only the experts' gathers need it
            if shard is None:
                t = params[n].detach()
            elif expert:
                t = gather_tensor(params[n], shard, shapes[n][0], ep_group)  # (E, ...) from the ep blocks
            else:
                t = gather_tensor(params[n], shard, shapes[n][shard.dim], tp_group)
            if at.dp_rank == 0:
                ready[n] = t
        while k < len(order) and order[k] in ready:
            yield ready.pop(order[k])  # while its unit is gathered: no copy
            k += 1
        ready = {n: t.to("cpu", copy=True) for n, t in ready.items()}  # out of order: outlives its unit


def export_hf(model: Llama, opt: Any, shards: dict[str, Shard], cfg: LlamaConfig, at: Layout, out: str,
              tp_group: dist.ProcessGroup | None = None, group: dist.ProcessGroup | None = None,
              tokenizer: object | None = None, max_shard_bytes: int = 4 << 30,
              ep_group: dist.ProcessGroup | None = None) -> None:
    """Export the compute parameters to `out`. Every rank calls it.

    The compute parameters are fp32 in fp32 mode, else the bf16 copy of the masters.
      - at: this rank's layout (checkpoint.Layout). tp_group: its tp group.
      - group: all ranks, for the reports. Give it a long timeout.
      - tokenizer: a data.py tokenizer. It is exported, with its ids in the configs.
      - max_shard_bytes: the most bytes in one file. A stage writes at least one file.
      - ep_group: expert parallelism's group (grid.ep_group). It gathers the expert tensors.
      - shards: which slice each tensor holds, for tp and for ep."""
    shapes = global_shapes(cfg)
    params = W.named_state(model)
    order = [n for n in params if n in shapes]
    getattr(opt, "finish_gathers", lambda: None)()  # ZeRO-1/2: the last step's all-gathers complete
    writer = at.dp_rank == 0 and at.tp_rank == 0
    files = W.plan_shards([(n, shapes[n], params[n].dtype) for n in order], max_shard_bytes) if writer else []
    what = f"export to {out} failed"
    report: dict[str, Any] = {"rank": at.rank, "error": None, "files": len(files)}
    if at.rank == 0:
        try:
            W.begin_export(out)
        except (OSError, ValueError) as e:
            report["error"] = str(e)
    counts = exchange(report, group)
    raise_errors(counts, what)
    me = dist.get_rank(group) if dist.is_initialized() else 0
    first, total = sum(c["files"] for c in counts[:me]), sum(c["files"] for c in counts)
    tmp = W.staging_dir(out)
    report = {"rank": at.rank, "error": None, "weights": {}}
    tensors = _stage_tensors(model, opt, shards, cfg, at, tp_group, order, ep_group)
    try:
        for i, specs in enumerate(files):
            name = W.shard_name(first + i, total)
            # transformers' on-disk names: an MoE layer's fused experts are written one per expert
            disk, pieces = W.hf_tensors(specs, itertools.islice(tensors, len(specs)), cfg)
            W.write_safetensors(tmp / name, disk, pieces, {"format": "pt"})
            report["weights"] |= {n: name for n, _, _ in disk}
    except (OSError, ValueError) as e:
        report["error"] = str(e)
    for _ in tensors:  # the remaining gathers, with the peers, whatever happened here
        pass
    reports = exchange(report, group)
    done = {"rank": at.rank, "error": None}
    if at.rank == 0:
        try:
            raise_errors(reports, what)
            weight_map = {n: f for r in reports for n, f in r["weights"].items()}
            W.finish_hf(tmp, out, cfg, weight_map, params[order[0]].dtype, tokenizer)
        except (OSError, ValueError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            done["error"] = str(e)
    raise_errors(exchange(done, group), what)
