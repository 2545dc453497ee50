"""grpo.py's parts against their formulas, written out by hand in float64.

- Advantages: hand-made groups, among them one whose rewards are all equal (exactly 0, no NaN) and
  one of a single reply.
- The loss: token by token against the formula (clip, KL's k3), normalized by a given global count;
  the surrogate gives no gradient to a token whose ratio is outside the clip range on its side.
- Rollouts: G replies per prompt from a tiny model, reproducible from the seed, labels covering the
  reply up to its end token; the verifier by import path.
- tp2 against the single process on fixed rollouts: the loss and the replicated (norm) parameters'
  gradients within 1e-5 relative (fp32; tp reorders a few sums).
"""
import itertools
import json
import math
import re
import time

import pytest
import torch

import grpo
import model as M
import weights as W
from dist import run_ranks
from test_model import assert_close


def test_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3], [2.0, 0.0, 1.0, 5.0]])
    got = grpo.group_advantages(r)
    for row, g in zip(r.tolist(), got.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / len(row))
        want = [0.0 if std == 0 else (x - mean) / (std + 1e-4) for x in row]
        assert g == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert torch.equal(got[1], torch.zeros(4)) and torch.isfinite(got).all()
    assert torch.equal(grpo.group_advantages(torch.tensor([[0.7]])), torch.zeros(1, 1))


def test_loss_formula():
    g = torch.Generator().manual_seed(0)
    N, T = 3, 5
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    ref = old + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    mask = torch.rand(N, T, generator=g) > 0.3
    for beta in (0.0, 0.05):
        loss, stats = grpo.grpo_loss(logp, old, adv, mask, total_tokens=11, clip_eps=0.2, kl_beta=beta,
                                     ref_logp=ref)
        want, clipped = 0.0, 0
        for i in range(N):
            for t in range(T):
                if mask[i, t]:
                    rho = math.exp(logp[i, t].item() - old[i, t].item())
                    a = adv[i].item()
                    surr = min(rho * a, min(max(rho, 0.8), 1.2) * a)
                    q = ref[i, t].item() - logp[i, t].item()
                    want += -surr + beta * (math.exp(q) - q - 1)
                    clipped += not 0.8 <= rho <= 1.2
        assert loss.item() == pytest.approx(want / 11, rel=1e-12)
        assert stats.clip_fraction.item() == pytest.approx(clipped / mask.sum().item())
    loss, _ = grpo.grpo_loss(logp, old, adv, mask, total_tokens=11)
    loss.backward()
    rho = (logp - old).exp().detach()
    dead = ((rho > 1.2) & (adv[:, None] > 0)) | ((rho < 0.8) & (adv[:, None] < 0)) | ~mask
    assert dead.any() and (logp.grad[dead] == 0).all() and (logp.grad[~dead] != 0).any()
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo.grpo_loss(logp, old, adv, mask, 11, kl_beta=0.1)


def test_rollout_and_reward():
    cfg = M.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        initializer_range=0.3)
    model = W.materialize(M.build(cfg), "cpu", seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (4, 2)]  # two lengths, one call
    end = int(M.generate(model, torch.tensor(prompts[:1]), 1)[0, -1])  # a token the model emits: some end
    seeds = grpo.reply_seeds(7, 2, 3)
    kw = dict(group=3, max_new_tokens=6, end_id=end, temperature=1.5)
    a, b = (grpo.rollout(model, prompts, seeds=seeds, **kw) for _ in range(2))
    assert all(torch.equal(x.ids, y.ids) and torch.equal(x.labels, y.labels) for x, y in zip(a, b))
    # each prompt's Rollout is the one a call for that prompt alone makes, to the bit
    for p, ro in enumerate(a):
        [alone] = grpo.rollout(model, prompts[p:p + 1], seeds=seeds[3 * p:3 * p + 3], **kw)
        assert torch.equal(ro.ids, alone.ids) and torch.equal(ro.labels, alone.labels), p
    for prompt, ro in zip(prompts, a):
        S = len(prompt)
        assert ro.ids.shape[0] == 3 and torch.equal(ro.ids[:, :S], torch.tensor(prompt).expand(3, S))
        replies = []
        for row, rep in zip(ro.ids.tolist(), ro.replies()):
            new = row[S:]
            want = new[:new.index(end) + 1] if end in new else new
            assert rep == want
            replies.append(rep)
        assert ro.ids.shape[1] == S + max(map(len, replies))  # cut after the longest reply
        logp = grpo.token_logps(model, ro.ids[:, :-1], ro.labels)
        assert ((logp < 0) == (ro.labels != -100)).all()
    ends = [end in r for ro in a for r in ro.replies()]
    assert any(ends) and not all(ends)  # some replies end, some run to the limit
    assert grpo.arithmetic_reward(" 12 ", "12") == 1.0 and grpo.arithmetic_reward("13", "12") == 0.0
    assert grpo.load_verifier("grpo:arithmetic_reward") is grpo.arithmetic_reward
    with pytest.raises(ValueError, match="package.module:function"):
        grpo.load_verifier("grpo")
    with pytest.raises(ValueError, match="no_such"):
        grpo.load_verifier("grpo:no_such")


