"""Models attotron did not write, for the copy-one-file tests (tests/test_foreign*.py).

- `hf_causal_lm(family)`: transformers' own LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM,
  tiny, fp32, in transformers' layout (`model.model.layers` a ModuleList, keyword calls, ModelOutput).
- `GPT`: a small nanoGPT-style model written here the way such models are written: fused qkv
  (`c_attn`), LayerNorm, GELU MLP, learned positions (`wpe`), a head tied to the embedding, and a
  forward `(idx, targets=None) -> (logits, loss)` that calls `F.scaled_dot_product_attention` itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 97


def hf_causal_lm(family: str = "llama", seed: int = 0, layers: int = 4, **kw) -> nn.Module:
    """A tiny transformers model of `family` (llama, qwen2, mistral) in fp32, eval mode."""
    import transformers as T

    config_cls, model_cls = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
    }[family]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     **kw)
    return model_cls(cfg).eval()


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = VOCAB
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v fused
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # sizes from the weights and self.n_head, not from C: tensor parallelism (tp.Parts.heads)
        # gives this module its rank's heads only (numerically the same as split(C) / view(B, T, C))
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 × (B, T, nh·hd)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = cfg = cfg or GPTConfig()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss
