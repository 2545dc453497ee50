"""QLoRA (qlora.py): NF4 with double quantization against bitsandbytes 0.50.2's CPU path, and layouts.

Reference: bitsandbytes.functional.quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True) and dequantize_4bit, on CPU.
- The 4-bit codes (packed bytes), the blocks' fp32 absmax before double quantization, the mean
  (offset), the 8-bit map, the second-level fp32 scales: equal to the bit.
- The 8-bit scale codes: equal, except where a scaled absmax lies within 1e-4 of the midpoint of two
  levels. bitsandbytes' C kernel (a BinSearch tree) picks the farther level there; we pick the
  nearest, as its own PyTorch backend (bucketize on midpoints) does. Measured: 6 of 4,688 scales.
- Dequantized: bit-equal (0 ulp) in every block whose scale code agrees.
- Every layout with --qlora equals one process with --qlora (forked gloo ranks, 1e-5).
"""
import pytest
import torch

import qlora as Q

bnb = pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("shape", [(96, 64), (130, 77), (1000, 300)])
def test_nf4_equals_bitsandbytes(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.02
    w[0, :64] = 0  # a block of zeros
    packed, st = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    mine = Q.quantize_nf4(w)
    assert torch.equal(packed.reshape(-1), mine.codes)  # 4-bit codes, packed the same way
    assert torch.equal(st.state2.code, Q.dynamic_map())
    assert torch.equal(st.state2.absmax, mine.scale_absmax) and torch.equal(st.offset, mine.offset)
    # the scale codes: equal but at near-ties of two levels (module docstring)
    differ = (st.absmax != mine.scale_codes).nonzero().flatten()
    assert len(differ) <= max(2, 0.005 * st.absmax.numel())
    level = Q.dynamic_map()
    absmax = torch.cat([w.reshape(-1), w.new_zeros(-w.numel() % 64)]).view(-1, 64).abs().amax(1)
    scaled = (absmax - absmax.mean()) / mine.scale_absmax.repeat_interleave(256)[:absmax.numel()]
    for i in differ:
        a, b = int(st.absmax[i]), int(mine.scale_codes[i])
        assert abs(a - b) == 1
        assert abs(scaled[i] - (level[a] + level[b]) / 2) < 1e-4  # a near-tie
        assert abs(scaled[i] - level[b]) <= abs(scaled[i] - level[a])  # ours is the nearer level
    ref = bnb.dequantize_4bit(packed, st).reshape(-1, 64 if w.numel() % 64 == 0 else 1)
    got = Q.dequantize_nf4(mine).reshape(ref.shape)
    if w.numel() % 64 == 0:
        agree = torch.ones(ref.shape[0], dtype=torch.bool)
        agree[differ] = False
        assert torch.equal(got[agree], ref[agree])
    elif len(differ) == 0:
        assert torch.equal(got, ref)


def test_sharded_dequantization_is_the_whole_weights_slice():
    torch.manual_seed(1)
    w = torch.randn(48, 40)  # 1920 elements: blocks of 64 straddle rows, and the column shards
    whole = Q.quantize_nf4(w)
    full = Q.dequantize_nf4(whole)
    assert (full - w).abs().max() < 0.2 * w.abs().max()  # it is a quantization of w
    for dim in (0, 1):
        for r in range(4):
            size = w.shape[dim] // 4
            got = Q.dequantize_nf4(Q.shard(whole, dim, r * size, size))
            assert torch.equal(got, full.narrow(dim, r * size, size))


def test_qlora_layer_runs_on_the_dequantized_weight():
    import lora as L
    import model as M
    import weights as W
    cfg = M.PRESETS["tiny"]
    model = W.materialize(M.build(cfg), "cpu", seed=3)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    L.apply_lora(model, 4, 8)
    names = Q.apply_qlora(model, full.__getitem__, torch.float32)
    assert len(names) == 7 * cfg.num_hidden_layers and not any(n in dict(model.named_parameters()) for n in names)
    got = model(ids)
    ref = W.materialize(M.build(cfg), "cpu", seed=3)
    with torch.no_grad():
        for n in names:
            ref.get_parameter(n).copy_(Q.dequantize_nf4(Q.quantize_nf4(full[n])))
    assert torch.equal(got, ref(ids))
    with pytest.raises(ValueError, match="NF4"):
        L.merge(model)


# ---- every layout equals one process, with --qlora
from test_train import _main, args_for, assert_curve, setup_dirs  # noqa: E402,F401
from test_lora import LORA_FLAGS, curves  # noqa: E402
from dist import run_ranks  # noqa: E402


def test_qlora_layouts_equal_one_process(setup_dirs):
    d = setup_dirs
    run_ranks(_main, 1, args_for(d, *LORA_FLAGS, "--qlora", metrics="qlora_ref.jsonl"))
    want, want_norm = curves(d / "qlora_ref.jsonl")
    assert want[-1] < want[0] - 0.05
    run_ranks(_main, 8, args_for(d, *LORA_FLAGS, "--qlora", "--tp", "2", "--pp", "2", "--zero", "3", "--ac",
                                 metrics="qlora_8.jsonl"), timeout=240)
    got, norm = curves(d / "qlora_8.jsonl")
    assert_curve(got, want)
    assert_curve(norm, want_norm)
