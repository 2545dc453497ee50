"""The stage contract of pp.py: a user's own nn.Module stages, with pp.py and pp_schedules.py copied alone.

A stage here is written the picotron way: a module of its own layers, called as
stage(x, labels=None, reduction="sum"). It has no `.config`, no `.model`, no side tensors, no
pp.Stage. run_pipeline gets the hidden size as an argument. The checks run in a forked process that
imports only from a folder holding pp.py and pp_schedules.py (tests/dist.py run_alone; the
repository root is not importable there, checked), on 2 gloo ranks.

- A nanoGPT-style GPT (tests/foreign_models.py), cut by hand: every schedule (gpipe, 1f1b,
  interleaved with 2 chunks per rank, zb with 1 and 2).
- The same GPT with a declared side tensor (`side_tensors`): each block adds its mean squared
  activation to a running sum, and the last stage adds that sum to its loss. 1f1b and zb (v = 2).
- transformers' Llama, cut by hand into a LlamaStage: 1f1b and zb.

Reference: the single process over the same micro-batches (same seed, same data), fp32. The two
ranks' gradients are summed: each parameter lives on one rank, and the GPT's tied embedding on two.
Tolerance: 1e-5 relative to the largest entry of each tensor (the loss, each gradient). Micro-batch
accumulation and the tied copies' sum reorder fp32 sums only.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from dist import run_alone

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
H = 64  # foreign_models' hidden size (GPT n_embd and the tiny transformers models)


def _run(tmp_path: Path, group: str) -> list[dict]:
    lib, harness = tmp_path / "lib", tmp_path / "harness"
    lib.mkdir()
    harness.mkdir()
    for f in ("pp.py", "pp_schedules.py"):
        shutil.copy(ROOT / f, lib / f)
    for f in ("dist.py", "foreign_models.py", Path(__file__).name):
        shutil.copy(ROOT / "tests" / f, harness / f)
    return run_alone([str(lib), str(harness)], "test_pp_contract", "main", group)


def main(group: str) -> list[dict]:
    """In the copied folder: check the repository is out of reach, run the group on 2 ranks."""
    for name in ("model", "weights", "train", "tp", "loss", "moe"):
        assert importlib.util.find_spec(name) is None, f"{name}.py is importable: the test would prove nothing"
    import torch
    from dist import run_ranks
    torch.set_num_threads(1)
    return run_ranks(_checks, 2, group)


# ----------------------------------------------------------------------------------------- stages
def _gpt_stage(gpt, layers: range, first: bool, last: bool, side: bool = False):
    """A GPT stage as a user writes one: its embeddings (first), its blocks, its norm and head (last).
    side: declare and pass on a running sum of each block's mean squared activation."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class GPTStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = (gpt.transformer.wte, gpt.transformer.wpe) if first else (None, None)
            self.blocks = nn.ModuleList(gpt.transformer.h[i] for i in layers)
            self.ln_f, self.lm_head = (gpt.transformer.ln_f, gpt.lm_head) if last else (None, None)
            if side:
                self.side_tensors = {"penalty": ((1,), torch.float32)}

        def forward(self, x, labels=None, reduction="sum", penalty=None):
            if self.wte is not None:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))  # (B, T, C)
            for block in self.blocks:
                x = block(x)
                if side:  # a sum over every block, wherever the cut falls
                    penalty = x.pow(2).mean().view(1) + (0 if penalty is None else penalty)
            if self.lm_head is None:
                return (x, penalty) if side else x
            logits = self.lm_head(self.ln_f(x))  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1, reduction=reduction)
            return loss + 0.5 * penalty.sum() if side else loss

    return GPTStage()


