"""DeepSeek-V3: multi-head latent attention, the sigmoid router with a bias, shared experts.

What it does
    Registers transformers' `model_type` "deepseek_v3" with model.py, through its seams only:
      MLA            replaces a layer's `self_attn` (a module swap). q and kv pass low-rank
                     bottlenecks (q_a → norm → q_b; kv_a → norm → kv_b). A decoupled RoPE part
                     (qk_rope_head_dim) rides beside each head's unrotated part. One rotated key
                     head is shared by all heads. v's head dim differs from q/k's.
      SigmoidRouter  sigmoid scores. The selection adds a per-expert bias
                     (`e_score_correction_bias`), group-limited: the best topk_group of n_group
                     groups (each scored by its two best experts), then the top-k inside them.
                     The combine weights are the scores without the bias, renormalized, times
                     routed_scaling_factor.
      DeepSeekMoE    moe.MoE with that router, plus shared experts (one SwiGLU MLP) on every token.
    The first `first_k_dense_replace` layers keep the dense MLP (model's `mlp_only_layers`).
    `--init-from` reads a deepseek_v3 folder, `--export-hf` writes transformers' keys.

Core idea
    MLA caches a small latent instead of k and v. For training it is attention with unequal head
    dims: qk = nope + rope, v = v_head_dim. `attn_fn` takes equal dims (flash, the packed CPU path,
    cp's ring), so v is zero-padded to qk's dim and the output's padded columns are dropped.
    That is exact. It costs (qk − v)/v more of the P·V product (DeepSeek-V3: 192 vs 128, +50%).

Refinements, each below its banner
    YaRN RoPE (`YarnRotary`); aux-loss-free balancing (`BiasBalancer`: the bias moves by γ against
    each expert's load error, once per step); the presets dsv3-tiny/small; the refused flags.

Reference
    DeepSeek-AI 2024, "DeepSeek-V2" (MLA) and "DeepSeek-V3" (sigmoid routing, node-limited
    groups, auxiliary-loss-free balancing, §2.1.2). Wang et al. 2024, "Auxiliary-Loss-Free Load
    Balancing". Numerics follow transformers/models/deepseek_v3/modeling_deepseek_v3.py.

Run
    python train.py --model dsv3-tiny --steps 20        python -m pytest -q tests/test_deepseek.py

Builds on: model.py (the Extension seam, RMSNorm, MLP, Rotary), moe.py (MoE, Router), ops.py,
    and tp.py for MLA's tp style (imported when apply_tp calls it)

Invariants (tests/test_deepseek.py)
    - fp32 logits, loss and every gradient equal transformers' DeepseekV3ForCausalLM within 1e-5;
      a save_pretrained folder loads and exports back bit-equal (test_matches_transformers).
    - The selection and the bias update equal hand-computed cases (test_router_by_hand,
      test_bias_update_by_hand); the loads' spread falls against the same run without the update
      (test_bias_update_balances).
    - ep2, tp2, tp2+sp, pp2, cp2, ep2·tp2·pp2, cp2·tp2·pp2·ZeRO-3·AC equal one process, the biases
      bit for bit, and a resume in another layout too (test_layouts_equal_single_process).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import model as M
import moe
from ops import apply_rope

Group = dist.ProcessGroup | None


# ------------------------------------------------------------------------------------------ MLA
class MLA(nn.Module):
    """Multi-head latent attention, with transformers' parameter names. Head counts come from the
    weights (q_b_proj / kv_b_proj rows), so a tp split after the low-rank projections is seen."""

    def __init__(self, cfg: M.LlamaConfig, layer: int = 0):
        super().__init__()
        h, nh, b = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.kv_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=b)
            self.q_a_layernorm = M.RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps, not the config's
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=b)
        self.kv_a_layernorm = M.RMSNorm(self.kv_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=b)
        self.window = None  # LayerCache.attend reads it
        self.attn_fn = M.attend  # model.Attention's seam: cp.py's ring swaps it
        # the rotated key head that every local head shares: tp.py's f (its gradient summed over tp)
        self.shared_fn = lambda t: t
        self.q_norm = self.k_norm = None  # no per-head q/k norm (tp.py asks)
        self.qk_norm_whole = False
        # YaRN: the softmax scale times mscale(factor, mscale_all_dim)², as transformers; folded into q
        self.q_scale = yarn_mscale(cfg.rope_scaling, "mscale_all_dim") ** 2 if cfg.rope_scaling else 1.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Any, *, cache: Any = None) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q = q.view(B, S, -1, self.qk_dim)  # (B, S, nh, nope + rope)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_rot = k_rot.view(B, S, 1, self.rope)  # (B, S, 1, rope): one key head for all
        if self.interleave:  # pairs (x0, x1), (x2, x3)... → halves: the rotate_half layout, as HF's output
            q_rot, k_rot = (torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1) for t in (q_rot, k_rot))
        q_rot, k_rot = apply_rope(q_rot.contiguous(), k_rot.contiguous(), cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(B, S, -1, self.nope + self.v_dim)  # (B, S, nh, nope + v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        nh = k_nope.shape[2]
        q = torch.cat([q_pass, q_rot], dim=-1)  # (B, S, nh, qk)
        if self.q_scale != 1.0:
            q = q * self.q_scale  # (q·s)·k/sqrt(qk): YaRN's softmax scale, SDPA's default kept
        k = torch.cat([k_nope, self.shared_fn(k_rot).expand(B, S, nh, self.rope)], dim=-1)  # (B, S, nh, qk)
        # equal dims for every attention path: v padded with zeros, the padded outputs dropped
        v = F.pad(v, (0, self.qk_dim - self.v_dim))  # (B, S, nh, qk)
        y = self.attn_fn(q, k, v, docs) if cache is None else cache.attend(q, k, v, self)  # (B, S, nh, qk)
        return self.o_proj(y[..., :self.v_dim].reshape(B, S, -1))  # (B, S, nh·v) → (B, S, H)


    def tp_style(self, layer: nn.Module, group: Group, sequence_parallel: bool) -> None:
        """tp.apply_tp's style: heads split after the low-rank projections. q_a, kv_a and their
        norms are replicated (every rank computes them on the whole x). q_b (or q_proj) and kv_b are
        column-parallel: whole heads per rank, their f sums the latents' gradients over tp. The
        shared rotated key gets f too. o_proj is row-parallel (its all-reduce completes the output).
        Under sp, x is gathered by the layer's norm, whose backward sums dL/dx over tp. So the
        latents and the rotated key keep partial gradients (no f). The replicated weights enter
        through f instead: their gradients are summed. o_proj reduce-scatters."""
        import tp as TP  # apply_tp calls this: tp.py is loaded
        column = TP.ColumnParallelLinearInRegion if sequence_parallel else TP.ColumnParallelLinear
        row = TP.SequenceParallelRowLinear if sequence_parallel else TP.RowParallelLinear
        for name in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj"):
            old = getattr(self, name, None)
            if old is not None:
                cls = row if name == "o_proj" else column
                setattr(self, name, cls(old.in_features, old.out_features, old.bias is not None, group,
                                        device="meta", dtype=old.weight.dtype))
        if not sequence_parallel:
            self.shared_fn = lambda t: TP.copy_to_region(t, group)
            return
        for name in ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm"):
            old = getattr(self, name, None)
            if old is not None:
                setattr(self, name, TP.ReplicatedRMSNorm(old, group) if name.endswith("norm")
                        else ReplicatedLinear(old, group))


# ------------------------------------------------------------------------------------------ router
def select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
           renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) fp32 logits → (weights (N, k) fp32, experts (N, k)), as transformers'
    DeepseekV3TopkRouter. The bias steers the choice only; the weights are the plain scores."""
    N, E = logits.shape
    scores = logits.sigmoid()  # (N, E)
    choice = scores + bias  # (N, E)
    group_scores = choice.view(N, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # (N, G)
    groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # (N, topk_group)
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()  # (N, G)
    keep = keep[:, :, None].expand(N, n_group, E // n_group).reshape(N, E)  # (N, E)
    experts = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1, sorted=False).indices  # (N, k)
    weights = scores.gather(1, experts)  # (N, k)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


class SigmoidRouter(moe.Router):
    """DeepSeek-V3's gate: `weight` (E, H) and the buffer `e_score_correction_bias` (E,), in fp32.
    Returns (logits, weights, experts) as moe.Router. While `loads` is a tensor (the balancer's
    recording window) each forward adds its picks per expert."""

    def __init__(self, cfg: moe.MoEConfig, n_group: int, topk_group: int, scale: float):
        super().__init__(cfg)
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self.loads: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight_fn(self.weight).float())  # (N, E) fp32, as HF
        weights, experts = select(logits, self.e_score_correction_bias, self.cfg.top_k, self.n_group,
                                  self.topk_group, self.cfg.renormalize, self.scale)
        if self.loads is not None:
            self.loads += moe.expert_counts(experts, self.cfg.num_experts)
        return logits, weights, experts


