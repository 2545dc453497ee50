"""A compact Llama, and the families built like it, with transformers' parameter names.

What it does
    Token embedding → L × (RMSNorm → GQA attention with RoPE → RMSNorm → SwiGLU MLP) → RMSNorm →
    lm_head, in plain PyTorch. `LlamaConfig.from_hf` reads HF configs, in transformers 4.x and 5
    spellings. Four families share one model, `model_type` llama, qwen2, qwen3 and mistral. Each
    difference is a named switch (FAMILIES). Qwen2 has q/k/v biases without the o bias. Qwen3
    normalizes each q and k head before RoPE. Mistral slides a window over every layer; Qwen2/3
    slide on the layers that say so. Files live in weights.py (`load_config`, `materialize`,
    `save_hf`, `load_hf`). So `save_pretrained` output loads here, and ours loads back in
    `AutoModelForCausalLM.from_pretrained` as the same family (docs/models.md).

Reference
    Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA), Shazeer 2020
    (SwiGLU), Jiang et al. 2023 (Mistral), Qwen team 2024/2025 (Qwen2, Qwen3). The numerics follow
    transformers/models/{llama,qwen2,qwen3,mistral}/modeling_*.py.

Run
    torchrun --nproc_per_node 1 train.py --model tiny --steps 20

Builds on: attention.py, ops.py, loss.py, and moe.py, deepseek.py for the refinements at the end
    attention.py: causal attention within packed documents. ops.py: the elementwise ops as lean
    autograd Functions. loss.py: lm_head and the loss without (T, V) logits. moe.py: the experts.

Invariants
    - `build` makes the model on the meta device, with no memory. `weights.materialize` fills it
      once tp and pp have cut it. A `Shard` says which slice of a global tensor a rank holds.
    - The model is unaware of parallelism. Head counts come from weight shapes. Layers live in a
      ModuleDict keyed by their global index, so a pipeline stage drops the ones it does not own.
      `embed_tokens`, `norm` and `lm_head` may be None: a middle stage maps hidden states to
      hidden states.
    - Plain attributes are the seams other files plug into. `loss_fn(hidden, weight, labels,
      reduction)` is lm_head and the loss in one; `logits_fn(logits)` returns full-vocab logits
      (tp.py's vocab-sharded head). `token_sum_fn` turns a sum over this rank's tokens into the sum
      over all tokens (tp.py's sp, cp.py). `Attention.attn_fn(q, k, v, docs)` is the attention
      itself (cp.py's ring swaps it). Families with keys of their own plug in as `FamilyKeys`.
    - The training loss never holds (T, V) logits (`loss.linear_cross_entropy`).
    - Packed rows: position_ids restart per document, and `docs` (attention.Documents) keeps
      attention inside each document. No S×S mask is built.
    - Each family equals transformers' class: logits, loss and grads within 1e-5, dense, packed and
      windowed (tests/test_families.py). Labels are already shifted (labels[t] is the token after
      input[t]); -100 is ignored.
    - `generate` decodes batched, greedy or sampled, with a KVCache. It gives the uncached decode's
      tokens, every family, tp1 and tp2, prompts of different lengths too (tests/test_generate.py).
    - RMSNorm, RoPE and SwiGLU run ops.py's autograd Functions: lean in eager, fused when compiled
      (`compile_layers`). In fp32 the forward is HF's to the bit.
    - Refinement at the end: three mixtures of experts (mixtral, qwen3_moe, olmoe). moe.py swaps
      their sparse layers' MLP and adds the router losses by forward hooks (docs/moe.md).
      deepseek.py registers deepseek_v3 through the same seam (docs/deepseek.md).
"""
from __future__ import annotations

import functools
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from attention import Documents, attend, attention_mask  # noqa: F401 (attention_mask: the dense reference)
from loss import linear_cross_entropy
from ops import apply_rope, rms_norm, swiglu  # noqa: F401 (tp.py uses rms_norm too)


# ----------------------------------------------------------------------------------------- config
# The families: transformers' model_type → (its CausalLM class, the switches the family fixes).
# One model serves them all. A switch the family leaves out is read from config.json.
#   llama    attention_bias (q, k, v and o), mlp_bias
#   qwen2    q/k/v biases, no o bias (qkv_bias); a sliding window on the layers layer_types names
#   qwen3    a per-head RMSNorm of q and k before RoPE (qk_norm), head_dim explicit (default 128);
#            attention_bias (all four); the window as qwen2
#   mistral  a sliding window on every layer whenever sliding_window is set
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaForCausalLM", dict(qkv_bias=False, qk_norm=False, sliding_window=None, layer_types=None)),
    "qwen2": ("Qwen2ForCausalLM", dict(qkv_bias=True, qk_norm=False, attention_bias=False, mlp_bias=False)),
    "qwen3": ("Qwen3ForCausalLM", dict(qkv_bias=False, qk_norm=True, qk_norm_whole=False, mlp_bias=False)),
    "mistral": ("MistralForCausalLM", dict(qkv_bias=False, qk_norm=False, attention_bias=False,
                                           mlp_bias=False, layer_types=None)),
}
# transformers' class defaults of the keys a config.json may omit, where they differ by family
_DEFAULTS = {
    "llama": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048),
    "qwen2": dict(num_key_value_heads=32, head_dim=None, max_position_embeddings=32768),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768),
    "mistral": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=131072,
                    sliding_window=4096),
}
# How a family reads its window from config.json (`_read_window`):
#   None      no window: transformers ignores the keys
#   "every"   every layer slides whenever sliding_window is set; layer_types is refused
#   "use"     every layer slides with use_sliding_window; layer_types is refused
#   "layers"  with use_sliding_window, the layers from max_window_layers on (or those layer_types names)
_WINDOW = {"llama": None, "qwen2": "layers", "qwen3": "layers", "mistral": "every"}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Extension:
    """The seam for a family that adds keys and modules (the MoE families at the end of this file).
    read(config.json dict, family, errors) → its fields. write(config, dict) adds its keys to the
    dict. check(config) raises on bad values. shapes(config, global shapes) → the shapes it changes.
    modules(model) swaps in its modules, in place, and returns the model (`build`).
    rope_types: the RoPE types besides default and llama3 that its modules compute.
    The defaults add nothing: a plain family's extension."""
    read: Callable[[dict, str, list[str]], dict] = lambda d, family, bad: {}
    write: Callable[["LlamaConfig", dict], None] = lambda cfg, d: None
    check: Callable[["LlamaConfig"], None] = lambda cfg: None
    shapes: Callable[["LlamaConfig", dict], dict] = lambda cfg, shapes: shapes
    modules: Callable[["Llama"], "Llama"] = lambda model: model
    rope_types: tuple[str, ...] = ()