def _llama_stage(hf, layers: range, first: bool, last: bool):
    """transformers' Llama cut by hand: its embedding, decoder layers, rotary embedding, norm, head."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class LlamaStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = hf.model.embed_tokens if first else None
            self.layers = nn.ModuleList(hf.model.layers[i] for i in layers)
            self.rotary_emb = hf.model.rotary_emb
            self.norm, self.lm_head = (hf.model.norm, hf.lm_head) if last else (None, None)

        def forward(self, x, labels=None, reduction="sum"):
            h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, S, H)
            pos = torch.arange(h.shape[1]).unsqueeze(0)  # (1, S)
            rope = self.rotary_emb(h, pos)  # causal attention: no mask, sdpa's is_causal
            for layer in self.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
                h = h[0] if isinstance(h, tuple) else h
            if self.lm_head is None:
                return h
            logits = self.lm_head(self.norm(h))  # (B, S, V)
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                   reduction=reduction)

    return LlamaStage()


# ----------------------------------------------------------------------------------------- checks
def _batches(ignore: int) -> list[dict]:
    import torch
    from foreign_models import VOCAB
    out = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (2, 17), generator=g)
        x, y = ids[:, :-1], ids[:, 1:].clone()  # labels aligned with the inputs (already shifted)
        y[0, :3] = ignore  # some ignored targets
        out.append({"input_ids": x, "labels": y})
    return out


def _close(a, b) -> float:
    """max |a - b| relative to max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _one(rank: int, build, cut, schedule: str, v: int, mbs: list[dict], targets: int) -> dict:
    """The single process against 2 stages (v chunks each) of the same model, cut by `cut`."""
    import torch
    import torch.distributed as dist
    import pp
    ref = build()
    whole = cut(ref, range(4), True, True)  # one stage of every layer: the model in one process
    loss_ref = sum(whole(mb["input_ids"], labels=mb["labels"], reduction="sum") for mb in mbs) / targets
    loss_ref.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    model = build()
    ranges = pp.partition(4, 2 * v)
    chunks = [cut(model, ranges[c * 2 + rank], c * 2 + rank == 0, c * 2 + rank == 2 * v - 1) for c in range(v)]
    loss = pp.run_pipeline(chunks, pp.SCHEDULES[schedule](len(mbs), rank, 2, v), mbs, dist.group.WORLD, targets,
                           hidden_size=H)
    worst = 0.0
    for n, p in model.named_parameters():  # each parameter on one rank (the tied embedding on both)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        worst = max(worst, _close(g, want[n]))
    return {"loss": _close(loss, loss_ref.detach()), "grads": worst,
            "chunks": [type(c).__name__ for c in chunks], "config": any(hasattr(c, "config") for c in chunks)}


def _checks(rank: int, world: int, group: str) -> dict:
    from foreign_models import GPT, hf_causal_lm
    out = {}
    if group == "gpt":
        mbs = _batches(-1)
        targets = sum(int((mb["labels"] != -1).sum()) for mb in mbs)
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zb", 2)):
            out[f"gpt {schedule} v{v}"] = _one(rank, GPT, _gpt_stage, schedule, v, mbs, targets)
        side = lambda m, r, f, l: _gpt_stage(m, r, f, l, side=True)  # noqa: E731
        for schedule, v in (("1f1b", 1), ("zb", 2)):
            out[f"gpt side {schedule} v{v}"] = _one(rank, GPT, side, schedule, v, mbs, targets)
    else:
        mbs = _batches(-100)
        targets = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
        for schedule in ("1f1b", "zb"):
            out[f"llama {schedule} v1"] = _one(rank, lambda: hf_causal_lm("llama"), _llama_stage, schedule, 1,
                                               mbs, targets)
    return out


# ----------------------------------------------------------------------------------------- tests
def _assert(results: list[dict], want: int) -> None:
    for r in results:  # each rank
        assert len(r) == want, sorted(r)
        for key, c in r.items():
            assert c["loss"] <= TOL and c["grads"] <= TOL, (key, c)
            assert not c["config"] and "Stage" in c["chunks"][0] and c["chunks"][0] != "Stage", (key, c)


def test_bare_gpt_stages_every_schedule(tmp_path):
    _assert(_run(tmp_path, "gpt"), 7)


def test_transformers_llama_stage(tmp_path):
    pytest.importorskip("transformers")
    _assert(_run(tmp_path, "llama"), 2)
