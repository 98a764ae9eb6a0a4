"""Serialized-patch attention as Point Transformer V3 writes it (Pointcept's SerializedAttention):
the points ordered along a space-filling curve (z-order of their grid cells), cut into patches of
PATCH_SIZE (the last one filled up with repeats of the last points), softmax(q k^T * scale [+
relative position bias]) v within each patch, the output put back in the points' order. Both of
PTv3's paths:
- without flash-attn (build_model(), PTv3's enable_flash=False): each block's patch attention is
  written out over (patches, heads, PATCH_SIZE, head_dim); with rel_pos=True the scores gain
  PTv3's relative position bias (a table per head, indexed by the clamped grid offset on each
  axis). lowconv finds it as a hand-written attention site, the bias as its additive mask.
- with flash-attn (SerializedNet(rel_pos=False, flash=True), PTv3's default): each block calls
  flash_attn.flash_attn_varlen_qkvpacked_func on the patches as segments of cu_seqlens, in fp16.
  lowconv finds each call as a varlen attention site and runs it on its window-attention kernel.

    lowconv inspect examples/serialized_attention.py sparse-attention-bf16
    lowconv convert examples/serialized_attention.py sparse-attention-bf16 -o out/

lowconv model file: build_model() returns the model, example_inputs() its forward argument
(points: x, y, z, intensity) for a synthetic scene.
"""
import torch
from torch import nn

try:
    import flash_attn
except ImportError:  # only the flash path calls it
    flash_attn = None

GRID_SIZE = 0.05  # metres per grid cell, PTv3's default
PATCH_SIZE = 128
CHANNELS, HEADS, DEPTH, CLASSES = 64, 4, 2, 8
N_POINTS = 1000


def z_order(grid: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """Each cell's Morton code: the bits of its (x, y, z) cell indices (N, 3), interleaved."""
    code = torch.zeros(grid.shape[0], dtype=torch.int64, device=grid.device)
    for bit in range(bits):
        for axis in range(3):
            code |= ((grid[:, axis] >> bit) & 1) << (3 * bit + axis)
    return code


def serialize(grid: torch.Tensor, patch_size: int):
    """The points' order along the curve, padded to whole patches with repeats of its last points
    (PTv3 pads each scan the same way), and each point's position in that order."""
    order = torch.argsort(z_order(grid))
    pad = -order.shape[0] % patch_size
    padded = torch.cat([order, order[order.shape[0] - pad:]])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    return padded, inverse


class RelativePositionBias(nn.Module):
    """PTv3's RPE: per head, a learned bias for each axis's grid offset within a patch, clamped to
    +-bound; the three axes' biases added."""

    def __init__(self, patch_size: int, heads: int):
        super().__init__()
        self.bound = int((4 * patch_size) ** (1 / 3) * 2)
        self.size = 2 * self.bound + 1
        self.table = nn.Parameter(torch.randn(3 * self.size, heads) * 0.02)

    def forward(self, offsets: torch.Tensor) -> torch.Tensor:
        """offsets (patches, K, K, 3) int64 -> bias (patches, heads, K, K)."""
        axes = torch.arange(3, device=offsets.device) * self.size
        index = offsets.clamp(-self.bound, self.bound) + self.bound + axes
        bias = self.table.index_select(0, index.reshape(-1)).view(index.shape + (-1,)).sum(3)
        return bias.permute(0, 3, 1, 2)


class SerializedAttention(nn.Module):
    def __init__(self, channels: int, heads: int, patch_size: int, rel_pos: bool, flash: bool = False):
        super().__init__()
        if flash and flash_attn is None:
            raise ImportError("flash=True calls flash-attn, which is not installed (pip install flash-attn)")
        if flash and rel_pos:
            raise ValueError("PTv3's flash path has no relative position bias: rel_pos=False with flash=True")
        self.heads, self.patch_size, self.scale = heads, patch_size, (channels // heads) ** -0.5
        self.flash = flash
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.softmax = nn.Softmax(dim=-1)
        self.rpe = RelativePositionBias(patch_size, heads) if rel_pos else None

    def forward(self, feat, grid, order, inverse):
        H, K, C = self.heads, self.patch_size, feat.shape[1]
        if self.flash:  # each patch one segment of cu_seqlens
            qkv = self.qkv(feat)[order]
            cu_seqlens = torch.arange(0, qkv.shape[0] + 1, K, dtype=torch.int32, device=qkv.device)
            out = flash_attn.flash_attn_varlen_qkvpacked_func(
                qkv.half().reshape(-1, 3, H, C // H), cu_seqlens, max_seqlen=K, dropout_p=0.0,
                softmax_scale=self.scale).reshape(-1, C)
            return self.proj(out.to(qkv.dtype)[inverse])
        q, k, v = self.qkv(feat)[order].reshape(-1, K, 3, H, C // H).permute(2, 0, 3, 1, 4).unbind(dim=0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.rpe is not None:
            patch_grid = grid[order].reshape(-1, K, 3)
            attn = attn + self.rpe(patch_grid.unsqueeze(2) - patch_grid.unsqueeze(1))
        attn = self.softmax(attn)
        out = (attn @ v).transpose(1, 2).reshape(-1, C)
        return self.proj(out[inverse])


class Block(nn.Module):
    def __init__(self, channels: int, heads: int, patch_size: int, rel_pos: bool, flash: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.attn = SerializedAttention(channels, heads, patch_size, rel_pos, flash)
        self.mlp = nn.Sequential(nn.Linear(channels, 4 * channels), nn.GELU(), nn.Linear(4 * channels, channels))

    def forward(self, feat, grid, order, inverse):
        feat = feat + self.attn(self.norm1(feat), grid, order, inverse)
        return feat + self.mlp(self.norm2(feat))


class SerializedNet(nn.Module):
    """Per-point classes from (x, y, z, intensity): DEPTH blocks of serialized-patch attention."""

    def __init__(self, rel_pos: bool = True, patch_size: int = PATCH_SIZE, flash: bool = False):
        super().__init__()
        self.patch_size = patch_size
        self.embed = nn.Linear(4, CHANNELS)
        self.blocks = nn.ModuleList(Block(CHANNELS, HEADS, patch_size, rel_pos, flash) for _ in range(DEPTH))
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, points):
        xyz = points[:, :3]
        grid = torch.floor((xyz - xyz.amin(0)) / GRID_SIZE).long()
        order, inverse = serialize(grid, self.patch_size)
        feat = self.embed(points)
        for block in self.blocks:
            feat = block(feat, grid, order, inverse)
        return self.head(feat)


def build_model():
    torch.manual_seed(0)
    return SerializedNet().eval()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    xyz = torch.rand(N_POINTS, 3, generator=g) * torch.tensor([20.0, 20.0, 3.0])
    return (torch.cat([xyz, torch.rand(N_POINTS, 1, generator=g)], 1),)
