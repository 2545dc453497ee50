"""Every CUDA-only branch and every collective / P2P path, run on CPU under the CUDA contract.

The meta device stands in for CUDA (cuda_contract.on_meta points the library's kernel predicates at
it), torch's fake process group carries the collectives (one fake rank of a larger world in this
process), and cuda_contract.Contract asserts what the real kernels and ProcessGroupNCCL require.
Each scenario also asserts, through `contract.seen`, that the branch it is about ran at all: a
contract that checks nothing cannot pass here.

Scenarios: pretraining and packed SFT in bf16 (flash via SDPA, varlen_attn, fused RMSNorm backward,
fused AdamW, pinned non_blocking copies of 2-row micro-batches); an MoE model's grouped_mm experts;
EP's all-to-alls at ep 2 and their host syncs; TP and SP at 2 fake ranks; the cp
ring forward + backward (the flash block kernels, P2P); ZeRO-0..3 with and without AC over two
micro-batches at dp 2; the pipeline executor's P2P at pp 2; the compiled layer traced with
torch.compile(backend="aot_eager") on meta (--compile --ac with packed rows and with --cp: what
runs eagerly, and that the log line says so). Plus the host-side fixes: TF32 through one API, the
GPU peak table, memory.py's CPU accounting only for a CPU meter. And --fp8: torch._scaled_mm under
cuBLASLt's FP8 rules (sm89+, dims of 16, column-major second operand, fp32 scales, output dtype).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import cli
import cp as CP
import dp
import feed
import grid as G
import model as M
import moe
import ops
import pp as PP
import precision as P
import train
from cuda_contract import Contract, ContractError, fake_world, on_meta

META = torch.device("meta")
S = 32  # tokens per row


class Rows:
    """Pretraining rows: (S+1,) token ids; host_batch slices them into (b, S) views."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, 260, (S + 1,), generator=torch.Generator().manual_seed(i))


class Packed(Rows):
    """Packed SFT rows: two documents per row (positions restart at S/2 - 3)."""

    def __getitem__(self, i: int) -> dict:
        x = super().__getitem__(i)
        cut = S // 2 - 3
        pos = torch.cat([torch.arange(cut), torch.arange(S - cut)])
        return {"input_ids": x[:-1], "labels": x[1:], "position_ids": pos}


