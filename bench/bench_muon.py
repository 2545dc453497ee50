"""Muon's numbers in docs/muon.md: the exchange's bytes on ZeRO's real layout, and bf16 Newton–Schulz's
sensitivity to one rounding.

    python -m bench.bench_muon            # the 1b preset at dp 8, on the meta device (no memory)

Bytes: the 1b preset's buckets as zero.py lays them out (25 MB, fp32 reduction), rank r owning slice r.
The owners from muon.assign_owners. Counts the bf16 elements each rank sends to owners (phase 1);
phase 3 sends the same back.
Sensitivity: a 1e-6 relative perturbation of a random 64×64 input, Newton–Schulz of both.
"""
from __future__ import annotations

import torch

import dp
import model as M
import muon


def exchange_bytes(cfg: M.LlamaConfig, N: int, bucket_mb: float = 25.0) -> dict[str, float]:
    """Phase 1's bf16 bytes per rank at ZeRO over N ranks, from the real bucket layout."""
    with torch.device("meta"):
        named = [(n, p) for n, p in M.build(cfg).named_parameters()]
    params = [p for _, p in named]
    buckets = dp.make_buckets(params, int(bucket_mb * 2**20), 4, pad_to=N)  # padded to N·S
    ids = [i for i, (n, p) in enumerate(named) if muon.hidden_matrix(n, p)]
    owner = dict(zip(ids, muon.assign_owners([muon.ns_flops(tuple(params[i].shape), 5) for i in ids], N)))
    sent, received = [0] * N, [0] * N
    for b in buckets:
        S = b.size // N
        for i, off in zip(b.index, b.offsets):
            if i not in owner:
                continue
            n = params[i].numel()
            for r in range(N):  # rank r's piece: [r·S, (r+1)·S) of the flat, cut to this parameter
                piece = max(0, min(off + n, (r + 1) * S) - max(off, r * S))
                if r != owner[i]:
                    sent[r] += 2 * piece
                    received[owner[i]] += 2 * piece
    psi_m = sum(params[i].numel() for i in ids)
    return {"psi_m": psi_m, "sent_mean": sum(sent) / N, "sent_max": max(sent), "received_max": max(received),
            "formula": 2 * psi_m * (N - 1) / N**2}


def sensitivity(seed: int = 0) -> tuple[float, float, int]:
    """(relative L2 change of the output, share of output elements changed, input elements flipped in bf16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g)
    y = x * (1 + 1e-6 * torch.randn(64, 64, generator=g))
    a, b = muon.newton_schulz(x).float(), muon.newton_schulz(y).float()
    flipped = int((x.bfloat16() != y.bfloat16()).sum())
    return float((a - b).norm() / a.norm()), float((a != b).float().mean()), flipped


if __name__ == "__main__":
    r = exchange_bytes(M.PRESETS["1b"], 8)
    print(f"1b, dp 8: Ψ_m {r['psi_m']:,}; phase 1 per rank sent: mean {r['sent_mean'] / 1e6:.1f} MB, "
          f"max {r['sent_max'] / 1e6:.1f} MB; received max {r['received_max'] / 1e6:.1f} MB; "
          f"formula {r['formula'] / 1e6:.1f} MB")
    rel, share, flipped = sensitivity()
    print(f"Newton–Schulz, 64×64, 1e-6 relative perturbation: {flipped} bf16 input element(s) flipped, "
          f"{share:.0%} of output elements changed, {rel:.2e} relative L2")