EXTENSIONS: dict[str, Extension] = {family: Extension() for family in FAMILIES}  # model_type → what it adds


@dataclass
class LlamaConfig:
    """One config for the FAMILIES (the name is the first of them). The family switches:
    qkv_bias (q/k/v biases without attention_bias's o bias), qk_norm (per-head q/k RMSNorm),
    sliding_window with layer_types (which layers slide; None: all of them)."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v and o
    mlp_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"  # a key of FAMILIES: what export writes back
    qkv_bias: bool = False  # q, k, v only (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of every q and k head, before RoPE (Qwen3)
    qk_norm_whole: bool = False  # qk_norm over the whole projection, all heads at once
    sliding_window: int | None = None  # a query sees the last sliding_window positions, its own included
    layer_types: tuple[str, ...] | None = None  # per layer one of LAYER_TYPES; None: all slide (Mistral)
    # ---- refinement: a mixture of experts' fields (the Extension at the end of this file)
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int = 0  # per expert (Qwen3-MoE's key; Mixtral/OLMoE: intermediate_size)
    norm_topk_prob: bool = False  # renormalize the k weights (Mixtral always)
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False  # transformers adds coef · load-balancing loss only then
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: dense layers
    decoder_sparse_step: int = 1  # Qwen3-MoE: every step-th layer is sparse
    # ---- refinement: DeepSeek-V3's fields (deepseek.py: MLA, the sigmoid router, shared experts)
    q_lora_rank: int | None = None  # MLA: q through a rank-r bottleneck (None: one q_proj)
    kv_lora_rank: int = 0  # MLA: the latent that k and v are expanded from
    qk_nope_head_dim: int = 0  # the part of a q/k head without RoPE
    qk_rope_head_dim: int = 0  # the decoupled RoPE part (one key head shared by all heads)
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE on (x0, x1), (x2, x3), ... pairs
    n_shared_experts: int = 0  # one MLP of n_shared · moe_intermediate_size beside the routed experts
    n_group: int = 1  # group-limited routing: the experts in n_group groups,
    topk_group: int = 1  # of which each token may use topk_group
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = 0.0  # aux-loss-free balancing: the bias step per optimizer step

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (moe.py). Qwen3-MoE's rule; the other
        families have mlp_only_layers () and decoder_sparse_step 1."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """Read an HF `config.json` dict of a family in FAMILIES: transformers 4.x and 5 spellings,
        and the family's defaults for omitted keys. Missing keys, wrong types and unsupported values
        raise one error naming them all, each with its key and value."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        bad = _hf_type_errors(d)
        if bad:
            raise ValueError("; ".join(bad))
        family = d.get("model_type", "llama")
        if family not in FAMILIES:
            raise ValueError(f"unsupported model family: model_type={family!r} (supported: "
                             f"{', '.join(map(repr, FAMILIES))})")
        defaults = _DEFAULTS[family]
        if d.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act={d['hidden_act']!r} (only 'silu')")
        if d.get("pretraining_tp", 1) not in (1, None):
            bad.append(f"pretraining_tp={d['pretraining_tp']} (only 1)")
        if d.get("attention_dropout", 0.0) != 0:
            bad.append(f"attention_dropout={d['attention_dropout']} (only 0.0)")
        # transformers 5 writes rope_parameters (with rope_theta inside); 4.x wrote rope_theta + rope_scaling
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", defaults.get("rope_theta", 10000.0)))
        if not _NUM[0](theta):
            bad.append(f"rope_theta must be {_NUM[1]}, got {theta!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if any(isinstance(v, dict) for v in rope.values()):
            bad.append(f"rope_parameters={rope} (one RoPE per layer type: only one for all layers)")
        elif rope_type not in ("default", "llama3", *EXTENSIONS[family].rope_types):
            bad.append(f"rope_type={rope_type!r} (only 'default', 'llama3'"
                       + "".join(f", {t!r}" for t in EXTENSIONS[family].rope_types) + ")")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            bad.append(f"partial_rotary_factor={rope['partial_rotary_factor']} (only 1.0)")
        own = EXTENSIONS[family].read(d, family, bad)
        window, layer_types = _read_window(d, family, bad)
        if bad:
            raise ValueError(f"unsupported {family} config values: " + "; ".join(bad))
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        read = dict(attention_bias=d.get("attention_bias", False), mlp_bias=d.get("mlp_bias", False),
                    sliding_window=window, layer_types=layer_types)
        cfg = cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads,
            head_dim=d.get("head_dim", defaults["head_dim"]) or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", defaults["max_position_embeddings"]),
            rms_norm_eps=d.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            initializer_range=d.get("initializer_range", 0.02), bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos, model_type=family,
            **{**read, **own, **FAMILIES[family][1]},  # what the family fixes, transformers ignores in the file
        )
        cfg.validate()
        return cfg

    def to_hf(self) -> dict:
        """config.json of this family: every key its transformers class reads."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id")
        d = {k: getattr(self, k) for k in keys}
        if self.model_type == "qwen2" and self.head_dim == self.hidden_size // self.num_attention_heads:
            del d["head_dim"]  # not a Qwen2Config field (transformers reads it only where given)
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default",
                                **(self.rope_scaling or {})}
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if _WINDOW[self.model_type] in ("every", "use"):
            d["sliding_window"] = self.sliding_window
        if _WINDOW[self.model_type] == "use":
            d["use_sliding_window"] = self.sliding_window is not None
        EXTENSIONS[self.model_type].write(self, d)
        if _WINDOW[self.model_type] == "layers":  # transformers derives the window from these four
            types = [self.layer_type(i) for i in range(self.num_hidden_layers)]
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
            d |= {"use_sliding_window": bool(sliding),
                  "sliding_window": self.sliding_window if sliding else None,
                  "max_window_layers": sliding[0] if sliding else self.num_hidden_layers,
                  "layer_types": types}
        return {"architectures": [FAMILIES[self.model_type][0]], "model_type": self.model_type,
                "hidden_act": "silu", "attention_dropout": 0.0, "torch_dtype": "float32", **d}

    def layer_type(self, layer: int) -> str:
        """"sliding_attention" or "full_attention": what decoder layer `layer` runs."""
        if self.sliding_window is None:
            return "full_attention"
        return "sliding_attention" if self.layer_types is None else self.layer_types[layer]

    def window(self, layer: int) -> int | None:
        """Decoder layer `layer`'s sliding window, or None: plain causal attention. A query attends
        to the positions p - window < j <= p (transformers' sliding mask)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def validate(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
        bad = [f"{k}={getattr(self, k)}" for k in sizes if not getattr(self, k) >= 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: must be at least 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type={self.model_type!r}: not one of {', '.join(map(repr, FAMILIES))}")
        switches = FAMILIES[self.model_type][1]
        fixed = [f"{k}={getattr(self, k)!r}" for k, v in switches.items() if getattr(self, k) != v]
        if fixed:
            raise ValueError(f"model_type={self.model_type!r} has {', '.join(fixed)}: the family fixes "
                             f"{switches}")
        if self.sliding_window is not None and not self.sliding_window >= 1:
            raise ValueError(f"sliding_window={self.sliding_window}: must be at least 1 (or None)")
        rope_type = (self.rope_scaling or {}).get("rope_type", "llama3")
        if rope_type not in ("llama3", *EXTENSIONS[self.model_type].rope_types):
            raise ValueError(f"rope_scaling={self.rope_scaling}: {self.model_type} computes llama3 only")
        EXTENSIONS[self.model_type].check(self)
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                             or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types={self.layer_types}: one of {LAYER_TYPES} per layer "
                             f"({self.num_hidden_layers})")

    def num_params(self) -> int:
        return sum(math.prod(s) for s in global_shapes(self).values())


def _read_window(d: dict, family: str, bad: list[str]) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers' family class derives them from config.json,
    by the family's rule in _WINDOW."""
    rule, types = _WINDOW[family], d.get("layer_types")
    if rule is None:
        return None, None
    if rule != "layers" and types is not None:
        bad.append(f"layer_types={types} (transformers' {FAMILIES[family][0]} ignores it)")
    if rule == "every":
        return d.get("sliding_window", _DEFAULTS[family]["sliding_window"]), None
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    if rule == "use":
        return window, None
    if types is None:
        first = d.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(d["num_hidden_layers"])]
    if len(types) != d["num_hidden_layers"] or not set(types) <= set(LAYER_TYPES):
        bad.append(f"layer_types={types} (one of {', '.join(LAYER_TYPES)} per layer, "
                   f"num_hidden_layers={d['num_hidden_layers']})")
    elif "sliding_attention" in types and window is None:
        bad.append(f"layer_types={types} with sliding_window=None (use_sliding_window="
                   f"{d.get('use_sliding_window', False)}): sliding layers without a window")
    if window is None or "sliding_attention" not in types:
        return None, None
    return window, tuple(types)


