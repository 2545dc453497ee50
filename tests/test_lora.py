"""LoRA (lora.py) against PEFT, and every layout against one process.

Reference: peft 0.21.2's LoraModel on transformers' LlamaForCausalLM (fp32). Both get the same A and
B (B random, so the adapter term and B's gradient are not trivially zero).
- In process: logits, loss and the gradient of every A and B within 1e-5 relative, for lora.py on
  transformers' own Llama and on attotron's Llama loaded from the same folder.
- merge / unmerge / adapters_off: the merged logits equal the adapted ones; unmerged and switched
  off equal the base.
- The PEFT export loads in peft.PeftModel.from_pretrained with the same logits.
- Through the CLI (forked gloo ranks): tp2·pp2·dp2 ZeRO-3 AC, tp2·cp2·sp and pp2 zero-bubble equal one
  process, 5 AdamW steps, 1e-5 relative on every step's loss and grad norm (dropout 0).
- DPO with LoRA starts at ln 2; GRPO's KL reference shares the frozen base.
- A checkpoint holds only the adapters and resumes in another layout; the memory formula with a
  frozen base; the flags' refusals.
"""
import copy
import math

import pytest
import torch
import transformers as T

import lora as L
import weights as W
from test_model import assert_close

peft = pytest.importorskip("peft")

R, ALPHA = 4, 8


def hf_llama(seed: int = 0) -> T.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=101, hidden_size=40, intermediate_size=88, num_hidden_layers=2,
                        num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=64)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return model


def peft_model(base: torch.nn.Module) -> torch.nn.Module:
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(L.DEFAULT_TARGETS))
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(1)
    with torch.no_grad():  # B off zero: the adapter term and every gradient are live
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape) * 0.1)
    return model


def copy_adapters(peft_m: torch.nn.Module, ours: torch.nn.Module) -> None:
    """PEFT's A and B into lora.py's (PEFT's key names mapped by lora.from_peft_key)."""
    theirs = {L.from_peft_key(n.replace(".default", "")): p for n, p in peft_m.named_parameters() if "lora_" in n}
    mine = dict(ours.named_parameters())
    assert set(theirs) == set(L.adapter_names(ours))
    with torch.no_grad():
        for n, p in theirs.items():
            mine[n].copy_(p)


def grads_by_name(model: torch.nn.Module, peft_names: bool) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[L.from_peft_key(n.replace(".default", "")) if peft_names else n] = p.grad
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    base = hf_llama()
    base.save_pretrained(d)
    ref = peft_model(copy.deepcopy(base))
    ids = torch.randint(0, 101, (2, 12))
    labels = torch.randint(0, 101, (2, 12))
    return d, base, ref, ids, labels


