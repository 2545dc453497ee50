"""Expert parallelism through train.py (--ep): every layout equal to the single process.

Reference: one process on the same save_pretrained directory (a tiny Qwen3-MoE: 4 experts, k = 2, a
dense layer among the sparse ones, output_router_logits on so the load-balancing loss weighs), the
same seed, data and global batch. The aux loss is per forward (docs/moe.md), so every run holds
one row per forward: the reference at --micro-batches 4, the 4-rank layouts at 1 row per rank.
- ep2 (2 experts a rank, each expert on 2 ranks), ep4 (1 a rank, no replica), ep2 · ZeRO-1,
  ep4 · ZeRO-3 · full AC, and ep4 · ZeRO-2 as it resumes (below): the loss and grad-norm curves
  within 1e-5 relative (fp32). The grad norm is the sharp check: AdamW is nearly blind to a
  wrong gradient scale, the norm is not. Reducing the expert gradients over all of dp fails
  both (docs/moe.md: by how much).
- The checkpoint of the ep2 run holds each expert tensor as boxes of the global (E, ...) tensor,
  written by one rank of each replica group; it resumes at ep1 and at ep4 (both under ZeRO-2),
  the resumed steps within 1e-5 of the reference's, and at ep2 bit for bit.
- The exports of the ep2 run and of the ep4 · ZeRO-3 run: save_pretrained's per-expert keys, the
  reference export's values within 1e-4 (AdamW moves an element whose gradient is at rounding
  level by up to lr: measured 1.1e-5, a dense tensor's too; a misplaced expert block would be
  O(1)). AutoModelForCausalLM loads the ep2 export holding the trained weights bit for bit (the
  run's last checkpoint, its experts from both ep ranks), so its logits are the trained model's;
  ours on the export within 1e-5 of them.
- The reader gives an ep rank its rows of every expert tensor, from the seeded init and from the
  files, reading only its experts' per-expert tensors.
- --ep's refusals, all at once, before any heavy work.
All 4-rank runs share one launch (train.main after train.main, a fresh process group each).
"""
import json

import torch
import torch.distributed as dist
import transformers as T
from safetensors import safe_open

import cli
import data
import grid as G
import model as M
import train
import weights as W
from dist import reinit, run_ranks
from test_model import assert_close
from test_moe_models import hf_model
from test_train import _main, assert_curve, losses

STEPS = 4


def grad_norms(path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in path.read_text().splitlines()]


def _mains(rank: int, world: int, runs: list[list[str]]) -> None:
    """train.main for each argv in turn; each run destroys its process group, the next makes one."""
    for argv in runs:
        if not dist.is_initialized():
            reinit()
        train.main(argv)


