"""checkpoint.py + checkpoint_load.py: resume in the same layout and across layouts, atomic saves,
damaged checkpoints.

References: the straight run (the same steps without a save/load in between) in the same layout,
and the single-process straight run; for the moved state, the masters and AdamW moments gathered
from the saving layout by an independent path (pieces zero-padded and all-reduced over dp, then
tp.gather_full), never through checkpoint.py or checkpoint_load.py.

Tolerances, and why:
- same layout: bit-identical losses, parameters, masters and moments (torch.equal): a resume puts
  back exactly the tensors the straight run holds (masters, moments, AdamW step) and the sampler
  position, and every op after it is the same op on the same values.
- cross layout: masters and moments bit-identical to the gathered originals (they are moved, not
  computed); the following losses within 1e-5 relative of the straight run (the new layout sums in
  another order: gloo at 4 ranks, tp's all-reduces, pipeline micro-batches).
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import checkpoint as C
import checkpoint_load as CL
import dp
import model as M
import precision as P
import tp as T
import weights as W
import zero3 as Z3
from dist import run_ranks
from pp import norm_counted, one_f_one_b, partition, run_pipeline, split_stage, tied_copy

# vocab 97: tp=2 pads it to 98, one padding row that is never stored
CFG = M.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
TIED = replace(CFG, tie_word_embeddings=True)
SEQ, N_ROWS, G, LR = 16, 40, 8, 1e-2
OPT = P.OptimConfig(lr=LR, clip=1.0)
TOL = 1e-5


# ----------------------------------------------------------------------------------------- helpers
def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed rows with uneven target counts (a random prefix of labels kept per row)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (N_ROWS, SEQ), generator=g)
    y = torch.randint(0, CFG.vocab_size, (N_ROWS, SEQ), generator=g)
    keep = torch.randint(1, SEQ + 1, (N_ROWS,), generator=g)
    y[torch.arange(SEQ)[None] >= keep[:, None]] = -100
    return x, y


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(u - v) / abs(v) for u, v in zip(a, b))


def make(cfg: M.LlamaConfig, lay: C.Layout, g: dict, zero: int, dtype: torch.dtype = torch.float32):
    """train.py's composition: build (meta) → pp split → apply_tp → materialize → apply_zero.
    g: the groups {"tp", "dp", "pp", "emb"} (absent in a plain single process)."""
    m = M.build(cfg)
    if lay.pp > 1:
        split_stage(m, lay.pp_rank, lay.pp, partition(cfg.num_hidden_layers, lay.pp))
    shards = T.apply_tp(m, g["tp"]) if lay.tp > 1 else {}
    W.materialize(m, "cpu", seed=0, shards=shards)
    tied = norm_counted(m)
    counted = lambda n: (n in shards or lay.tp_rank == 0) and tied(n)  # noqa: E731
    norm_groups = [g[k] for k, size in (("tp", lay.tp), ("pp", lay.pp)) if size > 1]
    opt = Z3.apply_zero(m, zero, g.get("dp"), OPT, dtype, bucket_mb=0.01, norm_groups=norm_groups,
                        counted=counted, tied=tied_copy(m), embed_group=g.get("emb"))
    return m, shards, opt


def steps(m, opt, sampler: dp.DPSampler, lay: C.Layout, g: dict, n: int) -> list[float]:
    """n optimizer steps of train.py's loop (loss = token-loss sum / global target count, summed
    over dp); with pp, a 1F1B pipeline of 2 micro-batches (dp = 1 there)."""
    x, y = dataset()
    losses = []
    for _ in range(n):
        idx = torch.tensor(sampler.next_batch())
        targets = dp.global_count(P.count_targets(y[idx]), g.get("dp"))
        if lay.pp > 1:
            mbs = [{"input_ids": a, "labels": b} for a, b in zip(x[idx].chunk(2), y[idx].chunk(2))]
            loss = run_pipeline(m, one_f_one_b(2, lay.pp_rank, lay.pp), mbs, g["pp"], targets,
                                no_sync=opt.no_sync, hidden_size=m.config.hidden_size)  # tied copies: summed in step()
        else:
            loss = P.normalized_loss(m(x[idx], labels=y[idx], reduction="sum"), targets)
            loss.backward()
            loss = loss.detach()
        if lay.dp > 1:
            dist.all_reduce(loss, group=g["dp"])
        losses.append(float(loss))
        opt.step(LR)
    return losses


def sampler(lay: C.Layout) -> dp.DPSampler:
    return dp.DPSampler(N_ROWS, G, lay.dp_rank, lay.dp, seed=7)


def local_state(m, opt) -> list[torch.Tensor]:
    """This rank's params, masters and moments (for same-layout comparisons)."""
    with opt.gathered():
        out = [p.detach().clone() for p in m.parameters()]
    for w in opt.master:
        s = opt.optimizer.state[w]
        out += [w.detach().clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone(), s["step"].clone()]
    return out