def test_rollout_chunks(monkeypatch):
    """max_rows: every chunking (a group a call, two, all at once) gives the same Rollouts to the bit.
    Each call's KV cache, its tensors' bytes after the call, equals cache_bytes of the call's rows and
    positions (its longest prompt + 12), so a cap of N rows bounds it by cache_bytes(N, --seq-len)."""
    cfg = M.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                        initializer_range=0.3)
    model = W.materialize(M.build(cfg), "cpu", seed=0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 5, 3)]
    kw = dict(group=3, max_new_tokens=12, end_id=49, temperature=1.0, seeds=grpo.reply_seeds(3, 6, 3))
    caches, real = [], M.KVCache.__init__

    def made(self, *a, **k):
        real(self, *a, **k)
        caches.append(self)
    monkeypatch.setattr(M.KVCache, "__init__", made)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small GEMMs: threads only contend on the shared 2-core machine
    try:
        want = grpo.rollout(model, prompts, max_rows=18, **kw)
        for rows in (6, 3):
            caches.clear()
            got = grpo.rollout(model, prompts, max_rows=rows, **kw)
            assert all(torch.equal(x.ids, y.ids) and torch.equal(x.labels, y.labels) for x, y in zip(got, want))
            per = rows // 3  # prompts a call
            longest = [max(map(len, prompts[c:c + per])) for c in range(0, 6, per)]
            held = [sum(t.nbytes for lc in c.layers.values() for t in (lc.k, lc.v)) for c in caches]
            assert held == [grpo.cache_bytes(model, rows, n + 12) for n in longest], rows
    finally:
        torch.set_num_threads(threads)
    assert grpo.cache_bytes(model, 1, 1) == 2 * 4 * 32 * 4  # k and v · 4 layers · nkv·hd · fp32
    assert grpo.rollout_rows(model, 3, 21, budget=grpo.cache_bytes(model, 7, 21)) == 6  # whole groups
    assert grpo.rollout_rows(model, 3, 21, budget=1) == 3 and grpo.rollout_rows(model, 3, 21, cap=9) == 9


def _grpo_step(model: M.Llama, ro: "grpo.Rollout", adv: torch.Tensor) -> tuple[float, dict]:
    """One GRPO loss on fixed rollouts (old = the policy's own detached log-probs, a KL to a
    perturbed reference) and the gradients of the replicated parameters (the norms)."""
    logp = grpo.token_logps(model, ro.ids[:, :-1], ro.labels)
    mask = ro.labels != -100
    loss, _ = grpo.grpo_loss(logp, logp.detach() + 0.05 * mask, adv, mask, total_tokens=int(mask.sum()),
                             kl_beta=0.1, ref_logp=logp.detach() - 0.1)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n}


def _tp_grpo(rank: int, world: int, hf_dir: str, ro: "grpo.Rollout", adv: torch.Tensor) -> tuple:
    import tp as T
    model = M.build(W.load_config(hf_dir))
    W.materialize(model, "cpu", hf_dir=hf_dir, shards=T.apply_tp(model, None))
    return _grpo_step(model, ro, adv)