def one_step(argv: list[str], ds: Rows, world: int = 1, rank: int = 0) -> Counter:
    """One training step of train.py's composition on the meta device, rows through feed's pinned
    copies, the step's collectives on the fake group; returns what the contract checked."""
    args = cli.parse_args(["--dtype", "bf16", "--batch-size", "8", "--seq-len", str(S), *argv])
    grid = G.Grid(rank, world, META)
    cfg = M.PRESETS[args.model]
    assert not cli.validate(args, cfg, grid)
    args.virtual_stages, args.micro_batches = cli.virtual_stages(args), cli.micro_batches(args, world)
    G.make_grid(grid, args.tp, args.pp, 30.0, 30.0, args.cp)
    model, shards, init = train.build_model(args, cfg, grid)
    opt = train.make_optimizer(args, model, shards, init, grid)
    actions = PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp, args.virtual_stages)
    chunks = PP.stage_chunks(model, cli.layer_ranges(args, cfg), grid.at.pp_rank, args.pp)
    rows = list(range(args.batch_size // grid.data[1]))
    with Contract() as contract:
        micro = feed.to_device(feed.host_batch(ds, rows, args.micro_batches, grid), grid.device)
        targets = dp.global_count(sum(P.count_targets(m["labels"]) for m in micro), grid.dp_group)
        PP.run_pipeline(chunks, actions, micro, grid.pp_group, targets,
                        no_sync=opt.no_sync, seq_shards=args.tp if args.sp else 1, check_group=grid.pp_check,
                        hidden_size=cfg.hidden_size)
        opt.finish()
        # precision.step without its host read of the grad norm (a meta tensor has no value)
        grads = opt._master_grads()
        coef = torch.clamp(1.0 / (opt.grad_norm(grads) + 1e-6), max=1.0)
        for chunk in opt._chunks(grads):
            opt._step_chunk([i for i in chunk if grads[i] is not None], grads, coef)
        opt._publish()
        opt.teardown()  # the publish's all-gathers (ZeRO-1/2: due at the next forward) complete here
    return contract.seen


@pytest.fixture
def meta(monkeypatch):
    on_meta(monkeypatch)
    return monkeypatch


def test_pretraining_and_packed_sft_bf16(meta):
    with fake_world(0, 1, meta):
        seen = one_step(["--micro-batches", "2"], Rows())
        assert seen["sdpa flash"] and seen["non_blocking copy"] >= 4 and seen["pin_memory"] >= 4
        assert seen["aten::_fused_rms_norm_backward"] and seen["aten::_fused_adamw_"]
        seen = one_step(["--micro-batches", "2", "--sft"], Packed())
        layers = M.PRESETS["tiny"].num_hidden_layers  # 2 micro-batches through every layer
        assert seen["torch_attn::_varlen_attn"] == seen["torch_attn::_varlen_attn_backward"] == 2 * layers


def test_moe_grouped_mm_bf16(meta):
    """A Qwen3-MoE-like tiny model (4 experts, the aux loss on) in bf16: the experts take torch's
    grouped_mm branch (moe.grouped_mm_runs: bf16 on CUDA) in forward and backward, under the
    contract. ep > 1: test_ep_all_to_all_under_the_contract."""
    cfg = dataclasses.replace(M.PRESETS["tiny"], model_type="qwen3_moe", qk_norm=True, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True)
    meta.setitem(M.PRESETS, "tiny_moe", cfg)
    calls = Counter()
    grouped = moe.experts_grouped
    meta.setattr(moe, "experts_grouped", lambda *a, **k: calls.update(["grouped"]) or grouped(*a, **k))
    with fake_world(0, 1, meta):
        seen = one_step(["--micro-batches", "2", "--model", "tiny_moe"], Rows())
    assert calls["grouped"] == 2 * cfg.num_hidden_layers  # every sparse layer, both micro-batches
    assert seen["sdpa flash"] and seen["aten::_fused_adamw_"]
    # two GEMMs a layer a micro-batch forward; backward's input and weight gradients
    assert seen["aten::_grouped_mm"] >= 3 * calls["grouped"], seen
    assert seen["host sync"] == 0  # at the dispatcher: no MoE layer waits for the device (ep = 1)


def test_tp_and_sp_at_two_ranks(meta):
    with fake_world(0, 2, meta):
        seen = one_step(["--tp", "2"], Rows(), world=2)
        assert seen["c10d::allreduce_"] or seen["_c10d_functional::all_reduce"]
        seen = one_step(["--tp", "2", "--sp"], Rows(), world=2)
        assert seen["_c10d_functional::reduce_scatter_tensor"] or seen["c10d::_reduce_scatter_base_"]


def test_cp_ring_forward_and_backward(meta):
    """The training step runs the ring's backward for real (its custom op's forward on meta is the
    registered fake), so the forward ring runs directly too, on rank 1 of 2."""
    layers = M.PRESETS["tiny"].num_hidden_layers
    with fake_world(1, 2, meta):
        seen = one_step(["--cp", "2"], Rows(), world=2, rank=1)
        # rank 1 of 2: 3 blocks at ring step 0, 2 at step 1
        assert seen["aten::_scaled_dot_product_flash_attention_backward"] == 5 * layers
        assert seen["c10d::send"] and seen["c10d::recv_"]
        q = torch.randn(2, 4, S // 2, 16, device=META, dtype=torch.bfloat16).transpose(1, 2).transpose(1, 2)
        k = torch.randn(2, S // 2, 2, 16, device=META, dtype=torch.bfloat16).transpose(1, 2)  # strided
        with Contract() as contract:
            out, lse = CP._ring_forward(q, k, k, dist.group.WORLD, 0.25)
        assert contract.seen["aten::_scaled_dot_product_flash_attention"] == 5 and lse.shape == q.shape[:3]


@pytest.mark.parametrize("ac", [False, True])
def test_zero_stages_over_two_micro_batches(meta, ac):
    with fake_world(1, 2, meta):
        for stage in range(4):
            seen = one_step(["--zero", str(stage), "--micro-batches", "2", *(["--ac"] if ac else [])],
                            Rows(), world=2, rank=1)
            gathers = seen["c10d::_allgather_base_"] + seen["_c10d_functional::all_gather_into_tensor"]
            reductions = seen["c10d::allreduce_"] + seen["c10d::_reduce_scatter_base_"]
            assert reductions and (gathers or stage == 0), (stage, seen)


def test_pipeline_p2p(meta):
    with fake_world(0, 2, meta):
        seen = one_step(["--pp", "2", "--micro-batches", "2"], Rows(), world=2)
        assert seen["c10d::send"] and seen["c10d::recv_"]


# ------------------------------------------------------------------------------------- fixes
def test_cp_flash_backward_dense_arguments(meta):
    """Fails on the old cp.py: empty cum_seq tensors (the varlen branch) and a strided lse view."""
    q = torch.randn(1, 2, 8, 16, device=META, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 16, device=META).split(8, dim=2)[1]  # a chunk of the merged l: strided
    with Contract() as contract:
        CP._block_backward(q, q, q, q, q, lse, True, 0.25)
    assert contract.seen["aten::_scaled_dot_product_flash_attention_backward"] == 1
    with pytest.raises(ContractError, match="cum_seq"), Contract():
        torch.ops.aten._scaled_dot_product_flash_attention_backward(
            q, q, q, q, q, lse.contiguous(), torch.empty(0, dtype=torch.int32, device=META),
            torch.empty(0, dtype=torch.int32, device=META), 8, 8, 0.0, True,
            torch.empty((), dtype=torch.int64, device=META), torch.empty((), dtype=torch.int64, device=META))


def test_pinned_batches_are_contiguous(meta):
    """Fails on the old feed.py: a 2-row micro-batch is a strided view, pinned as it is."""
    grid = G.Grid(0, 1, META)
    with Contract() as contract:
        feed.to_device(feed.host_batch(Rows(), [0, 1, 2, 3], 2, grid), META)
    assert contract.seen["non_blocking copy"] == 4


def test_rms_norm_cuda_backward_runs(meta):
    x = torch.randn(2, 3, 64, device=META, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, device=META, dtype=torch.bfloat16, requires_grad=True)
    with Contract() as contract:
        ops.rms_norm(x, w, 1e-6).sum().backward()
    assert contract.seen["aten::_fused_rms_norm_backward"] == 1 and x.grad.shape == x.shape


def test_fp32_gqa_takes_a_fused_kernel(meta):
    """--dtype fp32 with GQA on CUDA: attention expands k/v, so SDPA's efficient kernel runs (the
    contract refuses the math fallback that enable_gqa would take)."""
    import attention
    q = torch.randn(2, S, 4, 16, device=META)
    k = torch.randn(2, S, 2, 16, device=META)
    with Contract() as contract:
        assert attention.attend(q, k, k, None).shape == q.shape
    assert contract.seen["sdpa efficient"] == 1
    with pytest.raises(ContractError, match="math fallback"), Contract():
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                                                         is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_generate_takes_fused_attention_and_counts_host_syncs(meta, dtype):
    """model.generate on the stand-in device: GQA (4 query heads, 2 kv heads), a sliding-window layer,
    ragged prompts, sampled. Prefill and decode take flash or efficient, never math. The decode's
    mask with GQA folds the query heads into rows: the efficient kernel reads k/v as views of the
    cache, nkv heads, no copy (the old expansion read nh/nkv times the bytes, from a fresh tensor).
    Host syncs at the dispatcher per decode token: 0 without an end token; 1 with one (the
    all-done check that stops decoding). The prefill adds none."""
    import weights as W
    cfg = M.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        model_type="qwen2", qkv_bias=True, sliding_window=3,
                        layer_types=("full_attention", "sliding_attention"))
    model = W.materialize_buffers(M.build(cfg), META)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    ids = torch.zeros(3, 6, dtype=torch.long, device=META)

    calls = []

    def run(new: int, **kw) -> Counter:
        with Contract(host_values=True) as contract:
            out = M.generate(model, ids, new, temperature=1.0, seeds=[1, 2, 3], lengths=[6, 2, 4], **kw)
        assert out.shape == (3, 6 + new)
        calls[:] = contract.sdpa
        return contract.seen

    two, five = run(2), run(5)
    fused = sum(five[k] for k in ("sdpa flash", "sdpa efficient", "torch_attn::_varlen_attn"))
    assert fused == 2 * 5 and five["host sync"] == two["host sync"] == 0  # every call of both layers
    assert five["sdpa flash" if dtype == torch.bfloat16 else "sdpa efficient"] >= 1  # the prefill's
    # the decode: one query row per query head, folded to (3 rows, 2 kv heads, g = 2 rows, hd 8)
    decode = [c for c in calls if c["q"] == (3, 2, 2, 8)]
    assert len(decode) == 2 * 4 and all(c["kernel"] == "sdpa efficient" and c["mask"] for c in decode)
    size = torch.finfo(dtype).bits // 8
    for c in decode:  # k and v: views of the (3, 6 + 5, 2, 8) cache, T positions of it read once
        T = c["k"][2]
        assert c["k"] == (3, 2, T, 8) and c["k_base"] == (3, 11, 2, 8), c
        assert c["kv_bytes"] == 2 * 3 * T * 2 * 8 * size  # the cache's bytes; expanded: × nh/nkv = 2
    two, five = run(2, eos_id=5), run(5, eos_id=5)
    assert five["host sync"] - two["host sync"] == 3 and two["host sync"] == 2  # one a decode token


def test_folded_gqa_equals_expanded_on_cpu():
    """attention._sdpa_folded, called directly on CPU: the query heads folded into rows equal
    enable_gqa's SDPA under a ragged mask (every query row its own). Within 1e-6 in fp32: the
    batches differ in shape, so a kernel may block and sum in another order (here they agree to
    the bit). A mask repeated in the wrong row order (i·g + j instead of j·s + i) fails here."""
    import attention
    g = torch.Generator().manual_seed(0)
    b, s, T, nh, nkv, hd = 2, 3, 7, 6, 2, 8
    q = torch.randn(b, s, nh, hd, generator=g)
    k, v = (torch.randn(b, T, nkv, hd, generator=g) for _ in range(2))
    mask = torch.rand(b, 1, s, T, generator=g) < 0.6
    mask[..., 0] = True  # every row sees a key
    assert (mask[:, :, 1:] != mask[:, :, :-1]).any()  # rows differ: a wrong row order shows
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    got = attention._sdpa_folded(q, k, v, mask)
    assert got.shape == (b, s, nh, hd)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _meta_llama() -> M.Llama:
    import weights as W
    return W.materialize_buffers(M.build(M.PRESETS["tiny"]), META)  # parameters stay on meta


def test_compiled_layer_on_meta(meta):
    """The compiled layer, traced with aot_eager on meta: plain rows compile every layer (forward and
    backward run); checkpointed layers whose attention runs eagerly (packed rows, the cp ring) would
    break the graph inside the checkpoint, so compile_layers leaves them eager and names them."""
    import ac as AC
    torch._dynamo.reset()
    model = _meta_llama()
    assert M.compile_layers(model, backend="aot_eager") == []
    x = torch.randint(0, 260, (2, S), device=META)
    model(x, labels=x, reduction="sum").backward()
    assert all(getattr(layer.forward, "compiled", False) for layer in model.model.layers.values())
    layers = [str(i) for i in range(M.PRESETS["tiny"].num_hidden_layers)]
    model = _meta_llama()
    AC.apply_ac(model, "selective")
    assert M.compile_layers(model, backend="aot_eager", packed=True) == layers
    with fake_world(0, 2, meta):
        model = _meta_llama()
        CP.apply_cp(model, dist.group.WORLD)
        AC.apply_ac(model, "full")
        assert M.compile_layers(model, backend="aot_eager") == layers
        model = _meta_llama()
        CP.apply_cp(model, dist.group.WORLD)
        assert M.compile_layers(model, backend="aot_eager") == []  # no checkpoint: two graphs a layer


# ------------------------------------------------------------------------------------- host side
def test_tf32_through_one_api():
    """Fails on the old cli.py: the new per-backend setter makes every legacy reader raise."""
    old = torch.get_float32_matmul_precision()
    try:
        args = cli.parse_args(["--dtype", "fp32"])
        assert cli.device_defaults(args, torch.device("cuda")) == "fp32 with TF32 matmuls"
        assert torch.get_float32_matmul_precision() == "high" and torch._C._get_cublas_allow_tf32()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("name, want", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H800", 989),
    ("NVIDIA H800 PCIe", 756), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA GH200 480GB", 989),
    ("NVIDIA H200 NVL", 835), ("NVIDIA B200", 2250), ("NVIDIA GB200", 2500), ("NVIDIA L40S", 362),
    ("NVIDIA L40", 181), ("NVIDIA L4", 121), ("NVIDIA GeForce RTX 4090", None)])
def test_gpu_peak_names(name, want):
    found = cli.gpu_peak(name)
    assert (found and found[0]) == want


def test_cpu_accounting_only_for_a_cpu_meter():
    code = ("import memory as MEM; a = bool(MEM._FLAG); MEM.PeakMeter('cuda'); b = bool(MEM._FLAG); "
            "MEM.PeakMeter('cpu'); print(a, b, MEM._FLAG)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).parents[1])).stdout.split()
    assert out == ["False", "False", "[True]"]


def test_bench_gpu_smoke(tmp_path):
    """bench_gpu.py's plumbing on CPU (tiny sizes, CPU kernels): every check runs and passes, the
    results file is written; without --smoke and without a GPU it refuses."""
    import json
    from bench import bench_gpu
    out = tmp_path / "bench_gpu.json"
    assert bench_gpu.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_ok"] and len(report["results"]) == 8
    assert bench_gpu.main(["--out", str(tmp_path / "x.json")]) == 2 and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("mode", ["--sft", "--dpo"])
def test_log_line_names_eager_layers(capsys, tmp_path, mode):
    """--compile --ac with packed rows (SFT's, DPO's pairs): train.py's first log line says that the
    checkpointed layers run eagerly (compile_layers leaves them so), not just "compiled layers"."""
    import json
    import dpo
    data = []
    if mode == "--dpo":  # 8 built-in pairs, not 1000: the reference is computed before step 0
        (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"chosen": c, "rejected": r}) + "\n"
                                                      for c, r in dpo.arithmetic_pairs(8)))
        data = ["--data", str(tmp_path / "pairs.jsonl"), "--model", "tiny", "--batch-size", "2", "--allow-random-init"]
    train.main([mode, "--compile", "--ac", "--steps", "0", "--seq-len", "256", *data])
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("model "))
    assert f"compiled layers ({M.PRESETS['tiny'].num_hidden_layers} checkpointed run eagerly" in line