def full_state(opt, shards: dict, cfg: M.LlamaConfig, lay: C.Layout, g: dict) -> dict:
    """{"<name>/<kind>": full tensor} without checkpoint.py: a ZeRO piece is zero-padded to its local
    parameter and summed over dp (exact: x + 0 = x), then tp.gather_full cuts the vocab padding."""
    pieces = getattr(opt, "pieces", None)
    out = {}
    for kind in C.KINDS:
        local = {}
        for i, name in enumerate(opt.names):
            w, p = opt.master[i], opt.params[i]
            t = (w if kind == "master" else opt.optimizer.state[w][kind]).detach()
            if pieces is not None:
                buf = torch.zeros(p.numel())
                buf[pieces[i].start:pieces[i].start + pieces[i].n] = t
                if lay.dp > 1:
                    dist.all_reduce(buf, group=g["dp"])
                t = buf
            local[name] = t.reshape(p.shape).clone()
        full = T.gather_full(local, shards, g["tp"], cfg) if lay.tp > 1 else local
        out |= {f"{n}/{kind}": t for n, t in full.items()}
    return out


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SINGLE = C.Layout()


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_process_resume_rng_and_files(tmp_path, dtype):
    """1 process: 4 straight steps == 2 steps + save + fresh build + load + 2 steps, bitwise (bf16:
    the compute params are re-cast from the loaded fp32 masters); the RNG continues where it was
    saved; the file layout and meta.json are as documented; saving a step again replaces it."""
    m, _, opt = make(CFG, SINGLE, {}, 0, dtype)
    straight = steps(m, opt, sampler(SINGLE), SINGLE, {}, 4)
    ref = local_state(m, opt)

    m, shards, opt = make(CFG, SINGLE, {}, 0, dtype)
    s = sampler(SINGLE)
    first = steps(m, opt, s, SINGLE, {}, 2)
    torch.manual_seed(1234)
    path = C.save_checkpoint(tmp_path, 2, opt, CFG, shards, SINGLE, {"sampler": s.state_dict(), "lr": LR})
    assert path == tmp_path / "step_00000002" and C.latest_checkpoint(tmp_path) == path
    assert sorted(os.listdir(path)) == ["meta.json", "rank00000.json", "rank00000.safetensors"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 2 and meta["layout"] == {"tp": 1, "dp": 1, "pp": 1, "zero": 0}
    assert meta["extra"]["lr"] == LR and meta["shapes"]["lm_head.weight"] == [97, 32]
    again = C.save_checkpoint(tmp_path, 2, opt, CFG, shards, SINGLE, meta["extra"])  # same step again
    assert again == path and sorted(os.listdir(tmp_path)) == ["step_00000002"]
    draws = torch.rand(5)  # what the straight run would draw next

    torch.manual_seed(0)
    m, shards, opt = make(CFG, SINGLE, {}, 0, dtype)
    got = CL.load_checkpoint(path, opt, CFG, shards, SINGLE)
    assert got.step == 2 and got.rng_restored and torch.equal(torch.rand(5), draws)
    s = sampler(SINGLE)
    s.load_state_dict(got.extra["sampler"])
    resumed = first + steps(m, opt, s, SINGLE, {}, 2)
    assert resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(local_state(m, opt), ref))