def test_tp2_equals_single_process_on_fixed_rollouts(tmp_path):
    cfg = M.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        initializer_range=0.3)
    model = W.materialize(M.build(cfg), "cpu", seed=0)
    W.save_hf(model.state_dict(), cfg, tmp_path)
    prompts = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(1)).tolist()
    ros = grpo.rollout(model, prompts, group=3, max_new_tokens=6, end_id=-1, seeds=grpo.reply_seeds(7, 2, 3),
                       temperature=1.5)  # no end: every reply 6 tokens, one width
    ro = grpo.Rollout(torch.cat([r.ids for r in ros]), torch.cat([r.labels for r in ros]))
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])).flatten()
    want_loss, want_grads = _grpo_step(model, ro, adv)
    assert want_loss != 0 and len(want_grads) == 5 and all(g.abs().max() > 0 for g in want_grads.values())
    for loss, grads in run_ranks(_tp_grpo, 2, str(tmp_path), ro, adv):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for n, g in want_grads.items():
            assert (grads[n] - g).abs().max() <= 1e-5 * g.abs().max(), n


# ------------------------------------------------------------------------------ the trainer (train.py --grpo)
def char_reward(reply: str, gold: str) -> float:
    """A verifier by import path that scores a random model's replies unevenly (groups differ)."""
    return float(sum(map(ord, reply)) % 3)


def test_flags_refused(tmp_path, capsys):
    import cli
    import grid as G
    import train

    def errors(*argv: str) -> str:
        grid = G.Grid(rank=0, world=2, device=torch.device("cpu"))
        return "\n".join(cli.validate(cli.parse_args(["--seq-len", "32", *argv]), M.PRESETS["tiny"], grid))
    assert errors("--grpo") == ""
    assert "choose one" in errors("--grpo", "--sft") and "choose one" in errors("--grpo", "--dpo")
    assert "--zero 3 with --grpo" in errors("--grpo", "--zero", "3")
    assert "--pp with --grpo" in errors("--grpo", "--pp", "2")
    assert "--cp with --grpo" in errors("--grpo", "--cp", "2")
    assert "--sp with --grpo" in errors("--grpo", "--tp", "2", "--sp")
    assert "--grpo-group must be >= 2" in errors("--grpo", "--grpo-group", "1")
    assert "--grpo-kl must be >= 0" in errors("--grpo", "--grpo-kl", "-1")
    assert "--grpo-clip must be > 0" in errors("--grpo", "--grpo-clip", "0")
    assert "--grpo-updates must be >= 1" in errors("--grpo", "--grpo-updates", "0")
    assert "--verifier: " in errors("--grpo", "--verifier", "grpo:nope")
    assert "go with --grpo" in errors("--grpo-group", "4")
    # --resume: a checkpoint of another training (--sft, --dpo, --grpo) is refused before any heavy
    # work: its saved sampler position counts other rows (meta.json is all plan_resume reads)
    ck = tmp_path / "step_00000002"
    ck.mkdir()
    saved = vars(cli.parse_args(["--sft", "--steps", "4"]))
    (ck / "meta.json").write_text(json.dumps({"step": 2, "extra": {"args": saved}}))
    for argv, changed in ((["--grpo"], ("--grpo True", "--sft False")), (["--dpo"], ("--dpo True",))):
        with pytest.raises(SystemExit):
            train.plan_resume(cli.parse_args([*argv, "--steps", "4", "--resume", str(ck)]),
                              G.Grid(rank=0, world=1, device=torch.device("cpu")))
        err = capsys.readouterr().err
        for flag in changed:
            assert f"{flag} (checkpoint: " in err and "the rows change" in err, err


ROLLOUTS: dict = {}  # (prompt ids, its G seeds) → its Rollout: the single process's samples, replayed