def test_fp8_linear_under_the_contract(meta):
    """--fp8 at tp 2 with sp in bf16: every decoder linear takes torch._scaled_mm three times a
    micro-batch (y, dL/dx, dL/dW), each call within cuBLASLt's FP8 rules (cuda_contract's
    _rule_scaled_mm); the amaxes are all-reduced over tp. Then each rule refuses what it must."""
    import cuda_contract
    import fp8 as FP8
    with fake_world(0, 2, meta):
        seen = one_step(["--fp8", "--tp", "2", "--sp"], Rows(), world=2)
    layers = M.PRESETS["tiny"].num_hidden_layers
    # q, k, v, o in FP8; tiny's MLP shard is 176 / 2 = 88 wide, not a multiple of 16: kept (fp8.fits)
    assert seen["aten::_scaled_mm"] == 3 * 4 * layers
    assert seen["_c10d_functional::all_reduce"] >= seen["aten::_scaled_mm"]  # one amax per operand
    a = torch.zeros(32, 64, dtype=FP8.E4M3, device=META)
    one = torch.ones((), device=META)
    cases = {"multiples of 16": (a, torch.zeros(24, 64, dtype=FP8.E4M3, device=META).t(), one),
             "column-major": (a, torch.zeros(64, 32, dtype=FP8.E4M3, device=META), one),
             "fp32 value": (a, torch.zeros(32, 64, dtype=FP8.E4M3, device=META).t(), one.double())}
    with Contract():
        for what, (x, w, s) in cases.items():
            with pytest.raises(ContractError, match=what):
                torch._scaled_mm(x, w, scale_a=one, scale_b=s, out_dtype=torch.bfloat16)
        meta.setattr(cuda_contract, "CAPABILITY", (8, 0))  # an A100
        with pytest.raises(ContractError, match="sm89"):
            FP8.fp8_linear(torch.zeros(16, 64, device=META), torch.zeros(32, 64, device=META))