# config.json keys read here: (required, type check, what the check means)
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer")
_ID = (lambda v: v is None or isinstance(v, int) and not isinstance(v, bool) and v >= 0,
       "a token id (integer >= 0) or null")
_NUM = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_HF_KEYS = {
    "vocab_size": (True, *_INT), "hidden_size": (True, *_INT), "intermediate_size": (True, *_INT),
    "num_hidden_layers": (True, *_INT), "num_attention_heads": (True, *_INT),
    "num_key_value_heads": (False, lambda v: v is None or _INT[0](v), "a positive integer or null"),
    "head_dim": (False, lambda v: v is None or _INT[0](v), "a positive integer or null"),
    "max_position_embeddings": (False, *_INT), "rms_norm_eps": (False, *_NUM),
    "rope_theta": (False, *_NUM), "initializer_range": (False, *_NUM),
    "rope_parameters": (False, lambda v: v is None or isinstance(v, dict), "an object or null"),
    "rope_scaling": (False, lambda v: v is None or isinstance(v, dict), "an object or null"),
    "tie_word_embeddings": (False, *_BOOL), "attention_bias": (False, *_BOOL), "mlp_bias": (False, *_BOOL),
    "bos_token_id": (False, *_ID), "use_sliding_window": (False, *_BOOL),
    "sliding_window": (False, lambda v: v is None or _INT[0](v), "a positive integer or null"),
    "max_window_layers": (False, lambda v: _ID[0](v) and v is not None, "an integer >= 0"),
    "layer_types": (False, lambda v: v is None or isinstance(v, list), "a list or null"),
    "eos_token_id": (False, lambda v: _ID[0](v) or isinstance(v, list) and len(v) > 0
                     and all(_ID[0](x) and x is not None for x in v), "a token id, a list of them or null"),
}