def _replay(real):
    """grpo.rollout, recording each prompt's replies the first time and replaying them after: a
    layout that batches the prompts otherwise (a dp rank holds only some) gets the same replies."""
    def rollout(model, prompts, group, max_new_tokens, end_id, seeds, **kw):
        keys = [(tuple(p), tuple(seeds[i * group:(i + 1) * group])) for i, p in enumerate(prompts)]
        if any(k not in ROLLOUTS for k in keys):
            ROLLOUTS.update(zip(keys, real(model, prompts, group, max_new_tokens, end_id, seeds, **kw)))
            ROLLOUTS["generated"] = ROLLOUTS.get("generated", 0) + len(keys)
        return [ROLLOUTS[k] for k in keys]
    return rollout


def trainer_argv(tmp_path, name: str, *extra: str) -> list[str]:
    """train.main --grpo on a tiny random model (its save_pretrained folder) and 6 prompts, written to
    tmp_path the first time: 4 prompts a step, G 4, KL 0.1 to the initial weights, lr 1e-2 constant,
    the uneven char_reward; the metrics and the export named after the run."""
    if not (tmp_path / "init").exists():
        cfg = M.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            initializer_range=0.3)
        W.save_hf(W.materialize(M.build(cfg), "cpu", seed=0).state_dict(), cfg, tmp_path / "init")
        (tmp_path / "prompts.jsonl").write_text("".join(
            json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2)]))
    return ["--grpo", "--init-from", str(tmp_path / "init"), "--data", str(tmp_path / "prompts.jsonl"),
            "--seq-len", "48", "--batch-size", "4", "--lr", "1e-2", "--warmup", "0", "--grpo-group", "4",
            "--grpo-max-new", "5", "--grpo-kl", "0.1", "--verifier", "test_grpo:char_reward",
            "--log-every", "100", "--metrics", str(tmp_path / f"{name}.jsonl"),
            "--export-hf", str(tmp_path / name), *extra]


def _grpo_main(rank: int, world: int, argv: list[str]) -> dict:
    import train
    train.main(argv)
    return ROLLOUTS


def test_trainer_layouts_equal_single_process_on_fixed_rollouts(tmp_path, monkeypatch):
    """train.main --grpo, 3 steps of 2 updates each (--grpo-updates 2): the single process samples
    (the rollouts recorded); tp2, dp2·zero1 and dp2·zero2 replay the same replies. Every step's loss,
    reward log and the updated parameters within 1e-5 relative (fp32; tp and dp reorder sums; the
    parameters in norm, see below). KL to the initial weights is on; the clip acts."""
    monkeypatch.setattr(grpo, "rollout", _replay(grpo.rollout))
    ROLLOUTS.clear()

    def run(name: str, world: int, *extra: str) -> tuple[list[dict], dict]:
        # --seed 1: rollouts whose second updates stay well conditioned. With some draws (--seed 0)
        # the first update moves the policy so far that the KL term's gradient reaches a norm of 950,
        # and tp's reordered sums then differ by 1.4e-5 in the next loss
        argv = trainer_argv(tmp_path, name, "--steps", "3", "--grpo-updates", "2", "--seed", "1", *extra)
        got = run_ranks(_grpo_main, world, argv)[0]
        ROLLOUTS.update(got)
        records = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return records, W.load_hf(tmp_path / name).state_dict()

    want, want_params = run("single", 1)
    longest = max(ro.labels.shape[1] for k, ro in ROLLOUTS.items() if k != "generated")
    # 4 prompts × 4 replies a step, padded to the step's longest row: 16 rows, never the --seq-len of
    # 48, trained twice
    assert all(r["positions"] % 32 == 0 and r["positions"] <= 32 * longest < 32 * 48 for r in want)
    assert all(r["row_len"] == r["positions"] / 32 for r in want)  # MFU's attention FLOPs: at this length
    generated = ROLLOUTS.pop("generated")
    assert generated == 12 and len(want) == 3  # 4 prompts × 3 steps, each sampled once
    assert all(r["reward_std"] > 0 and r["loss"] != 0 for r in want)
    start = W.load_hf(tmp_path / "init").state_dict()
    assert all((want_params[n] - start[n]).abs().max() > 1e-4 for n in start)  # the steps moved every tensor
    # each step's second update: the policy has left the reference and the sampling policy
    assert all(r["kl"] > 0 and r["clip_fraction"] > 0 for r in want)
    for name, world, extra in (("tp2", 2, ["--tp", "2"]), ("dp2-zero1", 2, ["--zero", "1"]),
                               ("dp2-zero2", 2, ["--zero", "2"])):
        got, params = run(name, world, *extra)
        assert "generated" not in ROLLOUTS, name  # every rollout replayed, none sampled anew
        for g, w in zip(got, want):
            for k in ("loss", "reward_mean", "reward_std", "accuracy", "reply_len", "kl", "clip_fraction"):
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (name, k)
            # the positions trained (tokens/s counts them): tp's ranks hold the same rows; a dp rank
            # pads its half to its own longest reply, never longer than the whole step's
            assert g["positions"] == w["positions"] if name == "tp2" else g["positions"] <= w["positions"]
            assert g["row_len"] == w["row_len"] if name == "tp2" else g["row_len"] <= w["row_len"]
        assert [r["tokens"] for r in got] == list(itertools.accumulate(r["positions"] for r in got))
        for n, w in want_params.items():  # in norm: AdamW turns round-off in a near-zero gradient
            # into an update of about ±lr on that element (m/√v ≈ sign g), so a few elements differ by
            # ~1e-4 at lr 1e-2 while a wrong gradient would move every element by ~lr
            assert (params[n] - w).norm() <= 1e-5 * w.norm(), (name, n)


