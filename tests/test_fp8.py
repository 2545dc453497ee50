"""fp8.py: FP8 linears against torchao's Float8Linear(emulate=True), the module swap, every layout.

Tolerances
    fp32, against torchao: 1e-5 of the output's largest magnitude. Both sides hold the same FP8 codes
    and scales (checked bit for bit). fp8 x fp8 products are exact in fp32. What differs is where the
    scales are applied (torchao divides each operand first; _scaled_mm multiplies the sum) and the
    summation order: a few fp32 ulps of the largest term. Any wrong code or scale moves the output
    by at least one e4m3 step of some element, 2^-4 relative: thousands of times the bound.
    bf16: both round one fp32 sum to bf16, so they differ by at most one bf16 ulp, 2^-7 relative.
    Layouts: see LAYOUT_RTOL.
"""
import argparse
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fp8 as FP8
import model as M
import train
from dist import run_ranks
from test_train import CFG, args_for, setup_dirs  # noqa: F401  (a fixture)


def _torchao_pair(lin: nn.Linear):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    ref = Float8Linear.from_float(copy.deepcopy(lin), config=Float8LinearConfig(emulate=True))
    mine = FP8.Float8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype)
    mine.load_state_dict(lin.state_dict())
    return ref, mine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torchao_emulate(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(96, 48, bias=True).to(dtype)
    ref, mine = _torchao_pair(lin)
    x = (torch.randn(2, 16, 96) * 3).to(dtype)
    g = torch.randn(2, 16, 48).to(dtype)
    outs = []
    for m in (ref, mine):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(g)
        outs.append((y.detach().float(), xi.grad.float(), m.weight.grad.float(), m.bias.grad.float()))
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for want, got, what in zip(outs[0], outs[1], ("y", "dL/dx", "dL/dW", "dL/db")):
        bound = rtol * want.abs().max() if dtype == torch.float32 else rtol * want.abs() + 1e-30
        assert ((got - want).abs() <= bound).all(), (what, (got - want).abs().max())
    # the codes and scales themselves, bit for bit
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    for t, fmt in ((x, FP8.E4M3), (lin.weight.detach(), FP8.E4M3), (g, FP8.E5M2)):
        q, s = FP8.quantize(t, fmt)
        s_ref = tensor_to_scale(t, fmt)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), to_fp8_saturated(t.float() * s_ref, fmt).view(torch.uint8))
    # FP8 is really on: the plain linear is far outside the bound
    exact = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert (exact - outs[1][0]).abs().max() > 100 * 1e-5 * exact.abs().max()