@pytest.mark.parametrize("layout", [["--zero", "1"], ["--zero", "3"], ["--tp", "2"]])
def test_muon_step_at_two_ranks(meta, layout):
    """--optimizer muon's step on the meta device as CUDA: the pieces' two all-to-alls (ZeRO) or the
    tp gather pass NCCL's checks, and AdamW's fused kernel steps the rest."""
    with fake_world(1, 2, meta):
        seen = one_step(["--optimizer", "muon", *layout], Rows(), world=2, rank=1)
    assert seen["aten::_fused_adamw_"]
    assert seen["c10d::alltoall_base_"] == 2 if layout[0] == "--zero" else seen["c10d::allgather_"], seen


def _ep_block(ep: int) -> tuple[moe.MoE, torch.Tensor]:
    """A 4-expert, top-2 bf16 MoE block on the stand-in device, sharded over ep ranks, and 8 tokens."""
    block = moe.MoE(moe.MoEConfig(hidden=32, intermediate=16, num_experts=4, top_k=2)).to(META, torch.bfloat16)
    moe.shard_experts(block, moe.ep_groups(ep))
    return block, torch.randn(8, 32, device=META, dtype=torch.bfloat16, requires_grad=True)


def test_ep_all_to_all_under_the_contract(meta):
    """moe's expert parallelism at ep 2 (rank 0 of 2): every all-to-all within NCCL's rules
    (cuda_contract._rule_alltoall_base, _host_int_splits). Forward: three all-to-alls (the counts,
    the rows out, the rows back) and one host sync, the counts' read. Backward: two, no sync.
    Meta holds no counts. So the host reads what a balanced routing gives on symmetric peers:
    16 rows, 8 to each rank, 8 back from each, 8 a local expert."""
    with fake_world(0, 2, meta):
        block, x = _ep_block(2)
        with Contract(host_reads=lambda shape, dtype: torch.full(shape, 8, dtype=dtype)) as forward:
            y = block(x)
        with Contract() as backward:
            y.backward(torch.ones_like(y))
    assert forward.seen["c10d::alltoall_base_"] == 3 and backward.seen["c10d::alltoall_base_"] == 2
    assert forward.syncs == Counter({"aten::_to_copy": 1}) and backward.seen["host sync"] == 0, forward.syncs
    assert forward.seen["aten::_grouped_mm"] == 2 and x.grad.shape == x.shape