def _hf_type_errors(d: dict) -> list[str]:
    """Missing required keys and values of the wrong type, one line each, naming the key."""
    bad = []
    for key, (required, ok, what) in _HF_KEYS.items():
        if key not in d:
            if required:
                bad.append(f"missing key {key!r}")
        elif not ok(d[key]):
            bad.append(f"{key!r} must be {what}, got {d[key]!r}")
    return bad


# Presets for random init. vocab 260 = the built-in byte tokenizer of data.py (256 bytes + 4 specials).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=1024),
    "small": LlamaConfig(vocab_size=260, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         max_position_embeddings=2048),
    "1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=8192, rope_theta=500000.0),  # Llama-3-8B's shape
}


def global_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF name → full (unsharded) shape of every parameter."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if cfg.attention_bias or cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (q,) if cfg.qk_norm_whole else (hd,),
                       p + "self_attn.k_norm.weight": (kv,) if cfg.qk_norm_whole else (hd,)}
        if cfg.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,),
                       p + "mlp.down_proj.bias": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return EXTENSIONS[cfg.model_type].shapes(cfg, shapes)


# ----------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with the llama3 long-context rescaling when configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if not cfg.rope_scaling or cfg.rope_scaling.get("rope_type", "llama3") != "llama3":
        return inv  # no scaling, or one an Extension's modules compute (validate checks which)
    s = cfg.rope_scaling
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s.get("original_max_position_embeddings", cfg.max_position_embeddings)
    wavelen = 2 * math.pi / inv
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """The RoPE tables of the positions, (B, S, hd) each. They are computed once per forward and
    shared by all layers and their backward. cos is HF's. sin has rotate_half's sign folded in:
    HF's sin = cat(s, s) becomes cat(-s, s), so rotating needs no rotate_half (`RoPEFunction`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.cfg, self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, S, hd/2)
        s = freqs.sin()
        return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-s, s), dim=-1).to(dtype)


class Attention(nn.Module):
    """GQA with RoPE. The family switches: q/k/v biases (attention_bias or qkv_bias), an o bias
    (attention_bias), a per-head RMSNorm of q and k before RoPE (qk_norm), a sliding window."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        hd, b = cfg.head_dim, cfg.attention_bias or cfg.qkv_bias
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=b)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        # Qwen3: one (hd,) weight shared by every head. tp replicates it; each rank's heads add to its grad.
        # qk_norm_whole: one weight over the whole projection, its statistics over all heads
        self.qk_norm_whole = cfg.qk_norm_whole
        qn, kn = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd) if cfg.qk_norm_whole else (hd, hd)
        self.q_norm = RMSNorm(qn, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kn, cfg.rms_norm_eps) if cfg.qk_norm else None
        # this layer's sliding window (None: causal). attn_fn honours it, as must any swapped attn_fn.
        self.window = cfg.window(layer)
        # the seam for other attention algorithms (cp.py's ring): (q, k, v, docs) → (B, S, nh, hd)
        self.attn_fn: Callable[..., torch.Tensor] = (attend if self.window is None
                                                      else functools.partial(attend, window=self.window))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | torch.Tensor | None, *, cache: "LayerCache | None" = None) -> torch.Tensor:
        B, S, _ = x.shape
        hd = self.head_dim
        # head counts come from the (possibly tp-sharded) weights, never from the config
        q = self.q_proj(x).view(B, S, -1, hd)  # (B, S, nh, hd)
        k = self.k_proj(x).view(B, S, -1, hd)  # (B, S, nkv, hd)
        v = self.v_proj(x).view(B, S, -1, hd)  # (B, S, nkv, hd)
        if self.q_norm is not None and self.qk_norm_whole:  # over all heads at once
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:  # over hd, per head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, cos, sin)
        # with a cache: this call's S positions follow the cached ones (generation, below)
        y = self.attn_fn(q, k, v, docs) if cache is None else cache.attend(q, k, v, self)  # (B, S, nh, hd)
        return self.o_proj(y.reshape(B, S, -1))  # (B, S, nh*hd) → (B, S, H)


