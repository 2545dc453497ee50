"""HF export: streaming from every layout, owning its folder, the tokenizer, the README's use of it.

References: the --init-from safetensors themselves (an untrained export must equal them bit for bit:
the fp32 values are only moved), transformers (AutoTokenizer, LlamaForCausalLM, generate) for what
the export is for, data.ByteTokenizer for the tokenizer, and the files on disk.
"""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import cli
import data
import dp
import export as EX
import grid as G
import model as M
import sft
import train
import weights as W
import zero3 as Z3
from dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
CFG = M.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
TIED = M.LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
EXPORTED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    for name, cfg, seed in (("init", CFG, 3), ("init_tied", TIED, 4)):
        W.save_hf(dict(W.materialize(M.build(cfg), "cpu", seed=seed).named_parameters()), cfg, d / name)
    return d


def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


def _no_pickle(*a, **k):
    raise AssertionError("an object collective (pickle) was used")


def _export(rank: int, world: int, init: str, runs: list) -> list:
    """For each (flags, out, max_shard_bytes, patch): build train.py's model and optimizer for the
    flags (no training) and export it with export.export_hf; return per run the most ZeRO-3 units
    ever gathered at once while a tensor was written, or the error every rank raised."""
    for name in ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list"):
        setattr(dist, name, _no_pickle)
    results = []
    for flags, out, max_bytes, patch in runs:
        args = cli.parse_args(["--init-from", init, *flags])
        grid = G.setup()
        cfg = W.load_config(init)
        G.make_grid(grid, args.tp, args.pp)
        model, shards, reader = train.build_model(args, cfg, grid)
        opt = train.make_optimizer(args, model, shards, reader, grid)
        gathered, real = [0], EX._stage_tensors

        def watched(model, opt, *a):
            for t in real(model, opt, *a):
                if isinstance(opt, Z3.Zero3Optimizer):
                    full = sum(f.untyped_storage().nbytes() > 0 for f in opt.flat_params)
                    gathered[0] = max(gathered[0], full)
                yield t
        EX._stage_tensors = watched
        undo = patch(rank) if patch else None
        try:
            EX.export_hf(model, opt, shards, cfg, grid.at, out, grid.tp_group, grid.io_group,
                         data.ByteTokenizer(), max_bytes)
            results.append(gathered[0])
        except OSError as e:
            results.append(str(e))
        finally:
            EX._stage_tensors = real
            if undo:
                undo()
        opt.teardown()
    return results


def test_streaming_export_from_tp_pp_zero3_is_the_weights(dirs):
    """tp2·pp2·dp2 under ZeRO-3 and ZeRO-1: each stage's writer streams its own shards, at most one
    ZeRO-3 unit gathered at a time; the tensors equal --init-from's bit for bit; re-exporting with
    one shard per stage over the many-shard export leaves no stale shard."""
    out = dirs / "out8"
    layout = ["--tp", "2", "--pp", "2"]
    res = run_ranks(_export, 8, str(dirs / "init"), [(layout + ["--zero", "3"], str(out), 40_000, None)],
                    timeout=240)
    assert {r[0] for r in res} <= {0, 1} and max(r[0] for r in res) == 1  # dp rank 0: one unit at a time
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    want = tensors(dirs / "init")
    got = tensors(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())

    run_ranks(_export, 8, str(dirs / "init"), [(layout + ["--zero", "1"], str(out), 4 << 30, None)],
              timeout=240)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # one per stage
    assert sorted(os.listdir(out)) == sorted(EXPORTED + shards + ["model.safetensors.index.json"])
    got = tensors(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not (dirs / "out8.tmp").exists() and not (dirs / "out8.old").exists()


def _full_disk_on_rank_2(rank: int):
    """Rank 2 (pipeline stage 1's writer) writes its shard to /dev/full: the kernel's ENOSPC."""
    if rank != 2:
        return None
    real = W.write_safetensors

    def write(path, *a, **k):
        os.symlink("/dev/full", path)
        return real(path, *a, **k)
    W.write_safetensors = write
    return lambda: setattr(W, "write_safetensors", real)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_tied_pp_zero3_export_and_a_full_disk(dirs):
    """pp2·dp2, tied embedding across the stages, ZeRO-3: the last stage's copy is not exported.
    Then a full disk on one writer: every rank raises the same message naming the file, the
    staging folder is gone and the previous export is intact."""
    out = dirs / "out_tied"
    flags = ["--pp", "2", "--zero", "3"]
    res = run_ranks(_export, 4, str(dirs / "init_tied"),
                    [(flags, str(out), 30_000, None), (flags, str(out), 30_000, _full_disk_on_rank_2)],
                    timeout=240)
    assert all(r[0] in (0, 1) for r in res)
    want, got = tensors(dirs / "init_tied"), tensors(out)
    assert "lm_head.weight" not in got and all(torch.equal(got[k], want[k]) for k in want)
    msgs = [r[1] for r in res]
    assert len(set(msgs)) == 1 and "rank 2: " in msgs[0] and "no space left on device" in msgs[0], msgs
    assert f"{out.resolve()}.tmp/model-" in msgs[0]
    assert not (dirs / "out_tied.tmp").exists()
    assert all(torch.equal(got[k], v) for k, v in tensors(out).items())


def test_export_owns_its_folder(dirs, tmp_path):
    """An export replaces its folder whole, so only a folder holding nothing but export files may be
    replaced; a crash mid-export leaves the previous export complete."""
    m = W.load_hf(dirs / "init")
    state = dict(m.named_parameters())
    out = tmp_path / "out"
    W.save_hf(state, CFG, out, max_shard_bytes=20_000)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    W.save_hf(state, CFG, out)  # one file now: the old index and shards are gone
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]

    real = W.write_safetensors

    def crash(path, *a, **k):
        raise KeyboardInterrupt
    W.write_safetensors = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            W.save_hf({k: v * 2 for k, v in state.items()}, CFG, out)
    finally:
        W.write_safetensors = real
    assert all(torch.equal(v, state[k]) for k, v in tensors(out).items())

    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds notes.txt, which an export .* would delete"):
        W.save_hf(state, CFG, out)
    assert W.export_problem(out / "config.json").endswith("is a file, not a folder")
    grid = G.Grid(rank=0, world=1, device=torch.device("cpu"))
    errors = cli.validate(cli.parse_args(["--export-hf", str(out)]), CFG, grid)
    assert any("--export-hf: " in e and "notes.txt" in e for e in errors)  # before any training
    assert W.export_problem(tmp_path / "new") is None


