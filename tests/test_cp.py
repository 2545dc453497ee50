"""cp.py against independent references: single-process causal SDPA for ring attention (output and
gradients, cp = 2 and 4, GQA and MHA), brute force for the zigzag block schedule.

Tolerances (fp32): ring attention <= 1e-5 relative to the reference's largest value — the ring adds
the same terms as one softmax but in blocks (log-sum-exp merges, fp32 accumulation), so only the
summation order differs (observed ~5e-7); exact (torch.equal) at cp = 1, which is SDPA itself.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp as C
from dist import run_ranks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).abs().max() / b.double().abs().max())


# ------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_blocks_cover_the_causal_triangle_once_with_equal_work(cp):
    """Every (query chunk, key chunk) pair of the causal triangle is computed exactly once over all
    ranks and ring steps, diagonal ones causally, and every rank does the same work."""
    seen, work = [], []
    for r in range(cp):
        q_chunks = C.zigzag_chunks(cp, r)
        cost = 0.0
        for step in range(cp):
            k_chunks = C.zigzag_chunks(cp, (r - step) % cp)
            for i, j, causal in C._pairs(step, r, cp):
                a, b = q_chunks[i], k_chunks[j]
                assert causal == (a == b) and b <= a
                seen.append((a, b))
                cost += 0.5 if causal else 1.0
        work.append(cost)
    assert sorted(seen) == sorted((a, b) for a in range(2 * cp) for b in range(a + 1))
    assert len(set(work)) == 1, work


def test_shard_roundtrip_and_errors():
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3, 4):
        pieces = [C.shard_sequence(x, cp, r) for r in range(cp)]
        assert all(p.shape == (2, 24 // cp) for p in pieces)
        assert torch.equal(C.unshard_sequence(pieces), x)
    assert C.shard_sequence(x, 1, 0) is x
    assert torch.equal(C.shard_sequence(x, 2, 1)[0], torch.tensor([6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]))
    with pytest.raises(ValueError, match="multiple of 2·cp = 10"):
        C.shard_sequence(x, 5, 0)


def test_math_block_equals_fused_block():
    """The plain-math block (the fallback, and the derivation written out) equals the fused kernel,
    forward and backward, given the same final out / log-sum-exp."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(4))
    for causal in (False, True):
        o, lse = C._block(q, k, v, causal, 0.25)
        o_m, lse_m = C._math_block(q, k, v, causal, 0.25)
        assert rel(o_m, o) <= 1e-6 and rel(lse_m, lse) <= 1e-6
        fused = C._block_backward(do, q, k, v, o, lse, causal, 0.25)
        math_ = C._math_block_backward(do, q, k, v, o, lse, causal, 0.25)
        assert all(rel(m, f) <= 1e-5 for m, f in zip(math_, fused))


def test_merge_of_two_key_blocks_is_attention_over_both():
    """cp.py's `_merge` docstring, checked: two blocks' (out, l), merged by log-sum-exp, equal one
    block over all keys (fp32, <= 1e-6), whichever block comes first."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(3))
    whole, l_whole = C._math_block(q, k, v, False, 0.25)
    (o1, l1), (o2, l2) = (C._math_block(q, k[:, :, part], v[:, :, part], False, 0.25)
                          for part in (slice(0, 5), slice(5, 8)))
    for (oa, la), (ob, lb) in (((o1, l1), (o2, l2)), ((o2, l2), (o1, l1))):
        o, l = C._merge(oa.float(), la, ob, lb)
        assert rel(o, whole) <= 1e-6 and rel(l, l_whole) <= 1e-6


# ------------------------------------------------------------------------------------ the ring
def _groups(rank: int, world: int) -> dict[int, dist.ProcessGroup]:
    """This rank's group of each size 1, 2, 4 (consecutive ranks; every rank makes every group)."""
    groups = {}
    for size in (1, 2, 4):
        for start in range(0, world, size):
            g = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                groups[size] = g
    return groups