class DeepSeekMoE(moe.MoE):
    """moe.MoE with the sigmoid router, plus `shared_experts` (a SwiGLU MLP every token passes)."""

    def __init__(self, cfg: M.LlamaConfig):
        block = moe_config(cfg)
        super().__init__(block)
        self.gate = SigmoidRouter(block, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        shared = dataclasses.replace(cfg, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
                                     mlp_bias=False)
        self.shared_experts = M.MLP(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)

    def tp_style(self, layer: nn.Module, group: Group, sequence_parallel: bool) -> None:
        """moe.MoE's style (experts whole on every rank). Under sp the shared experts run on this
        rank's S/tp tokens, so their weights enter through f, as the router's and experts' do."""
        super().tp_style(layer, group, sequence_parallel)
        if sequence_parallel:
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(self.shared_experts, name, ReplicatedLinear(getattr(self.shared_experts, name), group))


class ReplicatedLinear(nn.Module):
    """A linear layer whose replicated weight (and bias) sees only part of the work (sp's S/tp
    tokens, or one rank's heads' gradient): they enter through tp's f, which sums their gradients.
    The parameter names stay the linear's (`weight`, `bias`)."""

    def __init__(self, old: nn.Linear, group: Group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty_like(old.weight, device="meta"))  # materialize fills it
        self.bias = nn.Parameter(torch.empty_like(old.bias, device="meta")) if old.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tp import copy_to_region  # only built by a tp style: tp.py is loaded
        b = None if self.bias is None else copy_to_region(self.bias, self.group)
        return F.linear(x, copy_to_region(self.weight, self.group), b)


def moe_config(cfg: M.LlamaConfig) -> moe.MoEConfig:
    """The routed experts' block: fp32 combine weights (the router runs in fp32), no aux loss."""
    return moe.MoEConfig(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                         num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                         renormalize=cfg.norm_topk_prob, fp32_weights=True)


def routers(model: nn.Module) -> list[SigmoidRouter]:
    return [m for m in model.modules() if isinstance(m, SigmoidRouter)]


# ------------------------------------------------------------------------------------------ the model
def use_deepseek(model: M.Llama) -> M.Llama:
    """Extension.modules: MLA in every layer, DeepSeekMoE in the sparse ones, RoPE over the rope
    part only. model.build calls it on the meta device."""
    cfg = model.config
    for name, layer in model.model.layers.items():
        layer.self_attn = MLA(cfg, int(name))
        if cfg.is_sparse(int(name)):
            layer.mlp = DeepSeekMoE(cfg)
    rope = dataclasses.replace(cfg, head_dim=cfg.qk_rope_head_dim)
    model.model.rotary_emb = YarnRotary(rope) if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "yarn" \
        else M.Rotary(rope)
    model.model.rotary_emb.reset_buffers()
    model.register_forward_pre_hook(_drop_keys, with_kwargs=True)
    return model


def _drop_keys(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """train.py hands an MoE model sft's `real_tokens`: no DeepSeek part reads it (no aux loss)."""
    return args, {k: v for k, v in kwargs.items() if k not in ("real_tokens", "router_stats")}


# ------------------------------------------------------------------------------------------ config.json
# transformers' DeepseekV3Config defaults of the keys a config.json may omit
_HF_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                    norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True)
BIAS_UPDATE_SPEED = 0.001  # γ of DeepSeek-V3 §4.2 (the first 14.3T tokens): the bias step per update


def _read(d: dict, family: str, bad: list[str]) -> dict:
    """Extension.read: DeepSeek-V3's fields; what is not built goes to `bad`, by key and value."""
    get = lambda k: d[k] if d.get(k) is not None else _HF_DEFAULTS[k]  # noqa: E731 (null: the default)
    if d.get("quantization_config"):
        q = d["quantization_config"]
        bad.append(f"quantization_config={{'quant_method': {q.get('quant_method')!r}, ...}} (FP8 block-quantized "
                   "weights are not read: dequantize the checkpoint to bf16 first)")
    fields = dict(num_experts=d.get("num_local_experts", get("n_routed_experts")),
                  num_experts_per_tok=get("num_experts_per_tok"), moe_intermediate_size=get("moe_intermediate_size"),
                  norm_topk_prob=get("norm_topk_prob"), router_aux_loss_coef=0.0,
                  mlp_only_layers=tuple(range(min(get("first_k_dense_replace"), d["num_hidden_layers"]))),
                  q_lora_rank=d.get("q_lora_rank", _HF_DEFAULTS["q_lora_rank"]),
                  **{k: get(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                         "rope_interleave", "n_shared_experts", "n_group", "topk_group")},
                  routed_scaling_factor=float(get("routed_scaling_factor")), bias_update_speed=BIAS_UPDATE_SPEED)
    problem = _problem(fields)
    if problem:
        bad.append(problem)
    return fields


def _problem(f: dict) -> str | None:
    """What the router or MLA cannot do with these sizes (None: all fine)."""
    E, G, TG, k = f["num_experts"], f["n_group"], f["topk_group"], f["num_experts_per_tok"]
    if E % G or E // G < 2 or not 1 <= TG <= G or not 1 <= k <= TG * E // G:
        return (f"n_routed_experts={E}, n_group={G}, topk_group={TG}, num_experts_per_tok={k} (need groups of "
                "at least 2 experts, topk_group <= n_group, k <= the experts of topk_group groups)")
    if f["v_head_dim"] > f["qk_nope_head_dim"] + f["qk_rope_head_dim"]:
        return (f"v_head_dim={f['v_head_dim']} > qk_nope_head_dim + qk_rope_head_dim (v is padded to q/k's "
                "dim for the attention kernels, never the other way)")
    if f["qk_rope_head_dim"] % 2 or min(f["kv_lora_rank"], f["qk_rope_head_dim"], f["v_head_dim"]) < 1:
        return f"qk_rope_head_dim={f['qk_rope_head_dim']} must be even, kv_lora_rank and v_head_dim >= 1"
    return None


def _write(cfg: M.LlamaConfig, d: dict) -> None:
    """Extension.write: DeepSeek-V3's keys. head_dim is transformers' qk_rope_head_dim."""
    d |= {"head_dim": cfg.qk_rope_head_dim, "attention_bias": cfg.attention_bias,
          "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
          "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
          "first_k_dense_replace": len(cfg.mlp_only_layers), "num_nextn_predict_layers": 0,
          **{k: getattr(cfg, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim", "rope_interleave", "n_shared_experts", "n_group",
                                          "topk_group", "routed_scaling_factor")}}


def _check(cfg: M.LlamaConfig) -> None:
    """Extension.check: the router's groups, MLA's dims, the dense layers a prefix."""
    problem = _problem(dataclasses.asdict(cfg))
    if problem:
        raise ValueError(f"deepseek_v3: {problem}")
    if cfg.mlp_only_layers != tuple(range(len(cfg.mlp_only_layers))) or cfg.n_shared_experts < 1:
        raise ValueError(f"deepseek_v3: the dense layers must be the first ones (mlp_only_layers="
                         f"{cfg.mlp_only_layers}) and n_shared_experts={cfg.n_shared_experts} >= 1")


def _shapes(cfg: M.LlamaConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Extension.shapes: MLA's tensors in place of q/k/v/o, the sparse layers' router (its bias
    included: a state buffer), experts and shared experts in place of the MLP."""
    h, nh, E, mi = cfg.hidden_size, cfg.num_attention_heads, cfg.num_experts, cfg.moe_intermediate_size
    qk, r, b = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.attention_bias
    out = {}
    for name, shape in shapes.items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        p = f"model.layers.{layer}."
        if rest == "self_attn.q_proj.weight":  # MLA's, in transformers' order
            if cfg.q_lora_rank:
                out |= {p + "self_attn.q_a_proj.weight": (cfg.q_lora_rank, h),
                        **({p + "self_attn.q_a_proj.bias": (cfg.q_lora_rank,)} if b else {}),
                        p + "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
                        p + "self_attn.q_b_proj.weight": (nh * qk, cfg.q_lora_rank)}
            else:
                out[p + "self_attn.q_proj.weight"] = (nh * qk, h)
            out |= {p + "self_attn.kv_a_proj_with_mqa.weight": (r + cfg.qk_rope_head_dim, h),
                    **({p + "self_attn.kv_a_proj_with_mqa.bias": (r + cfg.qk_rope_head_dim,)} if b else {}),
                    p + "self_attn.kv_a_layernorm.weight": (r,),
                    p + "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
                    p + "self_attn.o_proj.weight": (h, nh * cfg.v_head_dim),
                    **({p + "self_attn.o_proj.bias": (h,)} if b else {})}
        elif rest.startswith("self_attn."):
            continue
        elif rest == "mlp.gate_proj.weight" and cfg.is_sparse(int(layer)):
            si = mi * cfg.n_shared_experts
            out |= {p + "mlp.gate.weight": (E, h), p + "mlp.gate.e_score_correction_bias": (E,),
                    p + "mlp.experts.gate_up_proj": (E, 2 * mi, h), p + "mlp.experts.down_proj": (E, h, mi),
                    p + "mlp.shared_experts.gate_proj.weight": (si, h),
                    p + "mlp.shared_experts.up_proj.weight": (si, h),
                    p + "mlp.shared_experts.down_proj.weight": (h, si)}
        elif not (rest.startswith("mlp.") and cfg.is_sparse(int(layer))):
            out[name] = shape
    return out


M.FAMILIES["deepseek_v3"] = ("DeepseekV3ForCausalLM", dict(
    qkv_bias=False, qk_norm=False, qk_norm_whole=False, mlp_bias=False, sliding_window=None, layer_types=None,
    decoder_sparse_step=1, output_router_logits=False))
M._DEFAULTS["deepseek_v3"] = dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=4096)
M._WINDOW["deepseek_v3"] = None
M.EXTENSIONS["deepseek_v3"] = M.Extension(_read, _write, _check, _shapes, use_deepseek, rope_types=("yarn",))


# --- refinement: YaRN, the long-context RoPE
# DeepSeek-V3's long-context RoPE (Peng et al. 2023, "YaRN"), as transformers' _compute_yarn_parameters:
# the high frequencies keep their value, the low ones are divided by `factor`, a linear ramp between.
# cos and sin are multiplied by attention_factor; MLA's softmax scale by mscale(factor, mscale_all_dim)².
def yarn_mscale(s: dict, key: str) -> float:
    """0.1 · s[key] · ln(factor) + 1, as transformers' yarn_get_mscale (1 without the key)."""
    return _mscale(s["factor"], s.get(key) or 0.0) if s.get(key) else 1.0


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_inv_freq(s: dict, dim: int, base: float, device: Any = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,), attention_factor) of YaRN parameters `s`."""
    factor, old = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    attention = s.get("attention_factor")
    if attention is None:
        both = s.get("mscale") and s.get("mscale_all_dim")
        attention = yarn_mscale(s, "mscale") / yarn_mscale(s, "mscale_all_dim") if both else _mscale(factor)
    # the dimension pair that turns `rotations` times over the original context
    at = lambda rotations: dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = at(fast), at(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)  # (dim/2,)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it was), 0: interpolate (divided by factor)
    return (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep, float(attention)


class YarnRotary(M.Rotary):
    """model.Rotary with YaRN's inverse frequencies and its attention_factor on cos and sin."""

    def reset_buffers(self) -> None:
        self.inv_freq, self.attention = yarn_inv_freq(self.cfg.rope_scaling, self.cfg.head_dim,
                                                      self.cfg.rope_theta, self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, S, hd/2)
        s = freqs.sin() * self.attention
        return ((torch.cat((freqs, freqs), dim=-1).cos() * self.attention).to(dtype),
                torch.cat((-s, s), dim=-1).to(dtype))


# --- refinement: aux-loss-free balancing
# DeepSeek-V3 §2.1.2: no auxiliary loss. After each step the bias of an overloaded expert falls by
# γ and an underloaded one's rises by γ: b_i += γ · sign(mean load − load_i). transformers loads
# and applies the bias but never trains it, so the rule is the paper's. The bias only steers the
# choice: the combine weights stay the plain scores, so the gradient is untouched.
# A layer's load is the picks of every token that layer routed in the step: all micro-batches,
# summed over the ranks that route tokens of their own (dp, which holds ep and cp, and tp under
# sp). tp ranks without sp route the same tokens: their loads are equal, not summed. A pipeline
# stage holds its layers alone, so each stage updates its own routers.


class BiasBalancer:
    """The bias update of every SigmoidRouter in `model`: `step()` once per optimizer step.
    Loads are recorded only inside the model's forward with gradients on. Activation
    checkpointing's recompute (in backward) and evaluation thus count nothing.
    groups: the process groups the loads are summed over, in turn (None entries are skipped)."""

    def __init__(self, model: nn.Module, speed: float, groups: list[Group] = ()):
        self.routers, self.speed, self.groups = routers(model), speed, [g for g in groups if g is not None]
        if not self.routers:
            raise ValueError("BiasBalancer: the model has no deepseek.SigmoidRouter")
        device = self.routers[0].e_score_correction_bias.device
        self.loads = torch.zeros(len(self.routers), self.routers[0].cfg.num_experts, dtype=torch.int64,
                                 device=device)  # (L, E) this step's picks
        self.handles = [model.register_forward_pre_hook(self._open), model.register_forward_hook(self._close)]

    def _open(self, model: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            for r, row in zip(self.routers, self.loads):
                r.loads = row  # a view: the router adds its picks in place

    def _close(self, model: nn.Module, args: tuple, out: Any) -> None:
        for r in self.routers:
            r.loads = None

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Sum the step's loads over the groups, move every bias by γ against its load error, and
        start the next step's count. Returns the summed loads (L, E), for logging."""
        loads = self.loads.clone()
        for g in self.groups:
            if dist.get_world_size(g) > 1:
                dist.all_reduce(loads, group=g)
        error = loads.float().mean(dim=1, keepdim=True) - loads.float()  # (L, E): > 0 underloaded
        for r, e in zip(self.routers, torch.sign(error)):
            r.e_score_correction_bias.add_(e, alpha=self.speed)
        self.loads.zero_()
        return loads

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def spread(loads: torch.Tensor) -> torch.Tensor:
    """How unevenly the experts are loaded: (L, E) loads → the mean over layers of max / mean."""
    loads = loads.float()
    return (loads.max(dim=1).values / loads.mean(dim=1)).mean()


# --- refinement: the presets
# For `python train.py --model dsv3-tiny`: the byte vocabulary (260), a dense first layer, 8 routed
# experts in 4 groups (2 of them per token), 2 picks, one shared expert, q and kv bottlenecks.
M.PRESETS |= {
    "dsv3-tiny": M.LlamaConfig(
        vocab_size=260, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=1024, model_type="deepseek_v3",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        router_aux_loss_coef=0.0, mlp_only_layers=(0,), q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, bias_update_speed=BIAS_UPDATE_SPEED),
    "dsv3-small": M.LlamaConfig(
        vocab_size=260, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, head_dim=16, max_position_embeddings=2048, model_type="deepseek_v3",
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True,
        router_aux_loss_coef=0.0, mlp_only_layers=(0,), q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, rope_interleave=True, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, bias_update_speed=BIAS_UPDATE_SPEED),
}


# --- refinement: the flags train.py refuses with this family
def refusals(args: Any, cfg: M.LlamaConfig) -> list[str]:
    """train.py's flags that do not combine with a deepseek_v3 model, each with its reason (cli.py
    adds them to its errors). Every other flag is tested (docs/models.md)."""
    if cfg.model_type != "deepseek_v3":
        return []
    why = {"--compile": "not tested with MLA and the sigmoid router yet",
           "--dpo": "not tested with deepseek_v3 yet", "--grpo": "not tested with deepseek_v3 yet"}
    # LoRA, FP8 and Muon: refused until tested with MLA and the router
    why |= {"--lora": "not tested with MLA's low-rank projections yet", "--fp8": "not tested with deepseek_v3 yet"}
    errors = [f"{flag} with a deepseek_v3 model: {reason}" for flag, reason in why.items()
              if getattr(args, flag[2:].replace("-", "_"), False)]
    if getattr(args, "optimizer", None) == "muon":
        errors.append("--optimizer muon with a deepseek_v3 model: not tested yet (its expert and MLA matrices)")
    return errors
