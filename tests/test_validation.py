"""Bad input gets one clear message before any heavy work (issue 16: items 6, 7, 8 and the messages).

Flags: a user's 0 is kept (no `x or default`), and 0 / negative / NaN values that would be taken
silently or crash late are reported by cli.validate together with every unwritable output path.
Files: config.json, SFT JSONL and tokenizer folders name the file (and key or line) at fault, and a
tokenizer folder that asks to run its own code is refused without running it. Runtime: OOM is
reported as OOM, a run whose every step was skipped fails, the ETA of a resumed run counts only its
own steps, and ranks wait for rank 0's data preparation beyond --timeout, then check they see it.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cli
import data
import feed
import grid as G
import model as M
import sft
import train
import weights as W
from dist import reinit, run_ranks

ROOT = Path(__file__).resolve().parents[1]
CFG = M.PRESETS["tiny"]


def validate(*argv: str, world: int = 1) -> str:
    grid = G.Grid(rank=0, world=world, device=torch.device("cpu"))
    return "\n".join(cli.validate(cli.parse_args(["--seq-len", "32", *argv]), CFG, grid))


# ----------------------------------------------------------------------------------------- flags
def test_post_training_defaults():
    """The built-in demos' defaults (docs/post-training.md measures them): --sft alone trains the tiny
    model from scratch (1000 steps, lr 3e-3 decaying to a tenth, rows of 256); --grpo keeps its lr
    constant and takes 64 prompts a step, for 100 steps on the built-in questions and 50 on --data.
    A user's value, 0 included, is kept."""
    a = cli.parse_args(["--sft"])
    assert (a.steps, a.lr, a.min_lr, a.seq_len, a.batch_size) == (1000, 3e-3, 3e-3 / 10, 256, 16)
    a = cli.parse_args(["--grpo", "--init-from", "start"])
    assert (a.steps, a.lr, a.min_lr, a.batch_size, a.seq_len) == (100, 2e-4, 2e-4, 64, 256)
    a = cli.parse_args(["--grpo", "--init-from", "start", "--data", "prompts.jsonl"])
    assert (a.steps, a.batch_size) == (50, 64)
    a = cli.parse_args(["--grpo", "--init-from", "start", "--min-lr", "0", "--batch-size", "8"])
    assert (a.min_lr, a.batch_size) == (0, 8)
    a = cli.parse_args([])
    assert (a.steps, a.batch_size, a.min_lr) == (50, 16, a.lr / 10)


def test_zero_is_kept_not_replaced_by_the_default():
    args = cli.parse_args(["--seq-len", "0", "--lr", "0"])
    assert (args.seq_len, args.lr, args.min_lr) == (0, 0.0, 0.0)
    assert "--seq-len must be positive, got 0" in validate("--seq-len", "0")
    assert validate("--lr", "0") == ""  # a run that changes nothing is a legitimate dry run
    args = cli.parse_args([])
    assert (args.seq_len, args.lr) == (256, 1e-3)