class SwiGLU(nn.Module):
    """The MLP's activation as a module of its own, with no parameters (no state_dict name). It is
    a cheap op: ac.py's selective mode reruns it in backward instead of keeping its output."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | torch.Tensor | None, *, cache: "LayerCache | None" = None) -> torch.Tensor:
        # cache as a keyword: tp's pre-hooks on self_attn see the four positional arguments only
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, docs, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `LlamaModel` (the `model.` prefix of every parameter name)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn: Callable[..., torch.Tensor] = linear_cross_entropy
        self.logits_fn: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits
        # a sum over this rank's tokens → the sum over all tokens of the forward's rows. tp.py (sp)
        # and cp.py all-reduce it: each rank holds only some of the tokens.
        self.token_sum_fn: Callable[[torch.Tensor], torch.Tensor] = lambda total: total

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, reduction: str = "mean", *,
                docs: Documents | torch.Tensor | None = None, cache: "KVCache | None" = None) -> torch.Tensor:
        """input_ids (B, S) token ids, or hidden states (B, S, H) on a stage without embeddings.
        position_ids (B, S): None means 0..S-1. Given, attention stays within each document: a new
        one starts wherever the position does not continue. docs: those boundaries, built once
        where the rows are (attention.Documents), or a dense (B, 1, S, S) bool mask (the reference).
        Returns the loss with labels, else logits (B, S, V); hidden states on a stage without
        lm_head. cache: a KVCache (generation, below)."""
        m = self.model
        h = m.embed_tokens(input_ids) if m.embed_tokens is not None else input_ids  # (B, S, H)
        position_ids, docs = self.positions(h, position_ids, docs, cache, labels)
        cos, sin = m.rotary_emb(position_ids, h.dtype)  # (B, S, hd) each
        for name, layer in m.layers.items():
            h = layer(h, cos, sin, docs) if cache is None else layer(h, cos, sin, docs, cache=cache.layer(name))
        if cache is not None:
            h = cache.advance(h)  # (B, 1, H): generation reads each row's next token only
        if m.norm is not None:
            h = m.norm(h)
        return self.head(h, labels, reduction)

    def positions(self, h: torch.Tensor, position_ids: torch.Tensor | None, docs: Documents | torch.Tensor | None,
                  cache: "KVCache | None", labels: torch.Tensor | None) -> tuple[torch.Tensor, Documents | None]:
        """The call's positions (B, S) and documents. Without docs, they come from position_ids (a
        host copy per call). With a cache, each row continues from its cached end."""
        B, S = h.shape[:2]
        if cache is not None:
            if position_ids is not None or docs is not None or labels is not None:
                raise ValueError("a KVCache takes plain rows: no position_ids, docs or labels")
            return cache.positions(B, S, h.device), None
        if position_ids is None:
            if docs is not None:
                raise ValueError("docs (document boundaries) need the position_ids restarting per document")
            return torch.arange(S, device=h.device).expand(B, S), None
        return position_ids, Documents.from_position_ids(position_ids) if docs is None else docs

    def head(self, h: torch.Tensor, labels: torch.Tensor | None, reduction: str) -> torch.Tensor:
        """h (B, S, H) → the loss with labels, else logits (B, S, V); h itself on a stage without lm_head."""
        if self.lm_head is None:
            return h
        if labels is None:
            return self.logits_fn(self.lm_head(h))  # (B, S, V)
        return self.loss_fn(h, self.lm_head.weight, labels, reduction)  # lm_head inside, in chunks


# ----------------------------------------------------------------------------------------- compile
def _eager_where_needed(attn_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """attn_fn for a compiled layer. attention.attend on plain rows is traced. Packed rows run
    eagerly between two compiled graphs: Documents hold host lengths that change every batch, which
    would recompile. So does any other attention in the seam (cp.py's ring: its custom op is not
    checked under compile here)."""
    eager, traced = torch.compiler.disable(attn_fn), attn_fn is attend

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             docs: Documents | torch.Tensor | None) -> torch.Tensor:
        return attn_fn(q, k, v, docs) if traced and not isinstance(docs, Documents) else eager(q, k, v, docs)
    return attn


def compile_layers(model: Llama, packed: bool = False, **options) -> list[str]:
    """torch.compile each decoder layer's forward (torchtitan does the same). Inductor fuses the
    elementwise ops between the matmuls (norms, RoPE, SwiGLU, residual adds) and their backward.
    What runs in the layer's `__call__` but outside its forward stays eager: hooks on the layer
    (ZeRO-3's gathers, the output-gradient hooks). So does everything outside the layers: embedding,
    head, loss, the pipeline executor, dp/ZeRO's gradient hooks (they fire on AccumulateGrad).
    Apply after tp (its comm ops inside the layer are traced) and after ac.apply_ac. The layer's
    checkpoint is then traced too: full AC as compile's recomputation, selective AC through
    compile's own policy path. Apply before the optimizer. Layers of one shape share one compiled
    graph (the parameters are graph inputs). ac.remove_ac removes the compiled forward with the AC one.
    A submodule that sets `compile_eager = True` runs eagerly between two graphs of its layer
    (a block whose shapes depend on the data). Returns what is left eager, for train.py's log.
    First the name of each layer left eager whole: a checkpointed layer would break the graph
    inside the checkpoint, and dynamo then runs the whole checkpoint eagerly. That happens when its
    attention runs eagerly (`packed` rows, i.e. Documents, or another attn_fn such as cp.py's ring)
    or it holds an eager submodule. Then "<layer>.<path>" of each eager submodule of a compiled layer."""
    eager, blocks = [], []
    for name, layer in model.model.layers.items():
        own = layer.__dict__.get("forward")  # ac.py's closure, if checkpointed
        kept = [(f"{name}.{path}", m) for path, m in layer.named_modules() if getattr(m, "compile_eager", False)]
        if own is not None and (packed or layer.self_attn.attn_fn is not attend or kept):
            eager.append(name)
            continue
        layer.self_attn.attn_fn = _eager_where_needed(layer.self_attn.attn_fn)
        for path, block in kept:  # an instance forward (a wrapper) as it is; else as below, no cycle
            forward = block.__dict__.get("forward") or (
                lambda *args, fn=type(block).forward, ref=weakref.ref(block), **kwargs: fn(ref(), *args, **kwargs))
            block.forward = torch.compiler.disable(forward)  # the whole wrapper: dynamo skips its frame
            blocks.append(path)
        if own is not None:
            fn = torch.compile(own, **options)
            forward = functools.wraps(own)(lambda *args, fn=fn, **kwargs: fn(*args, **kwargs))
        else:  # the class's forward, the layer passed in through a weakref: no layer → forward cycle
            fn, ref = torch.compile(type(layer).forward, **options), weakref.ref(layer)
            forward = lambda *args, fn=fn, ref=ref, **kwargs: fn(ref(), *args, **kwargs)  # noqa: E731
        forward.compiled = True
        layer.forward = forward
    return eager + blocks


# ----------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class Shard:
    """This rank holds rows [start, start+size) of the global tensor along `dim`. Rows at or past the
    global size are padding (e.g. a vocab padded to a multiple of tp): zero, never read or written."""
    dim: int
    start: int
    size: int


def build(cfg: LlamaConfig) -> Llama:
    """The model on the meta device: no memory, no init yet (see `weights.materialize`)."""
    cfg.validate()
    with torch.device("meta"):
        return EXTENSIONS[cfg.model_type].modules(Llama(cfg))


# ----------------------------------------------------------------------------------------- generation
# Prefill, then decode. The prompt's keys and values are computed once and kept (RoPE already
# applied, so a cached key never changes); each new token then costs one position's forward instead
# of the whole prefix's. A layer's cache has the shape of its own k_proj output, so under tp a rank
# caches only its nkv/tp heads. Memory: 2 · layers · B · (S + new) · nkv · hd values. The cache keeps
# every position and masks what a sliding window no longer sees (a ring buffer of `window` slots
# would bound it; not built).
class KVCache:
    """Every layer's keys and values (LayerCache, made on first use, keyed as model.model.layers), room
    for `capacity` positions a row. `ends` (B,): the positions each row holds (None until the
    prefill); `length`: the columns written, on the host (the longest row's end), which the capacity
    check reads without a device sync. The prefill's rows may be right-padded prompts of `lengths`
    (B,) real tokens (None: every row full). Causal attention keeps the padding after a prompt out of
    its tokens' sight. Each later call appends its positions at each row's own end, over that
    padding, and masks the keys past a row's end."""

    def __init__(self, capacity: int, lengths: torch.Tensor | None = None):
        self.capacity, self.lengths, self.length = capacity, lengths, 0
        self.ends: torch.Tensor | None = None
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> "LayerCache":
        return self.layers.setdefault(name, LayerCache(self))

    def positions(self, B: int, S: int, device: torch.device) -> torch.Tensor:
        """(B, S) the positions of a call's S tokens: each row continues from its end."""
        new = torch.arange(S, device=device)
        return new.expand(B, S) if self.ends is None else self.ends[:, None] + new

    def advance(self, h: torch.Tensor) -> torch.Tensor:
        """After a call's layers: each row's end moves past its new tokens; h (B, S, H) → (B, 1, H),
        the hidden state at each row's last real position."""
        B, S = h.shape[:2]
        if self.ends is None:  # the prefill: a right-padded prompt ends at its own length
            last = (torch.full((B,), S, device=h.device) if self.lengths is None
                    else self.lengths.to(h.device)) - 1  # (B,) within this call
            self.ends = last + 1
        else:  # S new positions a row
            last, self.ends = torch.full((B,), S - 1, device=h.device), self.ends + S
        self.length += S
        return h[torch.arange(B, device=h.device), last][:, None]  # (B, 1, H)


class LayerCache:
    """One attention layer's keys and values, (B, capacity, nkv, hd) each; row b's valid up to ends[b]."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @torch.compiler.disable  # host-side state: runs eagerly between a compiled layer's graphs
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Append k, v (B, S, nkv, hd) at each row's end. Then attend the S new queries q (B, S, nh, hd)
        to the row's keys up to each query: causal, within attn's window. The first call (the
        prefill) is the layer's own attention (attn.attn_fn): the uncached forward's to the bit."""
        B, S = k.shape[:2]
        P = self.cache.length
        if P + S > self.cache.capacity:
            raise ValueError(f"KVCache full: {P} + {S} positions > capacity {self.cache.capacity}")
        if self.k is None:  # the prefill: rows from slot 0
            self.k = k.new_zeros(B, self.cache.capacity, *k.shape[2:])  # (B, capacity, nkv, hd)
            self.v = v.new_zeros(B, self.cache.capacity, *v.shape[2:])
            self.k[:, :S], self.v[:, :S] = k, v
            return attn.attn_fn(q, k, v, None)
        slots = self.cache.ends[:, None] + torch.arange(S, device=q.device)  # (B, S): each row's next
        rows = torch.arange(B, device=q.device)[:, None]  # (B, 1)
        self.k[rows, slots], self.v[rows, slots] = k, v
        gap = slots[:, :, None] - torch.arange(P + S, device=q.device)  # (B, S, P+S): query − key slot
        see = gap >= 0 if attn.window is None else (gap >= 0) & (gap < attn.window)  # (B, S, P+S)
        return attend(q, self.k[:, :P + S], self.v[:, :P + S], see[:, None])  # (B, S, nh, hd)


M32 = 0xFFFFFFFF  # the sampler's hash works on 32-bit words held in int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective hash of 32-bit words held in int64 (lowbias32's xor-shift-multiply shape).
    Both multipliers are odd and below 2^31, so every product stays below 2^63: no overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """seeds (B,) int64 ≥ 0, a decode step → (B, vocab) fp32 standard Gumbel noise.
    Counter-based: cell (b, t) is a pure function of (seeds[b], step, t). No generator state,
    so a row's draws never depend on its batch, and the whole batch is one chain of kernels.
    u keeps 24 bits: exact in fp32, within (0, 1). So the noise is finite, at most about 17.3."""
    row = _mix32(_mix32(_mix32(seeds & M32) ^ (seeds >> 32)) ^ step)  # (B,): the row's key at this step
    token = torch.arange(vocab, device=seeds.device)  # (V,)
    h = _mix32(_mix32(row[:, None] ^ token) ^ row[:, None])  # (B, V)
    u = ((h >> 8).float() + 0.5) * 2.0**-24  # (B, V) in (0, 1)
    return -torch.log(-torch.log(u))


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               seeds: torch.Tensor | None = None, step: int = 0) -> torch.Tensor:
    """logits (B, V) → (B,) token ids: argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k logits (all if None). Row b draws with seeds[b]
    at this decode step. Gumbel-max: argmax(logits / T + g) with g standard Gumbel is distributed
    as softmax(logits / T). One batched chain, no per-row kernel, no host sync."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return (logits + gumbel_noise(seeds, step, logits.shape[-1])).argmax(-1)


@torch.no_grad()
def generate(model: Llama, input_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None = None, *,
             temperature: float = 0.0, top_k: int | None = None, seeds: Sequence[int] | None = None,
             use_cache: bool | None = None, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Batched decoding, input_ids (B, S) → (B, S + n), n <= max_new_tokens. Greedy at temperature
    0, else sampled (next_token) with one seed per row. A row's reply then depends on its prompt and
    seed only, not on its batch. Rows that emitted eos_id keep emitting it; decoding stops when all have.
    lengths: prompts of different lengths, right-padded: row b's prompt is input_ids[b, :lengths[b]].
    Its reply then starts at lengths[b], over the padding, and the cells after it hold eos_id (0
    without one). None: every prompt is all S tokens.
    use_cache: prefill once, then one position per step (KVCache). False reruns the whole prefix
    every step: the reference, the same tokens in fp32 (tests/test_generate.py). None: the cache
    whenever model.forward takes one. Any causal model mapping ids (B, S) to logits runs uncached.
    Under tp every rank sees the same gathered logits and seeds, hence draws the same tokens."""
    B, S = input_ids.shape
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(f"temperature={temperature} must be >= 0 and top_k={top_k} >= 1 (or None)")
    if temperature > 0 and (seeds is None or len(seeds) != B):
        raise ValueError(f"sampling (temperature={temperature}) needs one seed per row: {B} rows, "
                         f"seeds={seeds}")
    if lengths is not None and (len(lengths) != B or not all(1 <= n <= S for n in lengths)):
        raise ValueError(f"lengths={lengths}: one per row, each within 1..{S} (the prompts' width)")
    keys = torch.tensor([int(s) % 2**63 for s in seeds], device=input_ids.device) if temperature > 0 else None
    if use_cache is None:
        use_cache = "cache" in inspect.signature(model.forward).parameters
    ends = torch.tensor(lengths if lengths is not None else [S] * B, device=input_ids.device)  # (B,)
    cache = KVCache(S + max_new_tokens, ends if lengths is not None else None) if use_cache else None
    rows = torch.arange(B, device=input_ids.device)
    fill = torch.full((B, 1), 0 if eos_id is None else eos_id, dtype=input_ids.dtype, device=input_ids.device)
    was_training = model.training
    model.eval()
    out, done, nxt = input_ids, torch.zeros(B, dtype=torch.bool, device=input_ids.device), None
    try:
        for t in range(max_new_tokens):
            if cache is None:  # the whole prefix again; causal, so a row's cells past its end change nothing
                logits = model(out)[rows, ends - 1]  # (B, V)
            else:
                logits = model(out if nxt is None else nxt[:, None], cache=cache)[:, -1]  # (B, V)
            nxt = next_token(logits, temperature, top_k, keys, t)  # (B,)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            out = torch.cat([out, fill], dim=1)  # (B, S + t + 1)
            out[rows, ends] = nxt  # each row's next cell: the new column when its prompt is all S
            ends = ends + 1
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return out


# ----------------------------------------------------------------------------------------- refinement: mixtures of experts
# Three families, through the Extension seam: moe.py swaps their sparse layers' MLP for an
# MoE block (`build`), and its hooks add the router losses.
#   mixtral    every layer sparse, the k weights always renormalized; the window as mistral
#   qwen3_moe  qwen3's per-head q/k norm; layer i sparse unless in mlp_only_layers or
#              (i + 1) % decoder_sparse_step != 0; the window on every layer with use_sliding_window
#   olmoe      every layer sparse; the q/k RMSNorm spans the whole projection (all heads), no window
import moe  # noqa: E402 (the refinement's own file: the core above needs none of it)

MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
for _dense in FAMILIES:  # a stray num_experts key is ignored, as by transformers
    FAMILIES[_dense][1]["num_experts"] = 0
FAMILIES |= {
    "mixtral": ("MixtralForCausalLM", dict(qkv_bias=False, qk_norm=False, attention_bias=False, mlp_bias=False,
                                           layer_types=None, norm_topk_prob=True, mlp_only_layers=(),
                                           decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(qkv_bias=False, qk_norm=True, qk_norm_whole=False,
                                              mlp_bias=False, layer_types=None)),
    "olmoe": ("OlmoeForCausalLM", dict(qkv_bias=False, qk_norm=True, qk_norm_whole=True, mlp_bias=False,
                                       sliding_window=None, layer_types=None, mlp_only_layers=(),
                                       decoder_sparse_step=1)),
}
_DEFAULTS |= {
    "mixtral": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=131072, sliding_window=None,
                    rms_norm_eps=1e-5, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                    router_aux_loss_coef=0.001),
    "qwen3_moe": dict(num_key_value_heads=4, head_dim=None, max_position_embeddings=32768, num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768, router_aux_loss_coef=0.001),
    "olmoe": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  num_experts=64, num_experts_per_tok=8, router_aux_loss_coef=0.01),
}
_WINDOW |= {"mixtral": "every", "qwen3_moe": "use", "olmoe": None}
_HF_KEYS |= {
    "num_experts": (False, *_INT), "num_local_experts": (False, *_INT), "num_experts_per_tok": (False, *_INT),
    "moe_intermediate_size": (False, *_INT), "decoder_sparse_step": (False, *_INT),
    "norm_topk_prob": (False, *_BOOL), "output_router_logits": (False, *_BOOL),
    "router_aux_loss_coef": (False, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                             "a number >= 0"),
    "mlp_only_layers": (False, lambda v: v is None or isinstance(v, list) and all(_ID[0](x) and x is not None
                                                                                  for x in v),
                        "a list of layer indices or null"),
}


def _read_experts(d: dict, family: str, bad: list[str]) -> dict:
    """Extension.read: an MoE family's fields, with the family's defaults. What is not
    implemented goes to `bad`, naming the key and its value."""
    defaults = _DEFAULTS[family]
    # transformers maps num_experts and num_local_experts to one attribute: either spelling is read
    given = {d[k] for k in ("num_experts", "num_local_experts") if k in d}
    if len(given) > 1:
        bad.append(f"num_experts={d['num_experts']} != num_local_experts={d['num_local_experts']}")
    if d.get("router_jitter_noise", 0.0):  # Mixtral's training-time input jitter
        bad.append(f"router_jitter_noise={d['router_jitter_noise']} (only 0.0)")
    if d.get("clip_qkv") is not None:  # OLMoE's clamp of q, k and v
        bad.append(f"clip_qkv={d['clip_qkv']} (only null)")
    if family == "olmoe" and d.get("head_dim") not in (None, d["hidden_size"] // d["num_attention_heads"]):
        bad.append(f"head_dim={d['head_dim']} (OLMoE's q/k norms assume hidden_size / num_attention_heads)")
    return dict(num_experts=given.pop() if given else defaults["num_experts"],
                num_experts_per_tok=d.get("num_experts_per_tok", defaults["num_experts_per_tok"]),
                moe_intermediate_size=(d.get("moe_intermediate_size", defaults["moe_intermediate_size"])
                                       if family == "qwen3_moe" else d["intermediate_size"]),
                norm_topk_prob=d.get("norm_topk_prob", False),
                router_aux_loss_coef=float(d.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])),
                output_router_logits=d.get("output_router_logits", False),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                decoder_sparse_step=d.get("decoder_sparse_step", 1))