@pytest.mark.parametrize("ours", ["transformers", "attotron"])
def test_lora_equals_peft(setup, ours):
    d, base, ref, ids, labels = setup
    model = copy.deepcopy(base) if ours == "transformers" else W.load_hf(d)
    names = L.apply_lora(model, R, ALPHA, 0.0)
    assert len(names) == 2 * 7
    copy_adapters(ref, model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(L.adapter_names(model))
    ref.zero_grad()
    want_logits = ref(input_ids=ids).logits
    hf_labels = labels  # transformers' loss shifts them itself; attotron's takes them shifted
    want_loss = ref(input_ids=ids, labels=hf_labels).loss
    want_loss.backward()
    if ours == "transformers":
        logits = model(input_ids=ids).logits
        loss = model(input_ids=ids, labels=hf_labels).loss
    else:
        logits = model(ids)
        shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
        loss = model(ids, labels=shifted)
    loss.backward()
    assert_close(logits, want_logits)
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()
    want, got = grads_by_name(ref, True), grads_by_name(model, False)
    assert set(want) == set(got)
    for n in want:
        assert want[n].abs().max() > 0, n  # a live gradient: the comparison can fail
        assert_close(got[n], want[n])


def test_merge_unmerge_and_adapters_off(setup):
    d, base, ref, ids, _ = setup
    model = W.load_hf(d)
    plain = model(ids).detach()
    L.apply_lora(model, R, ALPHA, 0.0)
    copy_adapters(ref, model)
    adapted = model(ids).detach()
    assert (adapted - plain).abs().max() > 1e-3  # the adapters change the output
    with L.adapters_off(model):
        assert torch.equal(model(ids), plain)
    L.merge(model)
    assert_close(model(ids).detach(), adapted)
    with pytest.raises(ValueError, match="merged"):
        with L.adapters_off(model):
            pass
    L.unmerge(model)
    assert_close(model(ids).detach(), adapted)
    with L.adapters_off(model):
        assert_close(model(ids).detach(), plain)


def test_fresh_adapters_start_as_the_base_and_bad_targets_raise(setup):
    d, base, *_ = setup
    model = W.load_hf(d)
    ids = torch.randint(0, 101, (1, 8))
    plain = model(ids).detach()
    L.apply_lora(model, R, ALPHA, 0.0)
    assert torch.equal(model(ids), plain)  # B = 0
    a = model.model.layers["0"].self_attn.q_proj.lora_A
    bound = 1 / math.sqrt(a.shape[1])  # PEFT's Kaiming-uniform with a = sqrt(5)
    assert a.abs().max() <= bound and a.abs().max() > bound / 2
    with pytest.raises(ValueError, match="name no module"):
        L.apply_lora(W.load_hf(d), R, ALPHA, 0.0, targets=("c_attn",))
    with pytest.raises(ValueError, match="not linear"):
        L.apply_lora(W.load_hf(d), R, ALPHA, 0.0, targets=("input_layernorm",))


# ---- every layout equals one process, through the CLI
from test_train import _main, args_for, assert_curve, losses, setup_dirs  # noqa: E402,F401
from dist import run_ranks  # noqa: E402

LORA_FLAGS = ["--lora", "4", "--lora-alpha", "8", "--lr", "1e-2"]
LORA_LAYOUTS = {
    "tp2-pp2-dp2-zero3-ac": (8, ["--tp", "2", "--pp", "2", "--zero", "3", "--ac"]),
    "tp2-cp2-sp": (4, ["--tp", "2", "--cp", "2", "--sp"]),
    "pp2-zb": (2, ["--pp", "2", "--schedule", "zb", "--micro-batches", "4"]),  # the B/W split: adapters' W only
}


def curves(path) -> tuple[list[float], list[float]]:
    import json
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


@pytest.fixture(scope="module")
def lora_reference(setup_dirs):
    d = setup_dirs
    run_ranks(_main, 1, args_for(d, *LORA_FLAGS, metrics="lora_ref.jsonl"))
    loss, norm = curves(d / "lora_ref.jsonl")
    assert loss[-1] < loss[0] - 0.05  # the adapters learn: comparing the curves is not vacuous
    return loss, norm


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layouts_equal_one_process(setup_dirs, lora_reference, name):
    d = setup_dirs
    world, extra = LORA_LAYOUTS[name]
    run_ranks(_main, world, args_for(d, *LORA_FLAGS, *extra, metrics=f"lora_{name}.jsonl"), timeout=240)
    loss, norm = curves(d / f"lora_{name}.jsonl")
    assert_curve(loss, lora_reference[0])
    assert_curve(norm, lora_reference[1])  # only the adapters, each element counted once


# ---- DPO and GRPO: the reference is the starting policy, with no second copy of the base
def dpo_argv(tmp_path, name: str, *extra: str) -> list[str]:
    import json
    from test_dpo import pairs
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"chosen": c, "rejected": r}) + "\n" for c, r in pairs(32, seed=5)))
    return ["--dpo", "--allow-random-init", "--data", str(path), "--model", "tiny", "--seq-len", "192", "--batch-size", "4",
            "--steps", "4", "--lr", "1e-2", "--warmup", "0", "--dpo-beta", "0.5", "--log-every", "100",
            "--lora", "4", "--metrics", str(tmp_path / f"{name}.jsonl"), *extra]