@pytest.mark.parametrize("argv, text", [
    (["--log-every", "0"], "need --log-every >= 1"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
    (["--timeout", "-5"], "--timeout must be > 0 seconds, got -5.0"),
    (["--timeout", "nan"], "need finite numbers, got --timeout nan"),
    (["--weight-decay", "-0.1"], "--weight-decay and --clip must be >= 0"),
    (["--clip", "-1"], "--weight-decay and --clip must be >= 0"),
    (["--lr", "nan"], "need finite numbers, got --lr nan"),
    (["--clip", "inf", "--bucket-mb", "nan"], "need finite numbers, got --clip inf, --bucket-mb nan"),
    (["--lr=-1e-3"], "need 0 <= --min-lr <= --lr"),
    (["--sp"], "--sp splits each sequence over the tp ranks: it needs --tp > 1"),
    (["--eval-every", "-1"], "--eval-every >= 0"),
    (["--eval-batches", "0"], "--eval-batches >= 1"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1), got 1.0"),
    (["--sft", "--eval-batches", "2"], "--eval-batches sizes the validation loss of pretraining"),
    (["--cp", "3"], "world size 1 is not divisible by --tp 1 × --cp 3 × --pp 1"),
    (["--cp", "0"], "--cp 0"),
    (["--peak-tflops", "0"], "--peak-tflops must be a positive number, got 0.0"),
    (["--peak-tflops", "nan"], "--peak-tflops must be a positive number, got nan"),
    (["--model", "small", "--init-from", "hf"], "--model small with --init-from: the model is --init-from's"),
])
def test_flag_holes_are_reported(argv, text):
    assert text in validate(*argv)


def test_context_parallel_layouts():
    assert validate("--cp", "2", world=4) == ""
    assert "--cp 4: --seq-len 36 must be a multiple of 2·cp = 8" in validate("--cp", "4", "--seq-len", "36",
                                                                          world=4)
    assert "each rank's seq-len/cp = 8 tokens must split into --tp 3" in validate(
        "--cp", "4", "--tp", "3", "--sp", world=12).replace("heads", "")
    assert "--cp with --sft" in validate("--cp", "2", "--sft", world=2)


def test_device_defaults_and_peak_flops():
    """--dtype auto: fp32 on CPU (bf16 on CUDA: not testable here); MFU's peak from the GPU's name
    (cli.gpu_peak: whole words, the longest key; tests/test_cuda_paths.py has more names), --peak-tflops
    over it, none on CPU."""
    args = cli.parse_args([])
    assert (args.dtype, args.reduce_dtype) == ("auto", "fp32")
    assert cli.device_defaults(args, torch.device("cpu")) == "fp32" and args.dtype == "fp32"
    assert cli.peak_flops(args, torch.device("cpu")) is None
    assert cli.peak_flops(cli.parse_args(["--peak-tflops", "312"]), torch.device("cpu")) == 312e12
    found = cli.gpu_peak
    assert found("NVIDIA H100 80GB HBM3") == (989, 495) and found("NVIDIA H100 PCIe") == (756, 378)
    assert found("NVIDIA A100-SXM4-80GB") == (312, 156) and found("NVIDIA GH200 480GB") == (989, 495)
    assert found("NVIDIA H200") == (989, 495) and found("NVIDIA L40S") == (362, 183)
    # FLOPs per token: 6N + attention, the untied input embedding (a lookup) left out of N
    tied = M.PRESETS["1b"]
    untied = M.LlamaConfig(**{**tied.__dict__, "tie_word_embeddings": False})
    attn = 12 * 16 * 32 * 64 * 2048
    assert cli.flops_per_token(tied, 2048) == 6 * tied.num_params() + attn
    assert cli.flops_per_token(untied, 2048) == cli.flops_per_token(tied, 2048)
    assert "--compile with --schedule zb" in validate("--compile", "--pp", "2", "--schedule", "zb", world=2)
    assert validate("--compile", "--pp", "2", "--schedule", "interleaved", world=2) == ""


def test_eval_every_is_valid_without_sft():
    assert validate("--eval-every", "5", "--eval-batches", "2") == ""


def test_output_paths_are_checked_up_front(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert f"--export-hf {f} is a file" in validate("--export-hf", str(f))
    assert f"--save {f} is a file" in validate("--save", str(f))
    assert f"cannot be created: {f} is a file" in validate("--save", str(f / "ck"))
    assert f"its folder {tmp_path / 'missing'} does not exist" in validate(
        "--metrics", str(tmp_path / "missing" / "m.jsonl"))
    assert f"--metrics {tmp_path} is a folder" in validate("--metrics", str(tmp_path))
    assert "--export-hf and --save are the same path" in validate(
        "--save", str(tmp_path / "o"), "--export-hf", str(tmp_path / "o"))
    ok = validate("--save", str(tmp_path / "new" / "ck"), "--export-hf", str(tmp_path / "hf"),
                  "--metrics", str(tmp_path / "m.jsonl"))
    assert ok == ""  # folders are created as needed; the metrics file's folder exists


def test_help_shows_defaults_of_zero(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--save-every SAVE_EVERY save every N steps (0: only after the last step) (default: 0)",
                 "--seed SEED init and data-order seed (default: 0)",
                 "--zero {0,1,2,3} ZeRO stage over the dp group (default: 0)"):
        assert flag in text


def test_every_problem_in_one_message_before_any_work(tmp_path):
    """End to end: exit 2, one "error:", all problems listed, and the corpus not even prepared
    (the checks run before data preparation, the first heavy work)."""
    (tmp_path / "c.txt").write_text("text " * 1000)
    (tmp_path / "out").write_text("a file")
    r = subprocess.run([sys.executable, "train.py", "--data", str(tmp_path / "c.txt"), "--export-hf",
                        str(tmp_path / "out"), "--metrics", str(tmp_path / "no" / "m.jsonl"),
                        "--log-every", "0", "--timeout", "0", "--seq-len", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr[-2000:]
    for text in ("--export-hf", "--metrics", "--log-every", "--timeout", "--seq-len"):
        assert text in r.stderr
    assert not feed.cache_path(cli.parse_args(["--data", str(tmp_path / "c.txt")])).exists()


# ----------------------------------------------------------------------------------------- files
def test_config_json_problems_name_the_file_and_key(tmp_path):
    path = tmp_path / "config.json"
    good = CFG.to_hf()
    for content, text in [
        ("{not json", r"config.json is not valid JSON: .* line 1 column 2"),
        ("[1, 2]", r"config.json: expected a JSON object, got list"),
        (json.dumps({k: v for k, v in good.items() if k != "hidden_size"}), r"missing key 'hidden_size'"),
        (json.dumps({**good, "num_hidden_layers": "4"}), r"'num_hidden_layers' must be a positive integer, "
                                                          r"got '4'"),
        (json.dumps({**good, "tie_word_embeddings": 1, "vocab_size": 0}),
         r"'vocab_size' must be a positive integer, got 0; 'tie_word_embeddings' must be true or false"),
        (json.dumps({**good, "rope_parameters": {"rope_theta": "big"}}), r"rope_theta must be a positive"),
    ]:
        path.write_text(content)
        with pytest.raises(ValueError, match=text) as e:
            W.load_config(tmp_path)
        assert str(path) in str(e.value)
    path.write_text(json.dumps(good))
    assert W.load_config(tmp_path) == CFG


def test_sft_file_messages(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = json.dumps({"messages": turns})
    f = tmp_path / "chats.jsonl"
    f.write_bytes((chat + "\n").encode() + '{"messages": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"chats.jsonl:2: not valid UTF-8"):
        sft.load_jsonl(f)
    assert sft.load_jsonl(f, skip_bad=True) == ([turns], 1)
    f.write_text("")
    with pytest.raises(ValueError, match=r"chats.jsonl holds no conversation: the file is empty"):
        sft.load_jsonl(f)
    f.write_text("\n{bad\n")
    with pytest.raises(ValueError, match=r"holds no conversation: all 1 non-blank lines are malformed"):
        sft.load_jsonl(f, skip_bad=True)
    with pytest.raises(ValueError, match=r"^no conversations given$"):
        sft.SFTDataset([], data.ByteTokenizer(), 16)


def _tokenizer_dir(path: Path, **config) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1, "<eos>": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return path


def test_tokenizer_folder_with_code_is_refused_and_no_code_runs(tmp_path, monkeypatch):
    """Item 8: an auto_map asks transformers to import the folder's Python (and, without
    trust_remote_code, to ask on stdin). The folder is refused; its module never runs."""
    marker = tmp_path / "code_ran"
    evil = _tokenizer_dir(tmp_path / "evil", auto_map={"AutoTokenizer": ["evil.Tok", None]})
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                  "from transformers import PreTrainedTokenizerFast as Tok\n")
    with pytest.raises(ValueError, match=r"tokenizer_config.json asks to run Python code .*auto_map"):
        data.load_tokenizer(str(evil))
    (tmp_path / "model").mkdir()  # a model folder whose config.json maps AutoTokenizer to its code
    _tokenizer_dir(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": "evil.Tok"}}))
    with pytest.raises(ValueError, match=r"config.json asks to run Python code"):
        data.load_tokenizer(str(tmp_path / "model"))
    # through the trainer, with stdin open: no prompt, one message, nothing run
    (tmp_path / "c.txt").write_text("a a a")
    r = subprocess.run([sys.executable, "train.py", "--data", str(tmp_path / "c.txt"), "--tokenizer",
                        str(evil)], cwd=ROOT, input="y\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "asks to run Python code" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()

    seen = {}  # every load passes trust_remote_code=False
    from transformers import AutoTokenizer
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: seen.update(k) or real(*a, **k))
    assert data.load_tokenizer(str(_tokenizer_dir(tmp_path / "ok"))).encode("a") == [0]
    assert seen["trust_remote_code"] is False


def test_non_tokenizer_folder_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path} is not an HF tokenizer folder: it has none of "
                                         f"tokenizer.json"):
        data.load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=f"tokenizer folder {tmp_path} could not be loaded"):
        data.load_tokenizer(str(tmp_path))


# ----------------------------------------------------------------------------------------- runtime
def test_out_of_memory_is_reported_as_such():
    grid = G.Grid(rank=3, world=4, device=torch.device("cpu"))
    with pytest.raises(G.StageError) as e, G.stage("forward/backward", grid):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    text = str(e.value)
    assert text.startswith("rank 3: out of memory during forward/backward: peak resident memory ")
    assert "Tried to allocate 2.00 GiB" in text and "distributed operation" not in text
    with pytest.raises(G.StageError, match="rank 3: out of memory during building"), \
            G.stage("building", grid, collectives=False):
        raise torch.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(RuntimeError, match="^a shape mismatch$"), G.stage("building", grid, collectives=False):
        raise RuntimeError("a shape mismatch")  # not a peer's: passes as it is


def _main(rank: int, world: int, argv: list[str]) -> None:
    train.main(argv)


def _nan_main(rank: int, world: int, argv: list[str]) -> None:
    plain = M.linear_cross_entropy
    M.linear_cross_entropy = lambda *a, **k: plain(*a, **k) * float("nan")
    train.main(argv)


def _fake_clock_main(rank: int, world: int, argv: list[str]) -> None:
    """Every step takes exactly 10 s of a fake clock (the clock moves when a step takes its batch;
    the prefetch thread draws them ahead)."""
    clock = [0.0]
    train.time = type("FakeTime", (), {"time": staticmethod(lambda: clock[0])})
    real = feed.Prefetcher.next
    feed.Prefetcher.next = lambda self: clock.__setitem__(0, clock[0] + 10) or real(self)
    train.main(argv)


def _oom_build_main(rank: int, world: int, argv: list[str]) -> None:
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
    train.make_optimizer = oom
    train.main(argv)


def test_out_of_memory_while_building_is_reported_as_such(tmp_path):
    argv = ["--data", str(_corpus(tmp_path)), "--seq-len", "16", "--batch-size", "2", "--steps", "1"]
    with pytest.raises(RuntimeError, match="rank 0: out of memory during building the model and the "
                                           "optimizer state: .*Tried to allocate 9.00 GiB"):
        run_ranks(_oom_build_main, 1, argv)


def _corpus(tmp_path: Path) -> Path:
    docs = [p.read_text() for p in sorted(ROOT.glob("*.py"))]
    return data.prepare(write(tmp_path / "c.jsonl", docs), tmp_path / "prepared", val_fraction=0.2)


def write(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d[:4000]}) + "\n" for d in docs))
    return path