SAME = [("dp2_zero0", 1, 2, 0), ("dp2_zero1", 1, 2, 1), ("dp2_zero2", 1, 2, 2), ("dp2_zero3", 1, 2, 3),
        ("tp2", 2, 1, 0), ("tp2_zero1", 2, 1, 1)]


def _same_layout(rank: int, world: int, root: str) -> dict:
    W = dist.group.WORLD
    single = [dist.new_group([r]) for r in range(world)][rank]  # tp2's dp group of one rank
    out = {}
    for name, tp, dp_, zero in SAME:
        lay = C.Layout(tp=tp, dp=dp_, tp_rank=rank % tp, dp_rank=rank // tp)
        g = {"tp": W, "dp": single} if tp > 1 else {"dp": W}
        m, _, opt = make(CFG, lay, g, zero)
        straight = steps(m, opt, sampler(lay), lay, g, 4)
        ref = local_state(m, opt)
        opt.teardown()

        m, shards, opt = make(CFG, lay, g, zero)
        s = sampler(lay)
        first = steps(m, opt, s, lay, g, 2)
        torch.manual_seed(100 + rank)
        path = C.save_checkpoint(Path(root) / name, 2, opt, CFG, shards, lay, {"sampler": s.state_dict()})
        draws = torch.rand(3)
        opt.teardown()

        torch.manual_seed(0)
        m, shards, opt = make(CFG, lay, g, zero)
        got = CL.load_checkpoint(path, opt, CFG, shards, lay)
        rng = got.rng_restored and torch.equal(torch.rand(3), draws)
        s = sampler(lay)
        s.load_state_dict(got.extra["sampler"])
        resumed = first + steps(m, opt, s, lay, g, 2)
        bitwise = all(torch.equal(a, b) for a, b in zip(local_state(m, opt), ref))
        opt.teardown()
        out[name] = (resumed == straight, bitwise, rng, sorted(os.listdir(path)), straight)
    return out


def test_same_layout_resume_is_bit_identical(tmp_path):
    """dp=2 with ZeRO 0-3 and tp=2 (ZeRO 0 and 1, vocab padded): losses, parameters, masters and
    moments after 2 + save/load + 2 steps equal the 4 straight steps bit for bit; RNG restored."""
    res = run_ranks(_same_layout, 2, str(tmp_path), timeout=120)
    for name, *_ in SAME:
        (same0, bits0, rng0, files, curve), (same1, bits1, rng1, _, _) = res[0][name], res[1][name]
        assert same0 and same1, (name, curve)  # the loss curves
        assert bits0 and bits1 and rng0 and rng1, name
        # who writes: stage 0 dp=2 → dp rank 0 only; ZeRO → both dp ranks; tp → both tp ranks
        writers = ["rank00000.safetensors"] + (["rank00001.safetensors"] if name != "dp2_zero0" else [])
        assert files == sorted(["meta.json", "rank00000.json", "rank00001.json"] + writers), name


def _cross(rank: int, world: int, root: str) -> dict:
    """4 ranks: tp2·dp2·ZeRO-2 saves; dp4·ZeRO-3 and pp2·tp2·ZeRO-1 load it; the latter saves."""
    tp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    pair_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]  # dp (tp2·dp2) or pp/emb (pp2·tp2)
    single = [dist.new_group([r]) for r in range(world)][rank]
    tp_g, pair = tp_groups[rank // 2], pair_groups[rank % 2]
    out: dict = {}
    lay = C.Layout(tp=2, dp=2, tp_rank=rank % 2, dp_rank=rank // 2)
    g = {"tp": tp_g, "dp": pair}
    m, _, opt = make(TIED, lay, g, 2)
    out["straight"] = steps(m, opt, sampler(lay), lay, g, 6)
    opt.teardown()

    m, shards, opt = make(TIED, lay, g, 2)
    s = sampler(lay)
    out["first"] = steps(m, opt, s, lay, g, 2)
    out["saved"] = full_state(opt, shards, TIED, lay, g)
    C.save_checkpoint(Path(root) / "a", 2, opt, TIED, shards, lay, {"sampler": s.state_dict()})
    opt.teardown()

    lay4 = C.Layout(dp=4, dp_rank=rank)
    g4 = {"dp": dist.group.WORLD}
    m, shards, opt = make(TIED, lay4, g4, 3)
    got = CL.load_checkpoint(Path(root) / "a" / "step_00000002", opt, TIED, shards, lay4)
    out["dp4_rng"] = got.rng_restored
    out["dp4_loaded"] = full_state(opt, shards, TIED, lay4, g4)
    s = sampler(lay4)
    s.load_state_dict(got.extra["sampler"])
    out["dp4"] = steps(m, opt, s, lay4, g4, 2)
    opt.teardown()

    lay_pp = C.Layout(tp=2, pp=2, tp_rank=rank % 2, pp_rank=rank // 2)
    g_pp = {"tp": tp_g, "pp": pair, "emb": pair, "dp": single}
    m, shards, opt = make(TIED, lay_pp, g_pp, 1)
    reads, real = [], CL._Index.tensor

    def counted(index, file, key, n, read=True):
        if read:
            reads.append((file.name, key.split("/")[0]))
        return real(index, file, key, n, read)
    CL._Index.tensor = counted
    got = CL.load_checkpoint(Path(root) / "a" / "step_00000002", opt, TIED, shards, lay_pp)
    CL._Index.tensor = real
    # a tp-sharded tensor is read only from the savers with the same tp rank (ranks t and t + 2)
    sharded = {CL.EMBED if n == "lm_head.weight" else n for n in shards}
    t = lay_pp.tp_rank
    out[f"pp_reads_{rank}"] = {f for f, k in reads if k in sharded} == {f"rank0000{t}.safetensors",
                                                                        f"rank0000{t + 2}.safetensors"}
    s = sampler(lay_pp)
    s.load_state_dict(got.extra["sampler"])
    out["pp"] = steps(m, opt, s, lay_pp, g_pp, 2)
    out["pp_saved"] = full_state(opt, shards, TIED, lay_pp, g_pp)
    path = C.save_checkpoint(Path(root) / "b", 4, opt, TIED, shards, lay_pp, {"sampler": s.state_dict()})
    out["pp_files"] = sorted(os.listdir(path))
    opt.teardown()
    return out


def test_cross_layout_resume(tmp_path):
    """Saved under tp2·dp2·ZeRO-2 (tied, padded vocab): dp4·ZeRO-3, pp2·tp2·ZeRO-1 and a single process
    load bit-identical masters and moments and continue within 1e-5 of the straight curve; the
    pp2·tp2 checkpoint (the last stage's tied copy not stored) loads in a single process too."""
    res = run_ranks(_cross, 4, str(tmp_path), timeout=120)
    r0 = res[0]
    m, _, opt = make(TIED, SINGLE, {}, 0)
    single = steps(m, opt, sampler(SINGLE), SINGLE, {}, 6)
    straight = r0["straight"]
    assert rel(straight, single) <= TOL
    assert rel(r0["first"], straight[:2]) == 0.0

    saved = r0["saved"]
    assert not any(k.startswith("lm_head") for k in saved)  # tied: stored once, as the embedding
    assert saved["model.embed_tokens.weight/master"].shape == (97, 32)  # padding row cut
    assert not r0["dp4_rng"] and equal_states(r0["dp4_loaded"], saved)
    assert rel(r0["dp4"], straight[2:4]) <= TOL and rel(r0["pp"], straight[2:4]) <= TOL, (r0["dp4"], r0["pp"])

    m, shards, opt = make(TIED, SINGLE, {}, 0)
    got = CL.load_checkpoint(tmp_path / "a" / "step_00000002", opt, TIED, shards, SINGLE)
    assert not got.rng_restored and got.saved_layout == {"tp": 2, "dp": 2, "pp": 1, "zero": 2}
    assert equal_states(full_state(opt, shards, TIED, SINGLE, {}), saved)
    s = sampler(SINGLE)
    s.load_state_dict(got.extra["sampler"])
    assert rel(steps(m, opt, s, SINGLE, {}, 2), straight[2:4]) <= TOL

    assert all(res[r][f"pp_reads_{r}"] for r in range(4))
    # pp2·tp2: stage 0 (ranks 0, 1) holds the embedding, stage 1 (ranks 2, 3) its tied copy
    pp_saved = res[0]["pp_saved"] | res[2]["pp_saved"]
    for kind in C.KINDS:  # the copies stayed identical, so storing one of them loses nothing
        copy = pp_saved.pop(f"lm_head.weight/{kind}")
        assert torch.equal(copy, pp_saved[f"model.embed_tokens.weight/{kind}"])
    # tp ranks of both stages write (4 files), no dp replicas
    files = [f"rank0000{r}.{ext}" for r in range(4) for ext in ("json", "safetensors")]
    assert r0["pp_files"] == ["meta.json"] + files
    m, shards, opt = make(TIED, SINGLE, {}, 0)
    got = CL.load_checkpoint(tmp_path / "b" / "step_00000004", opt, TIED, shards, SINGLE)
    assert equal_states(full_state(opt, shards, TIED, SINGLE, {}), pp_saved)
    s = sampler(SINGLE)
    s.load_state_dict(got.extra["sampler"])
    assert rel(steps(m, opt, s, SINGLE, {}, 2), straight[4:6]) <= TOL


class Injected(BaseException):
    """A kill: no handler catches it (a caught error would be reported to every rank and cleaned up)."""


def _crash(rank: int, world: int, root: str) -> None:
    """dp2·ZeRO-1: save at step 2, then rank 1 dies at step 3 right after writing its tensors."""
    lay = C.Layout(dp=2, dp_rank=rank)
    g = {"dp": dist.group.WORLD}
    m, shards, opt = make(CFG, lay, g, 1)
    s = sampler(lay)
    steps(m, opt, s, lay, g, 2)
    C.save_checkpoint(root, 2, opt, CFG, shards, lay, {"sampler": s.state_dict()})
    steps(m, opt, s, lay, g, 1)
    if rank == 1:
        real = C.write_safetensors

        def save_then_die(*args, **kw):
            real(*args, **kw)
            raise Injected("killed between files")
        C.write_safetensors = save_then_die
    C.save_checkpoint(root, 3, opt, CFG, shards, lay, {"sampler": s.state_dict()})


def _resume_after_crash(rank: int, world: int, root: str) -> tuple:
    lay = C.Layout(dp=2, dp_rank=rank)
    g = {"dp": dist.group.WORLD}
    m, _, opt = make(CFG, lay, g, 1)
    straight = steps(m, opt, sampler(lay), lay, g, 4)
    ref = local_state(m, opt)
    opt.teardown()
    m, shards, opt = make(CFG, lay, g, 1)
    got = CL.load_checkpoint(C.latest_checkpoint(root), opt, CFG, shards, lay)
    s = sampler(lay)
    s.load_state_dict(got.extra["sampler"])
    losses = []
    for step in (3, 4):  # the restarted run saves again, over the crashed save's debris
        losses += steps(m, opt, s, lay, g, 1)
        C.save_checkpoint(root, step, opt, CFG, shards, lay, {"sampler": s.state_dict()})
    bitwise = all(torch.equal(a, b) for a, b in zip(local_state(m, opt), ref))
    return got.step, losses == straight[2:], bitwise


def test_interrupted_save_keeps_previous_and_prune(tmp_path):
    with pytest.raises(RuntimeError, match="killed between files"):
        run_ranks(_crash, 2, str(tmp_path), timeout=60)
    debris = tmp_path / "step_00000003.tmp"
    assert (debris / "rank00001.safetensors").is_file() and not (debris / "meta.json").exists()
    assert not (tmp_path / "step_00000003").exists()
    assert C.latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    for step, same_losses, bitwise in run_ranks(_resume_after_crash, 2, str(tmp_path), timeout=60):
        assert step == 2 and same_losses and bitwise
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003", "step_00000004"]
    (tmp_path / "step_00000009.tmp").mkdir()  # a crashed save of a later step is never "latest"
    (tmp_path / "step_00000007").mkdir()  # nor a folder without meta.json
    assert C.latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    removed = C.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000009.tmp"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004", "step_00000007"]
    assert C.latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="keep must be >= 1"):
        C.prune(tmp_path, 0)


def test_damaged_checkpoints_are_named(tmp_path, monkeypatch):
    """Every damage is reported with the file it is in, before any tensor is copied; torch.load
    (pickle) is never called."""
    m, shards, opt = make(CFG, SINGLE, {}, 0)
    init = C.save_checkpoint(tmp_path / "init", 0, opt, CFG, shards, SINGLE, {})  # no moments yet
    steps(m, opt, sampler(SINGLE), SINGLE, {}, 1)
    good = C.save_checkpoint(tmp_path / "good", 1, opt, CFG, shards, SINGLE, {})
    CL.load_checkpoint(init, opt, CFG, shards, SINGLE)  # back to the initial weights, no AdamW state
    assert not opt.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), make(CFG, SINGLE, {}, 0)[0].parameters()))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    m, shards, opt = make(CFG, SINGLE, {}, 0)
    before = [p.detach().clone() for p in m.parameters()]

    def damaged(name: str, fn) -> Path:
        path = tmp_path / name
        shutil.copytree(good, path)
        fn(path)
        return path

    def truncate(f: Path) -> None:
        f.write_bytes(f.read_bytes()[:-100])

    def scribble(f: Path) -> None:  # same size, garbage header
        data = f.read_bytes()
        f.write_bytes(b"\xff" * 16 + data[16:])

    def edit_index(path: Path, fn) -> None:  # a consistent-looking but wrong index (sizes, sums fixed)
        index = json.loads((path / "rank00000.json").read_text())
        entries = {e["name"]: e for e in index["entries"]}
        fn(entries)
        index["entries"] = list(entries.values())
        (path / "rank00000.json").write_text(json.dumps(index))
        meta = json.loads((path / "meta.json").read_text())
        data = (path / "rank00000.json").read_bytes()
        meta["files"]["rank00000.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        (path / "meta.json").write_text(json.dumps(meta))

    def flip(f: Path, at: int, bit: int) -> None:  # same size, one bit of the data changed
        data = bytearray(f.read_bytes())
        data[at] ^= 1 << bit
        f.write_bytes(bytes(data))

    def shift(entries: dict) -> None:
        entries["model.norm.weight"]["start"] = 1

    def shorten(entries: dict) -> None:
        entries["model.norm.weight"]["n"] -= 1

    tensors = "rank00000.safetensors"
    cases = [
        (damaged("dropped", lambda p: edit_index(p, lambda e: e.pop("model.norm.weight"))), ValueError,
         r"dropped: no saved pieces for 1 tensors: \['model.norm.weight'\]"),
        (damaged("shifted", lambda p: edit_index(p, shift)), ValueError,
         r"model.norm.weight: saved pieces of slice None do not tile it at element 0 \(entry in .*shifted"),
        (damaged("short", lambda p: edit_index(p, shorten)), ValueError,
         rf"short/{tensors}: model.norm.weight/master has shape \[32\], its index says \[31\]"),
        (damaged("trunc", lambda p: truncate(p / tensors)), ValueError,
         rf"trunc/{tensors}: \d+ bytes, meta"),
        (damaged("header", lambda p: scribble(p / tensors)), ValueError,
         rf"header/{tensors}: not a readable"),
        (damaged("missing", lambda p: (p / tensors).unlink()), FileNotFoundError,
         rf"missing/{tensors}: missing"),
        (damaged("nometa", lambda p: (p / "meta.json").unlink()), FileNotFoundError,
         r"nometa/meta.json: missing"),
        (damaged("badjson", lambda p: truncate(p / "meta.json")), ValueError,
         r"badjson/meta.json: not valid JSON"),
        # a byte flipped inside the data (same size, valid header): the lowest mantissa bit of the
        # last float, and an exponent bit of the last float
        (damaged("mantissa", lambda p: flip(p / tensors, -4, 0)), ValueError,
         rf"mantissa/{tensors}: checksum mismatch \(crc32 [0-9a-f]{{8}}, meta.json says [0-9a-f]{{8}}\)"),
        (damaged("exponent", lambda p: flip(p / tensors, -1, 6)), ValueError,
         rf"exponent/{tensors}: checksum mismatch"),
        (damaged("index", lambda p: flip(p / "rank00000.json", 20, 0)), ValueError,
         r"index/rank00000.json: checksum mismatch"),
    ]
    for path, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            CL.load_checkpoint(path, opt, CFG, shards, SINGLE)

    def format_1(path: Path) -> None:  # sizes only, as checkpoints were written before the crc32
        meta = json.loads((path / "meta.json").read_text())
        meta["format"] = "attotron-checkpoint-1"
        meta["files"] = {f: info["bytes"] for f, info in meta["files"].items()}
        (path / "meta.json").write_text(json.dumps(meta))
    CL.load_checkpoint(damaged("format1", format_1), opt, CFG, shards, SINGLE)  # still loads
    m1, shards1, opt1 = make(CFG, SINGLE, {}, 0)
    CL.load_checkpoint(good, opt1, CFG, shards1, SINGLE)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m1.parameters()))
    CL.load_checkpoint(init, opt, CFG, shards, SINGLE)  # back to where the damaged cases left it
    other = replace(CFG, intermediate_size=96)  # shape mismatch against the config
    m2, shards2, opt2 = make(other, SINGLE, {}, 0)
    msg = r"good/step_00000001/meta.json: .*mlp.gate_proj.weight: saved \[64, 32\], config \[96, 32\]"
    with pytest.raises(ValueError, match=msg) as got:
        CL.load_checkpoint(good, opt2, other, shards2, SINGLE)
    # gate, up, down of 2 layers: three named and a count, not the whole list
    assert "6 of 21 tensors differ" in str(got.value) and str(got.value).endswith("... (3 more)")
    with pytest.raises(ValueError, match=r"lm_head.weight: saved \[97, 32\], config None"):
        CL.load_checkpoint(good, make(TIED, SINGLE, {}, 0)[2], TIED, {}, SINGLE)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))  # nothing was copied
    with pytest.raises(TypeError):  # extra must be JSON: checked before anything is written
        C.save_checkpoint(tmp_path / "x", 1, opt, CFG, shards, SINGLE, {"t": torch.zeros(1)})
    assert not (tmp_path / "x").exists()