def test_swap_covers_the_layers_linears_only():
    cfg = M.LlamaConfig(**{**CFG.__dict__, "intermediate_size": 40})  # 40: no FP8 GEMM for the MLP
    model = M.build(cfg)
    names = [n for n, _ in model.named_parameters()]
    kept = FP8.use_fp8(model)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and ZeRO see the same model
    assert kept == [f"model.layers.{i}.mlp.{p}" for i in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    swapped = [n for n, m in model.named_modules() if isinstance(m, FP8.Float8Linear)]
    assert swapped == [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert type(model.lm_head) is nn.Linear
    line = train.fp8_text(argparse.Namespace(fp8_kept=kept))  # the start-up line names each kept linear
    assert line.startswith(" (12 kept unquantized") and "model.layers.3.mlp.down_proj" in line
    with pytest.raises(ValueError, match="no 'layers'"):
        FP8.use_fp8(model, layers="layers")


# ------------------------------------------------------------------------------------- layouts
# Each layout runs the same rows through each matmul as the one process with 4 micro-batches:
# dp rank r's micro-batches are the reference's micro-batches 2r, 2r+1 (contiguous rows).
# tp, sp and cp split a tensor; its amax is all-reduced, so the scale is the one process's.
# What remains is fp32 summation order (~1e-7). FP8 turns that into a rare flip to a neighbouring
# code, 2^-4 of one element, and each flip perturbs the next layer's input: the flips multiply
# layer by layer (measured: 1 flip in layer 0's o_proj input, ~1000 in layer 3's).
# So a layout cannot equal one process to 1e-5 over many steps, and three checks stand instead:
#   - the amax of every forward matmul of the first micro-batch equals one process's to 1e-5
#     (measured ≤ 1e-6: ulps). A scale from a rank's piece alone is off by far more.
#   - the first step's loss, a sum over all tokens where flips average out, to 1e-5
#     (measured ≤ 1e-7; a rank-local scale: 5e-5 at cp2, 7e-4 at tp2).
#   - the 5-step curve to 5e-4, a sanity bound (measured ≤ 2e-4 from flips; FP8 vs fp32: 1e-3).
AMAX_RTOL, LOSS_RTOL, CURVE_RTOL = 1e-5, 1e-5, 5e-4
LAYOUTS = {
    "tp2-sp": (2, ["--tp", "2", "--sp", "--micro-batches", "4"]),
    "cp2": (2, ["--cp", "2", "--micro-batches", "4"]),
    "pp2-dp2-zero1": (4, ["--pp", "2", "--zero", "1", "--micro-batches", "2"]),
    "dp2-zero2": (2, ["--zero", "2", "--micro-batches", "2"]),
    "dp2-zero3-ac": (2, ["--zero", "3", "--ac", "--micro-batches", "2"]),
}
LINEARS = 7  # FP8 matmuls per decoder layer: q, k, v, o, gate, up, down


def _main(rank: int, world: int, argv: list[str], local_scales: bool = False) -> list[float]:
    """train.main, recording every amax this rank computes (in call order)."""
    seen, scale_of, use_fp8 = [], FP8.scale_of, FP8.use_fp8
    FP8.scale_of = lambda a, dtype: seen.append(float(a)) or scale_of(a, dtype)
    if local_scales:  # the bug the layout tests must catch: amax over this rank's piece only
        FP8.use_fp8 = lambda model, groups=(), layers="model.layers": use_fp8(model, (), layers)
    try:
        train.main(argv)
    finally:
        FP8.scale_of, FP8.use_fp8 = scale_of, use_fp8
    return seen


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _gap(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) > 0
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.fixture(scope="module")
def fp8_reference(setup_dirs):  # noqa: F811
    d = setup_dirs
    amaxes = run_ranks(_main, 1, args_for(d, "--fp8", "--micro-batches", "4", metrics="fp8_ref.jsonl"))[0]
    plain = d / "fp8_plain.jsonl"
    run_ranks(_main, 1, args_for(d, "--micro-batches", "4", metrics=plain.name))
    curve = _losses(d / "fp8_ref.jsonl")
    assert curve[-1] < curve[0] - 0.05  # it trains
    # FP8 is on: the fp32 run's first loss is far outside the bound
    assert abs(_losses(plain)[0] - curve[0]) > 10 * LOSS_RTOL * curve[0]
    return curve, amaxes


def _check(name: str, curve: list[float], amaxes: list[list[float]], reference) -> None:
    want_curve, want_amax = reference
    first = 2 * LINEARS * (2 if name.startswith("pp2") else 4)  # rank 0: x and W of its layers, micro-batch 0
    assert len(amaxes[0]) > first
    assert max(abs(a - b) / b for a, b in zip(amaxes[0][:first], want_amax[:first])) <= AMAX_RTOL, name
    assert abs(curve[0] - want_curve[0]) <= LOSS_RTOL * want_curve[0], name
    assert _gap(curve, want_curve) <= CURVE_RTOL, name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_one_process(setup_dirs, fp8_reference, name):  # noqa: F811
    d = setup_dirs
    world, extra = LAYOUTS[name]
    amaxes = run_ranks(_main, world, args_for(d, "--fp8", *extra, metrics=f"fp8_{name}.jsonl"), timeout=240)
    _check(name, _losses(d / f"fp8_{name}.jsonl"), amaxes, fp8_reference)
    if name in ("tp2-sp", "cp2"):  # the two ranks split every tensor: one amax sequence, bit for bit
        assert amaxes[0] == amaxes[1]


def test_a_local_scale_is_caught(setup_dirs, fp8_reference):  # noqa: F811
    d = setup_dirs
    amaxes = run_ranks(_main, 2, args_for(d, "--fp8", "--cp", "2", "--micro-batches", "4", "--steps", "1",
                                          metrics="fp8_local.jsonl"), local_scales=True, timeout=240)
    curve = _losses(d / "fp8_local.jsonl")
    assert amaxes[0] != amaxes[1]
    with pytest.raises(AssertionError):
        _check("cp2", curve, amaxes, fp8_reference)
    assert abs(curve[0] - fp8_reference[0][0]) > 2 * LOSS_RTOL * fp8_reference[0][0]


def test_compiles_without_a_graph_break():
    """--compile compiles each layer (model.compile_layers). The FP8 matmul must trace whole:
    fullgraph=True raises on any break. aot_eager runs the traced graph with eager kernels, so
    the result is the eager one bit for bit (inductor's fusions are --compile's own business)."""
    torch.manual_seed(0)
    lin = FP8.Float8Linear(64, 32)
    x = torch.randn(4, 16, 64)
    outs = []
    for f in (lin, torch.compile(lin, backend="aot_eager", fullgraph=True)):
        xi = x.clone().requires_grad_()
        lin.zero_grad()
        f(xi).square().sum().backward()
        outs.append((xi.grad, lin.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_refusals_name_the_flags():
    import cli
    import grid as G
    cfg = M.PRESETS["tiny"]
    for flag in ("--sft", "--dpo", "--grpo"):
        errors = cli.validate(cli.parse_args(["--fp8", flag]), cfg, G.Grid(0, 1, torch.device("cpu")))
        assert any(f"--fp8 with {flag} is not tested" in e for e in errors), errors
    cuda = G.Grid(0, 1, torch.device("cuda"))
    short = cli.parse_args(["--fp8", "--batch-size", "4", "--micro-batches", "4", "--seq-len", "24"])
    assert any("multiple of 16" in e for e in cli.validate(short, cfg, cuda))
    assert not cli.validate(cli.parse_args(["--fp8", "--batch-size", "4", "--seq-len", "32"]), cfg, cuda)


def test_8b_offload_and_fp8_gather_formulas():
    import zero_memory as ZM
    from bench.bench_theory import H200_BYTES, formulas
    psi = M.PRESETS["8b"].num_params()
    assert psi == 8_030_261_248  # Llama-3-8B: 2·128256·4096 + 32 layers + the final norm
    assert ZM.offload_formula_bytes(1, psi, 1) == (4 * psi, 16 * psi)
    assert ZM.offload_formula_bytes(2, 100, 4) == (250, 400)
    assert ZM.offload_formula_bytes(1, psi, 1)[0] < H200_BYTES - 100e9  # 32 GB: room for activations
    assert ZM.formula_bytes(0, psi, 1) > H200_BYTES - 13e9  # without offload: 128.5 GB of state alone
    assert ZM.fp8_gather_bytes(10, 6, 1, 2) == (10, 9)  # bf16 2·10·½; FP8 (2·4 + 6 + 4·1)·½
    with pytest.raises(ValueError, match="stage 1 or 2"):
        ZM.offload_formula_bytes(3, psi, 8)
    assert "| 8b | 8.03B | 128.5 | 32.1 / 128.5 | yes" in formulas()