def _write_experts(cfg: LlamaConfig, d: dict) -> None:
    """Extension.write: the MoE keys of cfg's family into config.json's dict d."""
    if cfg.model_type == "qwen3_moe":
        d |= {"attention_bias": cfg.attention_bias, "moe_intermediate_size": cfg.moe_intermediate_size,
              "norm_topk_prob": cfg.norm_topk_prob, "mlp_only_layers": list(cfg.mlp_only_layers),
              "decoder_sparse_step": cfg.decoder_sparse_step}
    if cfg.model_type == "olmoe":
        d |= {"attention_bias": cfg.attention_bias, "norm_topk_prob": cfg.norm_topk_prob}
        del d["head_dim"]  # OLMoE derives it (hidden_size / heads)
    d |= {"num_experts" if cfg.model_type == "olmoe" else "num_local_experts": cfg.num_experts,
          "num_experts_per_tok": cfg.num_experts_per_tok, "router_aux_loss_coef": cfg.router_aux_loss_coef,
          "output_router_logits": cfg.output_router_logits}


def _check_experts(cfg: LlamaConfig) -> None:
    """Extension.check: the sizes of the experts, and OLMoE's head size."""
    if not (1 <= cfg.num_experts_per_tok <= cfg.num_experts and cfg.moe_intermediate_size >= 1):
        raise ValueError(f"{cfg.model_type}: need 1 <= num_experts_per_tok={cfg.num_experts_per_tok} <= "
                         f"num_experts={cfg.num_experts} and moe_intermediate_size="
                         f"{cfg.moe_intermediate_size} >= 1")
    if cfg.model_type == "olmoe" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"olmoe: head_dim={cfg.head_dim} × num_attention_heads={cfg.num_attention_heads} "
                         f"must be hidden_size={cfg.hidden_size} (its q norm spans hidden_size)")


def _expert_shapes(cfg: LlamaConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Extension.shapes: a sparse layer's MLP entries become its router's and experts', in their
    place. transformers 5's fused in-memory layout (weights.py writes one tensor per expert)."""
    e, h, mi = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = {}
    for name, shape in shapes.items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if not (rest.startswith("mlp.") and cfg.is_sparse(int(layer))):
            out[name] = shape
        elif rest == "mlp.gate_proj.weight":  # the other MLP entries are dropped
            p = f"model.layers.{layer}.mlp."
            out |= {p + "gate.weight": (e, h), p + "experts.gate_up_proj": (e, 2 * mi, h),
                    p + "experts.down_proj": (e, h, mi)}
    return out


EXTENSIONS |= {f: Extension(_read_experts, _write_experts, _check_experts, _expert_shapes, moe.use_experts)
               for f in MOE_FAMILIES}

import deepseek  # noqa: E402,F401 (registers model_type deepseek_v3: MLA and its router)