def test_prune_never_touches_later_steps(tmp_path):
    """A run resumed from step 3 of a folder that also holds steps 10 and 11 (another run's) prunes
    only up to the step it saved: it can neither remove its own checkpoint nor the later ones."""
    for step in (1, 2, 3, 10, 11):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "meta.json").write_text("{}")
    removed = C.prune(tmp_path, keep=2, upto=3)
    assert [p.name for p in removed] == ["step_00000001"]
    assert sorted(os.listdir(tmp_path)) == [f"step_{s:08d}" for s in (2, 3, 10, 11)]


def _unshared(rank: int, world: int, root: str) -> str:
    """dp2·ZeRO-1, but rank 1 writes where rank 0 cannot see it (its files vanish after writing)."""
    lay = C.Layout(dp=2, dp_rank=rank)
    m, shards, opt = make(CFG, lay, {"dp": dist.group.WORLD}, 1)
    if rank == 1:
        real = C.write_safetensors

        def elsewhere(path, *a, **k):
            info = real(path, *a, **k)
            Path(path).unlink()
            return info
        C.write_safetensors = elsewhere
    try:
        C.save_checkpoint(root, 1, opt, CFG, shards, lay, {})
    except OSError as e:
        return str(e)
    return "saved"


def test_meta_lists_what_ranks_report_and_needs_a_shared_filesystem(tmp_path):
    """meta.json's file list is the ranks' gathered reports, checked against what rank 0 sees: a
    file only its writer can see stops every rank, and no partial folder is left."""
    msgs = run_ranks(_unshared, 2, str(tmp_path), timeout=60)
    assert msgs[0] == msgs[1] and "rank00001.safetensors: written by another rank" in msgs[0]
    assert "all ranks must write one shared filesystem" in msgs[0]
    assert os.listdir(tmp_path) == []