def test_dpo_with_lora_starts_at_ln2_and_tp2_equals_one_process(tmp_path):
    run_ranks(_main, 1, dpo_argv(tmp_path, "single"))
    loss, norm = curves(tmp_path / "single.jsonl")
    assert loss[0] == pytest.approx(math.log(2), abs=1e-6)  # fresh adapters: policy = reference
    assert loss[-1] < loss[0] - 0.01
    run_ranks(_main, 2, dpo_argv(tmp_path, "tp2", "--tp", "2", "--sp"))
    got, got_norm = curves(tmp_path / "tp2.jsonl")
    assert_curve(got, loss)
    assert_curve(got_norm, norm)


def test_grpo_reference_is_the_start_sharing_the_frozen_base(setup):
    from types import SimpleNamespace
    import grpo as GR
    d, *_ = setup
    model = W.load_hf(d)
    L.apply_lora(model, R, ALPHA, 0.0)
    trainer = GR.Trainer(model, SimpleNamespace(verifier="grpo:arithmetic_reward", grpo_clip=0.2, grpo_kl=0.1,
                                                 grpo_group=2, seq_len=64, grpo_rollout_rows=0),
                         None, torch.device("cpu"))
    params = dict(model.named_parameters())
    for n, t in trainer.ref.items():  # the base shared, the adapters copied
        assert (t.data_ptr() == params[n].data_ptr()) == (not params[n].requires_grad), n
    with torch.no_grad():
        for n in L.adapter_names(model):
            params[n].add_(torch.randn(params[n].shape) * 0.1)  # "trained" adapters
    ids, labels = torch.randint(0, 101, (2, 10)), torch.randint(0, 101, (2, 10))
    ref = trainer.logps(ids, labels, ref=True)
    with L.adapters_off(model):  # fresh adapters (B = 0): the reference is the base
        assert_close(ref, trainer.logps(ids, labels))
    assert (trainer.logps(ids, labels) - ref).abs().max() > 1e-3