def _ring(rank: int, world: int) -> dict:
    """Ring attention on cp = 2 (two groups) and cp = 4 against SDPA on the full sequence."""
    groups = _groups(rank, world)
    errors = {}
    for heads, kv_heads in ((4, 2), (4, 4)):
        gen = torch.Generator().manual_seed(heads + kv_heads)
        B, S, D = 2, 32, 8
        q = torch.randn(B, heads, S, D, generator=gen)
        k, v = (torch.randn(B, kv_heads, S, D, generator=gen) for _ in range(2))
        dout = torch.randn(B, heads, S, D, generator=gen)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=heads != kv_heads)
        ref.backward(dout)
        for cp, group in groups.items():
            r = dist.get_rank(group) if cp > 1 else 0
            local = [C.shard_sequence(t, cp, r, dim=2).clone().requires_grad_() for t in (q, k, v)]
            out = C.ring_attention(*local, group)
            out.backward(C.shard_sequence(dout, cp, r, dim=2))
            if cp == 1:
                errors[(heads, kv_heads, cp, "exact")] = torch.equal(out, ref) and all(
                    torch.equal(a.grad, b.grad) for a, b in zip(local, full))
            pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(local, full)]
            errors[(heads, kv_heads, cp)] = max(rel(a, C.shard_sequence(b, cp, r, dim=2)) for a, b in pairs)
    return errors


def _fake_kernel(rank: int, world: int) -> str:
    """The custom op's fake kernel (what torch.compile traces) gives the real outputs' shapes and
    strides, also for q, k, v that are transposed views (model.Attention's layout)."""
    q = torch.randn(2, 8, 4, 4).transpose(1, 2)  # (B, nh, s, hd) view of (B, s, nh, hd)
    k, v = (torch.randn(2, 8, 2, 4).transpose(1, 2) for _ in range(2))
    return torch.library.opcheck(torch.ops.attotron.ring_attention.default,
                                 (q, k, v, dist.group.WORLD.group_name, 0.5),
                                 test_utils=("test_faketensor",))["test_faketensor"]


def test_ring_op_fake_kernel_matches():
    assert run_ranks(_fake_kernel, 2) == ["SUCCESS", "SUCCESS"]


def test_ring_attention_equals_sdpa_cp2_cp4_gqa():
    for errors in run_ranks(_ring, 4):
        for key, err in errors.items():
            if key[-1] == "exact":
                assert err is True, key
            else:
                assert err <= 1e-5, (key, err)


# ------------------------------------------------------------------------------------ the model
def _saved_per_layer(rank: int, world: int) -> dict[int, int]:
    """Bytes one decoder layer saves for backward (ac.SavedActivationMeter) at cp = 1, 2, 4, with
    each rank's S/cp tokens of the same rows."""
    import ac as AC
    import model as M
    import weights as W
    cfg = M.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256)
    groups = _groups(rank, world)
    saved = {}
    for cp, group in groups.items():
        model = M.build(cfg)
        C.apply_cp(model, group)
        W.materialize(model, "cpu", seed=0)
        B, S = 2, 128
        x = C.shard_sequence(torch.randn(B, S, cfg.hidden_size, generator=torch.Generator().manual_seed(1)),
                             cp, dist.get_rank(group)).requires_grad_()
        cos, sin = model.model.rotary_emb(torch.arange(S // cp)[None], x.dtype)
        with AC.SavedActivationMeter() as meter:
            out = model.model.layers["0"](x, cos, sin, None)
        saved[cp] = meter.nbytes
        out.sum().backward()  # the ring's backward runs too (all ranks of the group take part)
    return saved


def test_saved_activations_per_layer_scale_as_one_over_cp():
    for saved in run_ranks(_saved_per_layer, 4):
        for cp in (2, 4):
            assert abs(saved[cp] * cp / saved[1] - 1) <= 0.10, saved


def test_positions_follow_the_zigzag_shards():
    """The rotary pre-hook gives each local token its global position: the zigzag shard of 0..S-1."""
    import model as M
    cfg = M.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    for cp in (2, 4):
        for r in range(cp):
            rotary = M.Rotary(cfg)
            rotary.register_forward_pre_hook(functools.partial(C._global_positions, cp=cp, rank=r))
            cos, _ = rotary(torch.arange(24 // cp)[None], torch.float32)
            want, _ = M.Rotary(cfg)(C.shard_sequence(torch.arange(24)[None], cp, r), torch.float32)
            assert torch.equal(cos, want)