def test_skipped_run_fails_and_resumed_eta_counts_own_steps(tmp_path, capfd):
    prepared = _corpus(tmp_path)
    base = ["--data", str(prepared), "--seq-len", "16", "--batch-size", "2", "--steps", "5",
            "--warmup", "1"]
    # every step non-finite, fewer than --max-bad-steps in a row: still a failed run
    with pytest.raises(RuntimeError, match="SystemExit: 2"):
        run_ranks(_nan_main, 1, [*base, "--steps", "2"])
    assert "every step of this run (2) was skipped as non-finite" in capfd.readouterr().err
    # resumed at step 2 of 5: after one step of 10 s, 2 remain → ETA 20 s (not 10/3·2)
    run_ranks(_main, 1, [*base, "--save", str(tmp_path / "ck"), "--steps", "2"])
    capfd.readouterr()
    run_ranks(_fake_clock_main, 1, [*base, "--resume", str(tmp_path / "ck" / "step_00000002")])
    out = capfd.readouterr().out
    assert "step 3/5" in out and "ETA 20s" in out.split("step 3/5")[1].splitlines()[0], out
    assert "ETA 10s" in out.split("step 4/5")[1].splitlines()[0]


def _data_wait_main(rank: int, world: int, tmp: str) -> list[str]:
    """The default group gets a 3 s timeout; rank 0 prepares for 6 s. A barrier of the default group
    would time out (as NCCL's watchdog kills the waiting ranks); the gloo wait does not."""
    import datetime
    import time
    import torch.distributed as dist
    dist.destroy_process_group()
    reinit(timeout=datetime.timedelta(seconds=3))
    grid = G.Grid(rank=rank, world=world, device=torch.device("cpu"))
    slow = data.prepare
    data.prepare = lambda *a, **k: time.sleep(6) or slow(*a, **k)
    args = cli.parse_args(["--data", f"{tmp}/c.jsonl", "--seq-len", "8"])
    got = [str(feed.load_data(args, grid)[0].tolist())]
    data.prepare = slow
    # the 3 s timeout was for the wait above; the checks below need none, and a loaded machine can
    # start a rank's next group more than 3 s after its peer's (seen once in a full suite)
    dist.destroy_process_group()
    reinit(timeout=datetime.timedelta(seconds=60))
    if rank == 1:  # a node that does not see the prepared folder
        read = Path.read_text
        Path.read_text = lambda self, *a, **k: (read(self, *a, **k) if self.name != "meta.json" else
                                                (_ for _ in ()).throw(FileNotFoundError(f"{self} not found")))
    for argv in (["--data", f"{tmp}/c.jsonl"], ["--data", f"{tmp}/missing.txt"]):
        try:
            feed.load_data(cli.parse_args([*argv, "--seq-len", "8"]), grid)
        except ValueError as e:
            got.append(str(e))
    return got


def test_ranks_wait_for_data_preparation_beyond_the_timeout_then_check_they_see_it(tmp_path):
    write(tmp_path / "c.jsonl", ["some text, long enough for rows"] * 3)
    r0, r1 = run_ranks(_data_wait_main, 2, str(tmp_path), timeout=120)
    assert r0[0] == r1[0]  # both read the folder rank 0 prepared
    assert r0[1] == r1[1] and r0[1].startswith("ranks [1] do not see the data rank 0 prepared at ")
    assert "multi-node run needs --data and --cache-dir (where it is prepared) on a filesystem every node shares" \
        in r0[1]
    assert r0[2] == r1[2] and "missing.txt does not exist" in r0[2]  # rank 0's error, on every rank