# ---- out: the PEFT adapter and the merged model; in: --init-adapter
def test_peft_export_roundtrip(setup_dirs):
    from safetensors.torch import load_file
    d = setup_dirs
    adapter, merged = d / "adapter", d / "merged"
    run_ranks(_main, 4, args_for(d, *LORA_FLAGS, "--tp", "2", "--zero", "3", "--steps", "3",
                                 "--export-adapter", str(adapter), "--export-hf", str(merged),
                                 metrics="lora_export.jsonl"), timeout=240)
    ids = torch.randint(0, 260, (2, 16))
    base = T.AutoModelForCausalLM.from_pretrained(d / "init").eval()
    want = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
    got = T.AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    plain = T.AutoModelForCausalLM.from_pretrained(d / "init").eval()(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapters trained: the comparison can fail
    assert_close(got, want)
    # the adapter in again, at another layout; lr 0 keeps it: out equals in, bit for bit
    again = d / "adapter_again"
    run_ranks(_main, 2, args_for(d, *LORA_FLAGS, "--pp", "2", "--steps", "1", "--lr", "0", "--init-adapter",
                                 str(adapter), "--export-adapter", str(again), metrics="lora_again.jsonl"))
    first, second = (load_file(p / "adapter_model.safetensors") for p in (adapter, again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_checkpoint_holds_only_adapters_and_resumes_in_another_layout(setup_dirs, lora_reference):
    """5 steps in one process (lora_reference) against: 3 steps at tp2·pp2 ZeRO-1 saved, then
    resumed at dp2 ZeRO-3 for steps 4-5. The checkpoint holds the adapters and their moments only."""
    import json
    d = setup_dirs
    save = d / "lora_ckpt"
    run_ranks(_main, 4, args_for(d, *LORA_FLAGS, "--tp", "2", "--pp", "2", "--zero", "1", "--save", str(save),
                                 "--save-every", "3", metrics="lora_ck1.jsonl"), timeout=240)
    meta = json.loads((save / "step_00000003" / "meta.json").read_text())
    assert meta["shapes"] and all(k.endswith((".lora_A", ".lora_B")) for k in meta["shapes"])
    run_ranks(_main, 2, args_for(d, *LORA_FLAGS, "--zero", "3", "--save", str(save), "--resume",
                                 str(save / "step_00000003"), metrics="lora_ck2.jsonl"), timeout=240)
    loss, norm = curves(d / "lora_ck2.jsonl")
    assert_curve(loss, lora_reference[0][3:])
    assert_curve(norm, lora_reference[1][3:])


# ---- memory: the ZeRO table for the adapters; ZeRO-3 shards the frozen base beside them
def _memory(rank: int, world: int, qlora: bool) -> dict:
    import model as M
    import precision as P
    import qlora as Q
    import zero3 as Z3
    import zero_memory as ZM
    cfg = M.PRESETS["tiny"]
    model = W.materialize(M.build(cfg), "cpu", seed=1)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    L.apply_lora(model, 4, 8)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)  # the compute copy, as train.py's LoRA step makes it
    quantized = Q.apply_qlora(model, full.__getitem__, torch.bfloat16) if qlora else []
    frozen = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad and ".nf4_" not in n)
    whole = ZM.frozen_bytes(model)  # before ZeRO-3: the whole base on this rank
    opt = Z3.apply_zero(model, 3, None, P.OptimConfig(lr=1e-3), torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    for step in range(2):  # the second: Adam's moments exist, and the grads of the step are held
        if step:
            opt.step(1e-3)
        model(ids, labels=ids).backward()
        opt.finish()
    held = sum(f.untyped_storage().nbytes() > 0 for f in opt.frozen_flats)  # backward freed every frozen unit
    trained = sum(full_shape[0] * full_shape[1] for full_shape in
                  (L.full_shape(model, n) for n in L.adapter_names(model)))
    return dict(state=sum(ZM.persistent_bytes(opt).values()), parts=ZM.persistent_bytes(opt), trained=trained,
                frozen=frozen, quantized=sum(full[n].numel() for n in quantized), weights=len(quantized),
                whole=whole, frozen_bytes=ZM.frozen_bytes(model, opt), buckets=len(opt.buckets),
                frozen_units=len(opt.frozen_units), held=held)


@pytest.mark.parametrize("qlora", [False, True])
def test_memory_formula_with_a_frozen_base(qlora):
    """dp2 ZeRO-3, tiny preset, r 4, after a step and a backward: the storages this rank holds.
    Trained state: the ZeRO table of the adapters. Frozen base (bf16, and NF4's codes and scales):
    the whole base's bytes / N, and lora_formula_bytes at stage 3. Both within the units' padding."""
    import zero_memory as ZM
    for out in run_ranks(_memory, 2, qlora):
        n = 2
        want_state = ZM.lora_formula_bytes(3, out["trained"], 0, n)
        assert abs(out["state"] - want_state) <= 16 * n * out["buckets"], out  # padding: < n elements a unit
        pad = 4 * out["frozen_units"]  # < n elements a unit, 4 bytes at most
        assert out["held"] == 0 and abs(out["frozen_bytes"] - out["whole"] / n) <= pad, out  # sharded, not whole
        want_frozen = ZM.lora_formula_bytes(3, 0, out["frozen"], n, 2.0) + \
            out["quantized"] * ZM.nf4_bytes_per_param() / n
        # NF4's per-weight extras: its fp32 mean, and its last block of scales rounded up to 256
        assert abs(out["frozen_bytes"] - want_frozen) <= (8 * out["weights"] + 1) / n + pad, out
        assert (out["quantized"] > 0) == qlora


def _build_peak(rank: int, world: int, qlora: bool, layers: int) -> dict:
    """train.py's build at dp2 ZeRO-3 (seeded init). The reader marks the meter at the first frozen read.
    Phase "start" records the bytes live then; "frozen" the most live while the frozen units fill."""
    import dataclasses
    import cli
    import grid as G
    import memory as MEM
    import model as M
    import qlora as Q
    import train
    import zero_memory as ZM
    args = cli.parse_args(["--model", "tiny", "--lora", "4", "--zero", "3", "--dtype", "bf16", "--seq-len", "32",
                           *(["--qlora"] if qlora else [])])
    args.virtual_stages, args.micro_batches = cli.virtual_stages(args), cli.micro_batches(args, world)
    cfg = dataclasses.replace(M.PRESETS["tiny"], num_hidden_layers=layers)
    grid = G.setup()
    G.make_grid(grid, 1, 1)
    meter = MEM.PeakMeter(grid.device)
    meter.phase("model")
    model, shards, init = train.build_model(args, cfg, grid)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    held: list[int] = []  # the frozen bytes the model held at the first frozen read

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        if name in frozen and not held:
            held.append(ZM.frozen_bytes(model))
            meter.phase("start")  # a phase with no allocation of its own: the bytes live now
            meter.phase("frozen")
        return init(name, start, stop)
    meter.phase("trained")
    opt = train.make_optimizer(args, model, shards, read, grid)
    meter.close()
    assert held, "no frozen parameter was read at the optimizer's build: the base was filled whole before"
    codes = {}
    with opt.gathered():  # the shards joined: each layer's codes equal the whole weight's, bit for bit
        full = W.param_reader(M.build(cfg), args.seed)
        for n, m in model.named_modules():
            if hasattr(m, "nf4"):
                shape = M.global_shapes(cfg)[f"{n}.weight"]
                want = Q.quantize_nf4(full(f"{n}.weight", 0, math.prod(shape)).view(shape))
                codes[n] = all(torch.equal(getattr(m.nf4, f), getattr(want, f)) for f in Q.FIELDS)
    weight = max(math.prod(s) for s in M.global_shapes(cfg).values()) * 4  # the largest, read whole in fp32
    return dict(peak=held[0] + meter.peak("frozen").allocated - meter.peak("start").allocated, held=held[0],
                whole=sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in frozen),
                sharded=ZM.frozen_bytes(model, opt), weight=weight, codes=codes)


@pytest.mark.parametrize("qlora", [False, True])
def test_build_peak_of_a_frozen_base(qlora):
    """dp2 ZeRO-3, tiny preset at 24 layers (so the whole base dwarfs a weight): the frozen base stays
    on the meta device until the optimizer reads each rank's shard, one weight at a time (QLoRA:
    quantized whole, then cut). The frozen bytes at the build's peak: the shards plus one weight's
    temporaries (the largest, fp32, at most 3x), never the whole base. Before this, build_model filled
    the whole base on every rank: no frozen read reached the optimizer, and the rank raises.
    The NF4 codes and scales a rank gathers equal one process's whole-weight quantization, bit for bit."""
    for out in run_ranks(_build_peak, 2, qlora, 24):
        bound = out["sharded"] + 3 * out["weight"]
        assert out["held"] == 0 and out["peak"] <= bound < out["whole"], out
        assert out["peak"] >= out["sharded"]  # the meter saw the shards: the bound is not vacuous
        assert all(out["codes"].values()) and (len(out["codes"]) > 0) == qlora, out


def test_lora_flags_are_checked_by_name(tmp_path):
    import dataclasses
    import cli
    import grid as G
    import model as M

    def errors(*argv: str, cfg=M.PRESETS["tiny"]) -> str:
        grid = G.Grid(rank=0, world=1, device=torch.device("cpu"))
        return "\n".join(cli.validate(cli.parse_args(["--seq-len", "32", *argv]), cfg, grid))
    assert errors("--lora", "4", "--qlora", "--lora-alpha", "8", "--lora-dropout", "0.1") == ""
    assert "go with --lora R" in errors("--lora-alpha", "8")
    assert "go with --lora R" in errors("--qlora")
    assert "--lora-dropout must be in [0, 1)" in errors("--lora", "4", "--lora-dropout", "1")
    assert "--lora-targets 'q_proj,wq': choose from" in errors("--lora", "4", "--lora-targets", "q_proj,wq")
    assert "--qlora with --export-hf" in errors("--lora", "4", "--qlora", "--export-hf", str(tmp_path / "x"))
    moe = dataclasses.replace(M.PRESETS["tiny"], num_experts=4, model_type="mixtral")
    assert "mixture-of-experts" in errors("--lora", "4", cfg=moe)
    assert "--init-adapter" in errors("--lora", "4", "--init-adapter", str(tmp_path / "missing"))
    (tmp_path / "f").write_text("")
    assert "is a file; it must be a folder" in errors("--lora", "4", "--export-adapter", str(tmp_path / "f"))