def test_ep_full_ac_recompute_reads_no_counts(meta):
    """The EP block as a full-AC layer (ac.apply_ac): backward reruns it, with its two row
    all-to-alls each way, but not the counts' exchange nor their host read: the recompute reuses
    the forward's (ac.kept_for_recompute). Without it the recompute would exchange and read them again."""
    import ac
    with fake_world(0, 2, meta):
        block, x = _ep_block(2)
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([block])
        ac.apply_ac(model, "full", layers="layers")
        with Contract(host_reads=lambda shape, dtype: torch.full(shape, 8, dtype=dtype)) as forward:
            y = model.layers[0](x)
        with Contract() as backward:  # a host read here would get garbage counts, and be counted
            y.backward(torch.ones_like(y))
    assert forward.seen["c10d::alltoall_base_"] == 3 and forward.syncs == Counter({"aten::_to_copy": 1})
    # the recompute's rows out and back, then their backward's two
    assert backward.seen["c10d::alltoall_base_"] == 4 and backward.seen["host sync"] == 0, backward.seen
    assert backward.seen["aten::_grouped_mm"] >= 2 + 4 and x.grad.shape == x.shape  # recompute + backward


def test_ep_all_to_all_rules_refuse(meta):
    """Each rule of the all-to-all refuses the call NCCL would reject or run wrongly."""
    rows = torch.zeros(4, 8, device=META)
    cases = {"contiguous": (rows, torch.zeros(8, 4, device=META).t(), [2, 2], [2, 2]),
             "summing to 4": (rows, rows, [2, 2], [1, 2]),
             "one per rank": (rows, rows, [4], [4]),
             "host ints": (rows, rows, [2, 2], torch.tensor([2, 2]))}
    with fake_world(0, 2, meta), Contract():
        for what, (out, inp, out_splits, in_splits) in cases.items():
            with pytest.raises(ContractError, match=what):
                dist.all_to_all_single(out, inp, out_splits, in_splits)
        # Python's all_to_all_single refuses two dtypes itself; the op below it does not
        with pytest.raises(ContractError, match="one dtype"):
            torch.ops.c10d.alltoall_base_(rows.bfloat16(), rows, dist.group.WORLD.boxed(), [2, 2], [2, 2], -1)