def test_hf_tokenizer_is_copied(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2, "<s>": 3, "</s>": 4}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    cfg = M.LlamaConfig(**{**CFG.__dict__, "vocab_size": 5})
    state = dict(W.materialize(M.build(cfg), "cpu").named_parameters())
    W.save_hf(state, cfg, tmp_path / "out", tokenizer=data.load_tokenizer(str(tmp_path / "tok")))
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("a b a")["input_ids"] == [0, 1, 0]
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (conf["bos_token_id"], conf["eos_token_id"]) == (3, 4)


def readme_generation() -> list[str]:
    """The README's three lines that generate text from an export with transformers."""
    lines = (ROOT / "README.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "from transformers import AutoModelForCausalLM" in line)
    return [line.strip() for line in lines[first:first + 3]]


def _main(rank: int, world: int, argv: list[str]) -> None:
    train.main(argv)


def test_pretrain_export_then_sft_from_it(dirs, tmp_path, capsys):
    """The README's two-step flow: pretrain with --export-hf, generate from the export with the
    README's three transformers lines (greedy: the same tokens as model.generate on our side),
    then --sft --init-from the export: its first loss is transformers' loss on the same batch."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    (tmp_path / "corpus.txt").write_text("".join(p.read_text() for p in sorted(ROOT.glob("*.py")))[:20_000])
    data.prepare(tmp_path / "corpus.txt", tmp_path / "data")
    pre = tmp_path / "out" / "pretrained"
    run_ranks(_main, 2, ["--init-from", str(dirs / "init"), "--data", str(tmp_path / "data"), "--steps", "3",
                         "--seq-len", "32", "--batch-size", "4", "--tp", "2", "--export-hf", str(pre)])
    assert sorted(os.listdir(pre)) == sorted(EXPORTED + ["model.safetensors"])
    gen = json.loads((pre / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (256, 257, 258)
    tok = AutoTokenizer.from_pretrained(pre)
    text = "def main(\n\tprint('héllo')"
    assert tok(text)["input_ids"] == data.ByteTokenizer().encode(text)

    code = "\n".join(readme_generation()).replace('"out/pretrained"', repr(str(pre)))
    capsys.readouterr()
    exec(code, {})
    printed = capsys.readouterr().out
    prompt = torch.tensor([data.ByteTokenizer().encode("def main(")])
    ours = M.generate(W.load_hf(pre), prompt, 40, eos_id=257)[0].tolist()
    want = data.ByteTokenizer().decode(ours).split("<|eos|>")[0]
    assert printed.startswith(want), (printed, want)

    chats = [{"messages": [{"role": "user", "content": f"{a}+{a}"},
                           {"role": "assistant", "content": str(2 * a)}]} for a in range(40)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    run_ranks(_main, 1, ["--sft", "--init-from", str(pre), "--data", str(tmp_path / "chats.jsonl"),
                         "--packing", "none", "--seq-len", "32", "--batch-size", "4", "--steps", "1",
                         "--val-fraction", "0", "--metrics", str(tmp_path / "sft.jsonl")])  # every chat trains
    loss = json.loads((tmp_path / "sft.jsonl").read_text())["loss"]
    # the run's first batch, and transformers' loss on it (one chat per row, padding ignored)
    ds = sft.SFTDataset(sft.load_jsonl(str(tmp_path / "chats.jsonl"))[0], data.ByteTokenizer(), 32, "none",
                        "truncate")
    batch = [ds[i] for i in dp.DPSampler(len(ds), 4, 0, 1, seed=0, remainder="wrap").next_batch()]
    hf = LlamaForCausalLM.from_pretrained(pre).eval()
    with torch.no_grad():
        logits = hf(torch.stack([b["input_ids"] for b in batch])).logits
    labels = torch.stack([b["labels"] for b in batch])
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (loss, want.item())