def test_ep_layouts_resume_and_export_equal_single_process(tmp_path):
    hf_model("qwen3_moe", vocab=260, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=4).save_pretrained(tmp_path / "init")
    (tmp_path / "corpus.txt").write_text(open(__file__, encoding="utf-8").read() * 6)
    data.prepare(tmp_path / "corpus.txt", tmp_path / "data")

    def argv(name: str, *extra: str) -> list[str]:
        return ["--init-from", str(tmp_path / "init"), "--data", str(tmp_path / "data"), "--steps", str(STEPS),
                "--seq-len", "16", "--batch-size", "4", "--lr", "3e-3", "--warmup", "1",
                "--metrics", str(tmp_path / f"{name}.jsonl"), *extra]
    run_ranks(_main, 1, argv("ref", "--micro-batches", "4", "--export-hf", str(tmp_path / "export_ref")))
    want, norms = losses(tmp_path / "ref.jsonl"), grad_norms(tmp_path / "ref.jsonl")
    assert want[-1] < want[0] - 0.05  # the curve moves: comparing it is not vacuous
    saved = tmp_path / "ckpt" / "step_00000002"
    layouts = {  # name: flags (4 ranks: 1 row per rank and forward)
        "ep2": ["--ep", "2", "--save", str(tmp_path / "ckpt"), "--save-every", "2", "--keep", "2",
                "--export-hf", str(tmp_path / "export_ep2")],
        "ep4": ["--ep", "4"],
        "ep2_zero1": ["--ep", "2", "--zero", "1"],
        "ep4_zero3_ac": ["--ep", "4", "--zero", "3", "--ac-mode", "full", "--export-hf", str(tmp_path / "export_z3")],
        "resume_ep1": ["--resume", str(saved), "--zero", "2"],
        "resume_ep4": ["--ep", "4", "--resume", str(saved), "--zero", "2"],
        "resume_ep2": ["--ep", "2", "--resume", str(saved)],
    }
    run_ranks(_mains, 4, [argv(name, *flags) for name, flags in layouts.items()], timeout=240)
    for name in layouts:
        done = slice(2 if name.startswith("resume") else 0, None)  # a resumed run logs steps 3-4
        assert_curve(losses(tmp_path / f"{name}.jsonl"), want[done])
        assert_curve(grad_norms(tmp_path / f"{name}.jsonl"), norms[done])  # AdamW hides a wrong scale; the norm not
    for read in (losses, grad_norms):  # the same layout resumes bit for bit
        assert read(tmp_path / "resume_ep2.jsonl") == read(tmp_path / "ep2.jsonl")[2:]

    # the checkpoint: each expert tensor as two boxes of the global (4, ...) tensor, by ranks 0 and 1
    entries = {r: json.loads((saved / f"rank{r:05d}.json").read_text())["entries"] for r in range(4)}
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    boxes = {r: e["shard"] for r, es in entries.items() for e in es if e["name"] == experts}
    assert boxes == {0: [0, 0, 2], 1: [0, 2, 2]}
    assert json.loads((saved / "meta.json").read_text())["shapes"][experts] == [4, 28, 32]

    # the export: transformers' keys, the reference's values, and transformers' logits on it ours
    out, ref = tmp_path / "export_ep2", tmp_path / "export_ref"
    for got in (out, tmp_path / "export_z3"):  # ep2 at stage 0; ep4 under ZeRO-3 (units gathered)
        with safe_open(got / "model.safetensors", "pt") as f, safe_open(ref / "model.safetensors", "pt") as g, \
                safe_open(tmp_path / "init" / "model.safetensors", "pt") as h:
            assert set(f.keys()) == set(g.keys()) == set(h.keys())
            assert any(".experts.3." in k for k in f.keys())
            for k in f.keys():  # 1e-4: after 4 AdamW steps an element whose gradient is at rounding
                assert_close(f.get_tensor(k), g.get_tensor(k), 1e-4)  # level moves up to lr (1.1e-5 measured)
    back = T.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    trained = saved_masters(saved.with_name("step_00000004"))  # the ep2 run's last step, from its ranks
    assert back.state_dict().keys() == trained.keys()
    for k, t in back.state_dict().items():  # transformers holds exactly the trained weights
        assert torch.equal(t, trained[k]), k
    ids = torch.randint(0, 260, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(W.load_hf(out)(ids), back(ids, use_cache=False).logits)


def saved_masters(ckpt) -> dict[str, torch.Tensor]:
    """A stage-0 checkpoint's fp32 masters as whole tensors, each rank's slices put in their boxes."""
    shapes = json.loads((ckpt / "meta.json").read_text())["shapes"]
    out = {k: torch.full(v, float("nan")) for k, v in shapes.items()}
    for index in ckpt.glob("rank*.json"):
        entries = json.loads(index.read_text())["entries"]
        if entries:
            with safe_open(index.with_suffix(".safetensors"), "pt") as f:
                for e in entries:
                    dim, start, size = e["shard"] or (0, 0, shapes[e["name"]][0])
                    box = out[e["name"]].narrow(dim, start, size)
                    box.copy_(f.get_tensor(e["name"] + "/master").view(e["local_shape"]))
    assert not any(t.isnan().any() for t in out.values())  # every element written
    return out


def test_reader_gives_each_rank_its_experts(tmp_path, monkeypatch):
    """ep rank 1 of 2 gets rows [2, 4) of every expert tensor, the seeded init's and --init-from's,
    and reads from the files only the per-expert tensors of experts 2 and 3."""
    hf_model("qwen3_moe", num_experts=4).save_pretrained(tmp_path)
    cfg = W.load_config(tmp_path)
    name = "model.layers.2.mlp.experts.gate_up_proj"
    whole, mine = M.build(cfg), train.MOE.shard_experts(M.build(cfg), train.MOE.EPGroups(None, None, 2, 1))
    shards = {name: train.TP.Shard(0, 2, 2)}
    read_files = []
    block = W.SafetensorsDir.block
    monkeypatch.setattr(W.SafetensorsDir, "block", lambda self, n, *a: read_files.append(n) or block(self, n, *a))
    for src in (dict(seed=3), dict(hf_dir=str(tmp_path))):
        full = W.param_reader(whole, **src)(name, 0, whole.get_parameter(name).numel()).view(4, -1)
        read_files.clear()
        part = W.param_reader(mine, shards=shards, **src)(name, 0, mine.get_parameter(name).numel())
        assert torch.equal(part.view(2, -1), full[2:])
    assert sorted(read_files) == sorted(f"model.layers.2.mlp.experts.{e}.{p}.weight"
                                        for e in (2, 3) for p in ("gate_proj", "up_proj"))


def test_ep_refusals_all_at_once():
    moe = M.LlamaConfig.from_hf(hf_model("qwen3_moe", num_experts=4).config.to_dict())
    grid = G.Grid(rank=0, world=4, device=torch.device("cpu"))
    errors = cli.validate(cli.parse_args(["--ep", "3", "--seq-len", "16"]), moe, grid)
    assert any("--ep 3 must divide num_experts=4" in e for e in errors), errors
    assert any("--ep 3 must divide the 4 dp·cp ranks" in e for e in errors), errors
    assert any("--ep 2 with --grpo" in e for e in cli.validate(cli.parse_args(["--ep", "2", "--grpo"]), moe, grid))
    errors = cli.validate(cli.parse_args(["--ep", "2", "--pp", "4", "--seq-len", "16"]), moe, grid)
    assert any("--ep 2 must divide the 1 dp·cp ranks" in e for e in errors), errors
    dense = M.PRESETS["tiny"]
    assert any("--ep 2 needs a mixture-of-experts model" in e
               for e in cli.validate(cli.parse_args(["--ep", "2", "--seq-len", "16"]), dense, grid))
    assert not cli.validate(cli.parse_args(["--ep", "4", "--zero", "3", "--seq-len", "16"]), moe, grid)
