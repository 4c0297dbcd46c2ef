"""A GPT-2-style decoder-only Transformer (Radford et al. 2019): pre-LayerNorm blocks, causal multi-head
self-attention written out (softmax over a mask built from the input's shape), GELU MLP, dropout, and an
output projection tied to the token embedding (tied weights)."""
from __future__ import annotations

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)
        k = k.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)
        v = v.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attention = self.attn_dropout(torch.softmax(scores, dim=-1))
        out = (attention @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(out))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, seq_len: int = 1024,
                 vocab_size: int = 50257, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied weights

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        return self.lm_head(self.ln_f(self.blocks(x)))
