"""tp.py, pp.py and sft.py copied alone into another project, next to models attotron did not write.

Each group runs in a forked process (tests/dist.py run_alone) that has forgotten every module of
this repository and imports only from a directory holding the copied files (tp.py + loss.py +
ops.py, as tp.py's docstring names them; pp.py + pp_schedules.py; both for tp inside pp; sft.py +
chat.py); the repository root is not importable there (checked). The harness (tests/dist.py,
tests/foreign_models.py and this file) sits in a second directory. One fork-based launch per group:
2 gloo ranks (tp=2, pp=2), 4 for tp=2 inside pp=2.

References: the single-process run of the same model (same seed, same data), fp32. Tolerance:
1e-5 relative to the largest entry of each tensor (the loss, each gradient); tp=2 and pp=2 only
reorder fp32 sums (an all-reduce of 2 partial sums, micro-batch accumulation), a few ULP per entry.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from dist import run_alone

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
FAMILIES = ("llama", "qwen2", "mistral")


def _run(tmp_path: Path, files: list[str], group: str) -> list[dict]:
    """Run `group` of checks where only a directory holding `files` and the harness is importable."""
    lib, harness = tmp_path / "lib", tmp_path / "harness"
    lib.mkdir()
    harness.mkdir()
    for f in files:
        shutil.copy(ROOT / f, lib / f)
    for f in ("dist.py", "foreign_models.py", Path(__file__).name):
        shutil.copy(ROOT / "tests" / f, harness / f)
    return run_alone([str(lib), str(harness)], "test_foreign_tp_pp", "main", group)


def main(group: str) -> list[dict]:
    """In the copied directory: check the repository is out of reach, run the group."""
    for name in ("model", "weights", "train", "dp") + {"tp": ("pp",), "pp": ("tp", "loss"), "tppp": (), "sft": ("tp",)}[group]:
        assert importlib.util.find_spec(name) is None, f"{name}.py is importable: the test would prove nothing"
    import torch
    from dist import run_ranks
    torch.set_num_threads(1)
    fn = {"tp": _tp_checks, "pp": _pp_checks, "tppp": _tp_pp_checks, "sft": None}[group]
    return [_sft_checks()] if fn is None else run_ranks(fn, 4 if group == "tppp" else 2)  # a dict per rank


# ----------------------------------------------------------------------------------------- helpers
def _close(a, b) -> float:
    """max |a - b| relative to max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _batch(seed: int, rows: int = 2, seq: int = 16):
    import torch
    from foreign_models import VOCAB
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:].clone()  # labels aligned with the inputs (already shifted)
    y[0, :3] = -100  # some ignored targets
    return x, y


def _gpt_tp_parts(tp, plan: dict | None = None, heads=("attn.n_head",)):
    from foreign_models import GPTConfig
    h = GPTConfig().n_embd
    return tp.Parts(embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f", head="lm_head",
                    plan=plan or {"attn.c_attn": tp.Fused((h, h, h)), "attn.c_proj": "rowwise",
                                  "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}, heads=heads)


def _raises(fn, *words: str) -> bool:
    """fn raises ValueError whose message names every word."""
    try:
        fn()
    except ValueError as e:
        return all(w in str(e) for w in words)
    return False


def _grads_vs(model, ref, shards, tp, group) -> float:
    """Worst relative gradient error of a tp model against the single-process one."""
    import torch
    worst = 0.0
    for name, p in model.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        got = p.grad
        if name in shards:
            got = tp.gather_tensor(got, shards[name], want.shape[shards[name].dim], group)
        worst = max(worst, _close(got, want))
    assert torch.isfinite(torch.tensor(worst))
    return worst


# ----------------------------------------------------------------------------------------- tp
def _tp_checks(rank: int, world: int) -> dict:
    import torch
    import tp
    from foreign_models import GPT, hf_causal_lm
    out = {}
    x, y = _batch(0)
    tied = {"qwen2": True}  # a head tied to the embedding (and q/k/v biases); llama, mistral untied
    for family in FAMILIES:
        build = lambda: hf_causal_lm(family, tie_word_embeddings=tied.get(family, False))  # noqa: E731
        ref, model = build(), build()
        hf_labels = x.masked_fill(y == -100, -100)  # transformers' own loss shifts its labels itself
        want = ref(x, labels=hf_labels).loss
        want.backward()
        shards = tp.apply_tp(model, None)
        loss = model(x, labels=hf_labels).loss
        loss.backward()
        local_heads = model.model.layers[0].self_attn.q_proj.weight.shape[0] // model.model.layers[0].self_attn.head_dim
        with torch.device("meta"):
            meta = build()
        out[family] = {"loss": _close(loss.detach(), want.detach()), "grads": _grads_vs(model, ref, shards, tp, None),
                       "local q heads": local_heads, "sharded": len(shards),
                       "tied": (model.lm_head.weight is model.model.embed_tokens.weight) == tied.get(family, False),
                       "meta map": tp.apply_tp(meta, None) == shards}  # the same slices, for a loader
    ref, model = GPT(), GPT()
    want = ref(x, y.masked_fill(y == -100, -1))[1]  # the GPT's own loss (ignore_index=-1)
    want.backward()
    bad = GPT()
    out["gpt errors"] = {
        "no parts": _raises(lambda: tp.apply_tp(bad, None), "tp.Parts"),
        "fused as colwise": _raises(lambda: tp.apply_tp(bad, None, parts=_gpt_tp_parts(
            tp, {"attn.c_attn": "colwise", "attn.c_proj": "rowwise"})), "transformer.h.0.attn.c_attn", "tp.Fused"),
        "fused without heads": _raises(lambda: tp.apply_tp(bad, None, parts=_gpt_tp_parts(tp, heads=())),
                                       "Parts.heads"),
        "plan names nothing": _raises(lambda: tp.apply_tp(bad, None, parts=_gpt_tp_parts(
            tp, {"attn.c_atn": "colwise"})), "attn.c_atn"),
        "sequence parallel": _raises(lambda: tp.apply_tp(bad, None, True, parts=_gpt_tp_parts(tp)), "sequence"),
        "unchanged after errors": bad.transformer.h[0].attn.c_attn.weight.shape[0] == 192
                                  and bad.transformer.h[0].attn.n_head == 4,
    }
    shards = tp.apply_tp(model, None, parts=_gpt_tp_parts(tp))
    logits, loss = model(x, y.masked_fill(y == -100, -1))
    loss.backward()
    out["gpt"] = {"loss": _close(loss.detach(), want.detach()), "grads": _grads_vs(model, ref, shards, tp, None),
                  "logits": _close(logits.detach(), ref(x)[0].detach()), "sharded": len(shards),
                  "tied": model.lm_head.weight is model.transformer.wte.weight}
    odd = hf_causal_lm("llama", layers=1)
    odd.config.num_key_value_heads = 3
    out["hf errors"] = {"kv heads": _raises(lambda: tp.apply_tp(odd, None), "num_key_value_heads=3"),
                        "sequence parallel": _raises(lambda: tp.apply_tp(hf_causal_lm("llama", layers=1), None,
                                                                         sequence_parallel=True), "sequence")}
    return out


# ----------------------------------------------------------------------------------------- pp
def _pp_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import pp
    from foreign_models import GPT, hf_causal_lm
    gpt_parts = pp.Parts(embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
                         head="lm_head", positions="transformer.wpe")
    gpt_loss = _gpt_loss
    mbs = [dict(zip(("input_ids", "labels"), _batch(s, rows=1))) for s in range(4)]
    targets = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
    out = {}
    for kind in ("llama", "gpt"):
        build = (lambda: hf_causal_lm("llama")) if kind == "llama" else GPT
        parts, loss_fn = (None, None) if kind == "llama" else (gpt_parts, gpt_loss)
        batches = mbs if kind == "llama" else [
            {"input_ids": mb["input_ids"], "labels": mb["labels"].masked_fill(mb["labels"] == -100, -1)} for mb in mbs]
        ref = build()  # the whole model in one process, through its own forward
        logits = [ref(mb["input_ids"]).logits if kind == "llama" else ref(mb["input_ids"])[0] for mb in batches]
        want = sum((loss_fn or pp.token_loss)(z, mb["labels"], "sum") for z, mb in zip(logits, batches)) / targets
        want.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        ref_grads["lm_head.weight"] = ref.lm_head.weight.grad  # the GPT's tied head: the embedding's
        for schedule in ("1f1b", "zb"):
            model = build()
            stage = pp.split_stage(model, rank, 2, pp.partition(4, 2), parts, loss_fn)
            loss = pp.run_pipeline(stage, pp.SCHEDULES[schedule](4, rank, 2), batches, dist.group.WORLD, targets,
                                   hidden_size=64)
            if pp.tied_copy(stage) is not None:
                pp.sync_tied_grads(stage, None)  # the default group: both stages
            grads = {n: p.grad for n, p in stage.named_parameters()}
            out[kind, schedule] = {"loss": _close(loss, want.detach()),
                                   "grads": max(_close(g, ref_grads[n]) for n, g in grads.items()),
                                   "params": len(grads), "names kept": all(n in ref_grads for n in grads)}
    out["stage output"] = {
        "hidden on stage 0": tuple(pp.split_stage(hf_causal_lm("llama"), 0, 2, pp.partition(4, 2))(
            mbs[0]["input_ids"]).shape),
        "logits without labels": tuple(pp.split_stage(hf_causal_lm("llama"), 0, 1, [range(4)])(
            mbs[0]["input_ids"]).shape)}
    out["errors"] = {
        "gpt without parts": _raises(lambda: pp.split_stage(GPT(), 0, 2, pp.partition(4, 2)), "pp.Parts"),
        "virtual stages": _raises(lambda: pp.split_stage(hf_causal_lm("llama"), 0, 2, pp.partition(4, 4)),
                                  "virtual"),
        "ranges": _raises(lambda: pp.split_stage(hf_causal_lm("llama"), 0, 2, [range(2), range(3, 4)]),
                          "do not cover"),
    }
    out = {f"{k[0]} {k[1]}" if isinstance(k, tuple) else k: v for k, v in out.items()}
    return out


# ----------------------------------------------------------------------------------------- tp x pp
def _tp_pp_checks(rank: int, world: int) -> dict:
    """tp=2 inside pp=2 (4 ranks): split first, then apply_tp to the stage (the composition order)."""
    import torch.distributed as dist
    import pp
    import tp
    from foreign_models import GPT, hf_causal_lm
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage_rank, tp_rank = divmod(rank, 2)
    tp_group, pp_group = tp_groups[stage_rank], pp_groups[tp_rank]
    mbs = [dict(zip(("input_ids", "labels"), _batch(s, rows=1))) for s in range(4)]
    targets = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
    out = {}
    for kind, schedule in (("llama", "1f1b"), ("gpt", "zb")):
        build = (lambda: hf_causal_lm("llama")) if kind == "llama" else GPT
        if kind == "llama":
            batches, pp_parts, tp_parts, loss_fn = mbs, None, None, None
        else:
            batches = [{"input_ids": mb["input_ids"], "labels": mb["labels"].masked_fill(mb["labels"] == -100, -1)}
                       for mb in mbs]
            pp_parts = pp.Parts(embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
                                head="lm_head", positions="transformer.wpe")
            tp_parts, loss_fn = _gpt_tp_parts(tp), _gpt_loss
        ref = build()
        logits = [ref(mb["input_ids"]).logits if kind == "llama" else ref(mb["input_ids"])[0] for mb in batches]
        want = sum((loss_fn or pp.token_loss)(z, mb["labels"], "sum") for z, mb in zip(logits, batches)) / targets
        want.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        ref_grads["lm_head.weight"] = ref.lm_head.weight.grad  # the GPT's tied head: the embedding's
        stage = pp.split_stage(build(), stage_rank, 2, pp.partition(4, 2), pp_parts, loss_fn)
        shards = tp.apply_tp(stage, tp_group, parts=tp_parts)
        loss = pp.run_pipeline(stage, pp.SCHEDULES[schedule](4, stage_rank, 2), batches, pp_group, targets,
                               hidden_size=64)
        if pp.tied_copy(stage) is not None:
            pp.sync_tied_grads(stage, pp_group)  # the two copies' slices sit at the same tp rank
        worst = 0.0
        for n, q in stage.named_parameters():
            g = q.grad if n not in shards else tp.gather_tensor(q.grad, shards[n], ref_grads[n].shape[shards[n].dim],
                                                                tp_group)
            worst = max(worst, _close(g, ref_grads[n]))
        out[f"{kind} {schedule}"] = {"loss": _close(loss, want.detach()), "grads": worst, "sharded": len(shards)}
    return out


def _gpt_loss(logits, labels, reduction):
    """The GPT's own loss (ignore_index=-1), with a reduction."""
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1, reduction=reduction)


# ----------------------------------------------------------------------------------------- sft
def _sft_checks() -> dict:
    import sys as _sys
    import sft
    return {"model imported": "model" in _sys.modules, "packer": hasattr(sft, "SFTDataset"),
            "evaluate moved": not hasattr(sft, "evaluate")}


# ----------------------------------------------------------------------------------------- tests
def test_tp_alone_on_transformers_and_gpt(tmp_path):
    pytest.importorskip("transformers")
    for r in _run(tmp_path, ["tp.py", "loss.py", "ops.py"], "tp"):  # each rank
        for family in FAMILIES:
            assert r[family]["loss"] <= TOL and r[family]["grads"] <= TOL, (family, r[family])
            assert r[family]["local q heads"] == 2, r[family]  # 4 heads over tp=2
            assert r[family]["sharded"] > 0 and r[family]["tied"] and r[family]["meta map"], r[family]
        assert r["gpt"]["loss"] <= TOL and r["gpt"]["grads"] <= TOL and r["gpt"]["logits"] <= TOL, r["gpt"]
        assert r["gpt"]["tied"] and r["gpt"]["sharded"] > 0
        assert all(r["gpt errors"].values()), r["gpt errors"]
        assert all(r["hf errors"].values()), r["hf errors"]


def test_pp_alone_on_transformers_and_gpt(tmp_path):
    pytest.importorskip("transformers")
    for r in _run(tmp_path, ["pp.py", "pp_schedules.py"], "pp"):  # each stage
        for kind in ("llama", "gpt"):
            for schedule in ("1f1b", "zb"):
                c = r[f"{kind} {schedule}"]
                assert c["loss"] <= TOL and c["grads"] <= TOL and c["names kept"] and c["params"] > 0, (kind, schedule, c)
        assert r["stage output"] == {"hidden on stage 0": (1, 16, 64), "logits without labels": (1, 16, 97)}
        assert all(r["errors"].values()), r["errors"]


def test_tp_inside_pp_alone(tmp_path):
    pytest.importorskip("transformers")
    for r in _run(tmp_path, ["tp.py", "loss.py", "ops.py", "pp.py", "pp_schedules.py"], "tppp"):  # each rank
        for kind in ("llama 1f1b", "gpt zb"):
            assert r[kind]["loss"] <= TOL and r[kind]["grads"] <= TOL and r[kind]["sharded"] > 0, (kind, r[kind])


def test_sft_packer_alone(tmp_path):
    r, = _run(tmp_path, ["sft.py", "chat.py"], "sft")
    assert r == {"model imported": False, "packer": True, "evaluate moved": True}
