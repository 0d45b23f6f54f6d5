"""The probe models `actcfg verify`, the runtime tests and the benchmarks measure.

`linear_chain` is the seed model of the runtime issue (ten `Linear(2000, 2000)` layers, fp16);
`blocks` is a stack of pre-norm transformer blocks (class `Block`). Both take smaller sizes
for CPU tests; the defaults are the issue's sizes and need a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "BlockStack", "blocks", "linear_chain"]


def linear_chain(
    n: int = 10,
    width: int = 2000,
    shape: tuple[int, ...] = (256, 256),
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cuda",
) -> tuple[nn.Sequential, torch.Tensor]:
    """`nn.Sequential` of `n` `nn.Linear(width, width)` and an input of shape `(*shape, width)`."""
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(n))).to(device=device, dtype=dtype)
    x = torch.randn(*shape, width, device=device, dtype=dtype)
    return model, x


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class BlockStack(nn.Module):
    """`n` `Block`s in a `ModuleList`, applied in order."""

    def __init__(self, n: int, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, heads, ffn) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def blocks(
    n: int = 8,
    d_model: int = 2048,
    heads: int = 16,
    ffn: int = 8192,
    batch: int = 8,
    seq: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
) -> tuple[BlockStack, torch.Tensor]:
    """A `BlockStack` of `n` blocks and an input of shape `(batch, seq, d_model)`."""
    model = BlockStack(n, d_model, heads, ffn).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, d_model, device=device, dtype=dtype)
    return model, x