def test_resume_keeps_the_kl_reference(tmp_path):
    """--grpo-kl 0.1 at dp2·ZeRO-1, saved at step 2 and resumed: steps 3-4's loss and KL equal the
    uninterrupted run's within 1e-5. The KL reference is the --init-from policy, cloned from complete
    parameters (not the resumed policy, nor a shard new on this rank and stale on the other)."""
    ck = tmp_path / "ck"
    run_ranks(_grpo_main, 2, trainer_argv(tmp_path, "straight", "--steps", "4", "--zero", "1",
                                          "--save", str(ck), "--save-every", "2"))
    run_ranks(_grpo_main, 2, trainer_argv(tmp_path, "resumed", "--steps", "4", "--zero", "1",
                                          "--resume", str(ck / "step_00000002")))
    read = lambda name: [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]  # noqa: E731
    want, got = read("straight")[2:], read("resumed")
    assert [r["step"] for r in got] == [3, 4] and all(r["kl"] > 1e-6 for r in want)
    for k in ("loss", "kl", "reward_mean"):
        assert [r[k] for r in got] == pytest.approx([r[k] for r in want], rel=1e-5, abs=1e-7), k


def raises_on_rank_1(reply: str, gold: str) -> float:
    """A verifier with a bug that only one rank's replies reach."""
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise KeyError("no such answer")
    return 1.0


def nan_reward(reply: str, gold: str) -> float:
    return math.nan


def text_reward(reply: str, gold: str) -> str:
    return "correct"


def _status(rank: int, world: int, argv: list[str]) -> int:
    import train
    try:
        train.main(argv)
        return 0
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("verifier,world,said", [
    ("raises_on_rank_1", 2, "raised KeyError: 'no such answer' on the reply"),
    ("nan_reward", 1, "returned NaN on the reply"),
    ("text_reward", 1, "returned 'correct' (str), not a number on the reply")])
def test_failing_verifier_stops_every_rank(tmp_path, capfd, verifier, world, said):
    """A verifier that raises on one rank of two, returns NaN or returns a string: every rank
    exits with status 2 within 60 s (no rank left waiting in a collective). Rank 0's one message
    names the verifier, the failure and the reply."""
    t0 = time.time()
    argv = trainer_argv(tmp_path, verifier, "--steps", "2", "--verifier", f"test_grpo:{verifier}")
    assert run_ranks(_status, world, argv, timeout=60) == [2] * world
    assert time.time() - t0 < 60
    err = capfd.readouterr().err
    assert f"error: {'rank 1: ' if world == 2 else ''}--verifier test_grpo:{verifier} {said}" in err, err


def test_updates_reuse_the_rollout(tmp_path, monkeypatch):
    """--grpo-updates 2: one step, two AdamW updates on one rollout batch. The same two written out
    here from the recorded batch (ids, labels, advantages): the old log-probs the initial model's
    (the rollout policy's in both updates, never the policy's of the moment), grpo_loss over the
    step's reply tokens with the KL to the initial model, torch.optim.AdamW (no decay, no clipping).
    The logged loss, KL and clip fraction (the updates' means) within 1e-5, the exported parameters
    within 1e-5 relative in norm (why in norm: the layout test above). The first update's ratio is 1;
    the second's leaves [1 − ε, 1 + ε] on some tokens, so the clip acts: old log-probs taken anew
    before each update would make both ratios 1 and fail the comparison."""
    recorded: list = []
    real = grpo.Trainer.batch
    monkeypatch.setattr(grpo.Trainer, "batch", lambda self, *a: recorded.append(real(self, *a)) or recorded[-1])
    argv = trainer_argv(tmp_path, "mu2", "--steps", "1", "--grpo-updates", "2", "--grpo-clip", "0.05",
                        "--weight-decay", "0", "--clip", "0")
    [[micro]] = run_ranks(lambda rank, world: (_grpo_main(rank, world, argv), recorded)[1], 1)
    [log] = [json.loads(x) for x in (tmp_path / "mu2.jsonl").read_text().splitlines()]

    model = W.load_hf(tmp_path / "init")
    ids, labels, adv = (torch.cat([mb[k] for mb in micro]) for k in ("input_ids", "labels", "grpo_adv"))
    mask = labels != -100
    with torch.no_grad():
        old = grpo.token_logps(model, ids, labels)  # the rollout policy: the initial model
    assert_close(torch.cat([mb["grpo_old"] for mb in micro]), old)
    assert_close(torch.cat([mb["grpo_ref"] for mb in micro]), old)  # the KL's reference: the same model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    stats = []
    for _ in range(2):
        loss, s = grpo.grpo_loss(grpo.token_logps(model, ids, labels), old, adv, mask, int(mask.sum()),
                                 clip_eps=0.05, kl_beta=0.1, ref_logp=old)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats.append((loss.item(), s.kl.item(), s.clip_fraction.item()))
    assert stats[0][2] == 0 and stats[1][2] > 0 and stats[1][1] > 0  # update 2: the ratio moved, the clip acts
    for key, want in zip(("loss", "kl", "clip_fraction"), (sum(x) / 2 for x in zip(*stats))):
        assert log[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    got = W.load_hf(tmp_path / "mu2").state_dict()
    for n, w in model.state_dict().items():
        assert (got[n] - w).norm() <= 1e-5 * w.norm(), n


def expected_reward(model: torch.nn.Module, prompts: list[list[int]], golds: list[list[int]]) -> float:
    """The mean over prompts of P(reply = gold, then the end token) at temperature 1: the expected
    exact-match reward of a sampled reply, exactly (no sampling noise)."""
    total = 0.0
    for p, g in zip(prompts, golds):
        ids = torch.tensor([p + g])  # (1, S)
        labels = ids[:, 1:].clone()  # (1, S - 1)
        labels[:, :len(p) - 1] = -100
        total += grpo.token_logps(model, ids[:, :-1], labels).sum().exp().item()
    return total / len(prompts)


@pytest.fixture(scope="module")
def start200() -> tuple[torch.nn.Module, list]:
    """test_sft's tiny model after 200 SFT steps on single-digit addition (1 thread: deterministic),
    and its 20 held-out chats: a partly trained start, built once for the tests below."""
    from test_sft import addition_start
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and the 2-core machine is shared
    try:
        return addition_start(200)
    finally:
        torch.set_num_threads(threads)


def test_short_run_raises_the_arithmetic_reward(tmp_path, start200):
    """From a fixed, partly trained start (test_sft's tiny model after 200 SFT steps on single-digit
    addition), 10 steps of train.main --grpo with the exact-match verifier on 8 training questions
    (all 8 in every step, G = 8) raise the expected reward on those questions, computed exactly (the
    probability of the gold reply, no sampling noise). lr 0 would leave it as it was to the last
    bit; the margin is half the measured gain (1 thread, deterministic)."""
    import json
    import sft
    from test_sft import TOK
    from feed import evaluate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and the 2-core machine is shared
    try:
        start, held_out = start200
        W.save_hf(start.state_dict(), start.config, tmp_path / "start")
        held = {tuple(map(int, re.findall(r"\d+", next(t["content"] for t in c if t["role"] == "user"))))
                for c in held_out}
        questions = [(f"What is {a} + {b}?", str(a + b)) for a in range(10) for b in range(10)
                     if (a, b) not in held]
        assert len(questions) == 100 - len(held)  # the held-out ones are excluded
        questions = questions[::10]  # 8 of them: each in every step's batch
        (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": g}) + "\n"
                                                        for q, g in questions))
        tpl = sft.chat_template(TOK)
        prompts = [tpl.render([{"role": "user", "content": q}], True) for q, _ in questions]
        golds = [TOK.encode(g) + [tpl.end_id] for _, g in questions]
        chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": g}] for q, g in questions]
        argv = ["--grpo", "--init-from", str(tmp_path / "start"), "--data", str(tmp_path / "prompts.jsonl"),
                "--seq-len", "64", "--batch-size", "8", "--steps", "10", "--lr", "1e-3", "--warmup", "2",
                "--grpo-group", "8", "--grpo-max-new", "4", "--log-every", "100",
                "--metrics", str(tmp_path / "m.jsonl"), "--export-hf", str(tmp_path / "out")]
        run_ranks(_grpo_main, 1, argv)
        end = W.load_hf(tmp_path / "out")
        before, after = expected_reward(start, prompts, golds), expected_reward(end, prompts, golds)
        greedy = evaluate(start, TOK, chats, max_new_tokens=4), evaluate(end, TOK, chats, max_new_tokens=4)
    finally:
        torch.set_num_threads(threads)
    rewards = [json.loads(x)["reward_mean"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    print(f"expected reward {before:.4f} -> {after:.4f}; greedy exact match {greedy}; sampled {rewards}")
    # measured: 0.258 -> 0.359 (greedy 4/8 -> 6/8); lr 0 would leave 0.258 exactly, lr 3e-3 overshoots
    # (0.291): the margin asks for half the measured gain
    assert after >= before + 0.05, (before, after)


def test_builtin_eval_before_and_after(tmp_path, monkeypatch, capfd, start200):
    """--grpo on the built-in questions evaluates the held-out ones before step 1 (step 0 in the
    metrics) and after the last step: greedy, and sampled as GRPO samples (its temperature, G draws a
    question, seeded by --seed). Against feed.evaluate on the starting model; at lr 0 the end is the
    start, so both evals repeat. The start is partly trained: neither number is 0 or 1. At dp2 each
    rank decodes half the answers, and the all-reduced shares give the same numbers."""
    import sft
    from test_sft import TOK
    from feed import evaluate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and the 2-core machine is shared
    try:
        start, _ = start200
        W.save_hf(start.state_dict(), start.config, tmp_path / "start")
        held_out = sft.held_out_phrasings(n_eval=20, max_operands=(9, 9))[::5]  # the start's task
        monkeypatch.setattr(sft, "held_out_phrasings", lambda **kw: held_out)
        argv = ["--grpo", "--init-from", str(tmp_path / "start"), "--seq-len", "96", "--batch-size", "2",
                "--steps", "2", "--lr", "0", "--grpo-group", "4", "--grpo-max-new", "4",
                "--grpo-temperature", "0.8", "--seed", "3", "--metrics", str(tmp_path / "m.jsonl")]
        run_ranks(_grpo_main, 1, argv)
        run_ranks(_grpo_main, 2, [*argv[:-1], str(tmp_path / "dp2.jsonl")])  # the eval sharded over dp
        greedy = evaluate(start, TOK, held_out, max_new_tokens=8)
        sampled = evaluate(start, TOK, held_out, max_new_tokens=8, temperature=0.8, samples=4, seed=3)
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_exact_match"], r["eval_sampled"]) for r in records if "eval_sampled" in r]
    assert evals == [(0, greedy, sampled), (2, greedy, sampled)] and 0 < sampled < 1 and 0 < greedy < 1, evals
    dp2 = [json.loads(x) for x in (tmp_path / "dp2.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval_exact_match"], r["eval_sampled"]) for r in dp2 if "eval_sampled" in r] == [
        (s, pytest.approx(g, abs=1e-12), pytest.approx(x, abs=1e-12)) for s, g, x in evals]
    assert "eval step 0: held-out exact match" in capfd.readouterr().out


def test_heldout_comparison_against_transformers(tmp_path, start200, capsys):
    """bench.bench_heldout on two exports (the partly trained start, and a copy with its lm_head
    shifted): each question's expected reward against transformers' own model loaded from the
    export (softmax of its logits, float64, each prompt alone), its greedy exact match against
    feed.evaluate, and the paired line against the two lists (1e-5 relative: fp32 forwards)."""
    import copy

    import transformers as T

    import sft
    from bench import bench_heldout
    from feed import evaluate
    from test_sft import TOK
    start, _ = start200
    other = copy.deepcopy(start)
    with torch.no_grad():
        other.lm_head.weight.add_(0.05 * torch.randn(other.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    W.save_hf(start.state_dict(), start.config, tmp_path / "a")
    W.save_hf(other.state_dict(), other.config, tmp_path / "b")
    with pytest.raises(SystemExit):  # argparse's one message and exit status 2
        bench_heldout.main([str(tmp_path / "a"), "--questions", "0"])
    got = bench_heldout.main([str(tmp_path / "a"), str(tmp_path / "b"), "--questions", "3"])
    tpl = sft.chat_template(TOK)
    chats = sft.held_out_phrasings()[:3 * bench_heldout.PHRASINGS]
    blocks = [chats[i:i + bench_heldout.PHRASINGS] for i in range(0, len(chats), bench_heldout.PHRASINGS)]
    for d, model in (("a", start), ("b", other)):
        greedy, reward = got[str(tmp_path / d)]
        assert greedy == [evaluate(model, TOK, b, template=tpl) for b in blocks]
        hf = T.LlamaForCausalLM.from_pretrained(tmp_path / d).double().eval()
        want = []
        for b in blocks:
            ps = []
            for c in b:
                prompt, gold = tpl.render(c[:-1], True), TOK.encode(c[-1]["content"]) + [tpl.end_id]
                with torch.no_grad():
                    logp = hf(torch.tensor([prompt + gold])).logits[0].log_softmax(-1)  # (S, V)
                ps.append(sum(logp[len(prompt) - 1 + k, t] for k, t in enumerate(gold)).exp().item())
            want.append(sum(ps) / len(ps))
        assert torch.allclose(torch.tensor(reward, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                              rtol=1e-5, atol=0)
    (ga, ra), (gb, rb) = got.values()
    assert min(ra) > 0 and ra != rb  # the start answers some; the copy differs
    out = capsys.readouterr().out
    assert f"expected reward, paired: {bench_heldout.paired(ra, rb)}" in out
    d = [y - x for x, y in zip(ra, rb)]
    assert bench_heldout.paired(ra, rb).startswith(f"{sum(d) / len(d):+.4f}")


def test_builtin_questions_are_the_sft_demo_split():
    """Whatever --seed, --grpo's built-in prompts are training questions of the SFT demo's split
    (sft.arithmetic_chats' defaults) and its eval asks exactly the demo's held-out ones: a GRPO run
    after `train.py --sft` never trains on a question its eval counts as held out."""
    import types

    import cli
    import sft
    from test_sft import TOK
    question = lambda text: tuple(re.findall(r"(\d+) \+ (\d+)", text)[-1])  # noqa: E731
    held_out = {question(next(t["content"] for t in c if t["role"] == "user")) for c in sft.arithmetic_chats()[1]}
    for seed in (0, 3):
        ds, _, eval_set = grpo.load(cli.parse_args(["--grpo", "--init-from", "x", "--seed", str(seed)]),
                                    types.SimpleNamespace(rank=1))
        trained = {question(TOK.decode(p)) for p in ds.prompts}
        assert len(trained) > 800 and not trained & held_out
        assert {question(c[-2]["content"]) for c in eval_set} == held_out
