"""The probe models `actcfg verify`, the runtime tests and the benchmarks measure.

`linear_chain` is the seed model of the runtime issue (ten `Linear(2000, 2000)` layers, fp16);
`blocks` is a stack of pre-norm transformer blocks (class `Block`; with `parts=True`,
`PartedBlock`: the same arithmetic with its attention and MLP as submodules). Both take smaller
sizes for CPU tests; the defaults are the issue's sizes and need a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actcfg.errors import ActcfgError

__all__ = ["Attention", "Block", "BlockStack", "MLP", "PartedBlock", "blocks", "linear_chain"]


def _require_device(device: torch.device | str, name: str, on_cpu: str) -> None:
    """A sentence, not torch's "Torch not compiled with CUDA enabled" traceback, where the probe's
    default device (the GPU its sizes are for) is not here."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ActcfgError(f"actcfg.probes.{name} builds its model on the GPU (device='cuda', sized "
                          f"for one), and torch sees no CUDA GPU here: on the CPU, pass a device "
                          f"and a small size, e.g. {on_cpu}")


def linear_chain(
    n: int = 10,
    width: int = 2000,
    shape: tuple[int, ...] = (256, 256),
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cuda",
) -> tuple[nn.Sequential, torch.Tensor]:
    """`nn.Sequential` of `n` `nn.Linear(width, width)` and an input of shape `(*shape, width)`."""
    _require_device(device, "linear_chain",
                    "linear_chain(n=2, width=64, shape=(4,), dtype=torch.float32, device='cpu')")
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


class Attention(nn.Module):
    """`Block`'s attention half as a module: norm, causal self-attention, output projection
    (the residual is the block's)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    """`Block`'s MLP half as a module: norm, Linear up, GELU, Linear down."""

    def __init__(self, d_model: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class PartedBlock(nn.Module):
    """`Block`'s arithmetic with its halves as submodules, `attn` and `mlp`: each saves
    everything it saves inside itself, so `checkpoint.submodules: children` finds parts that
    hold the block's activations (`Block`'s children are single layers, and its attention and
    GELU run in its own forward). What split and split + offload plans are measured on."""

    def __init__(self, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attn = Attention(d_model, heads)
        self.mlp = MLP(d_model, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class BlockStack(nn.Module):
    """`n` `Block`s (`PartedBlock`s with `parts`) in a `ModuleList`, applied in order."""

    def __init__(self, n: int, d_model: int, heads: int, ffn: int, parts: bool = False) -> None:
        super().__init__()
        kind = PartedBlock if parts else Block
        self.blocks = nn.ModuleList(kind(d_model, heads, ffn) for _ in range(n))

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
    parts: bool = False,
) -> tuple[BlockStack, torch.Tensor]:
    """A `BlockStack` of `n` blocks (`PartedBlock`s with `parts`) and an input of shape
    `(batch, seq, d_model)`."""
    _require_device(device, "blocks", "blocks(n=2, d_model=64, heads=4, ffn=128, batch=2, seq=16, "
                                      "dtype=torch.float32, device='cpu')")
    model = BlockStack(n, d_model, heads, ffn, parts).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, d_model, device=device, dtype=dtype)
    return model, x
