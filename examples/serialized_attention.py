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
And what PTv3 left out for its cost (its ablation: contextual relative position +66% latency):
- SerializedNet(rel_pos=False, contextual=True): each block's patches attended by lowconv's
  window-attention kernel with SpTr's contextual relative position (three learned tables, terms
  of q, k and v: SphereFormer's), on each point's coordinates within its patch
  (patch_coordinates). The model calls lowconv.kernels.window_attention itself: a design choice
  of the model, not a conversion (nothing in PTv3's call says where its points lie).

    lowconv inspect examples/serialized_attention.py sparse-attention-bf16
    lowconv convert examples/serialized_attention.py sparse-attention-bf16 -o out/

lowconv model file: build_model() returns the model, example_inputs() its forward argument
(points: x, y, z, intensity) for a synthetic scene.
"""
import torch
from torch import nn

from lowconv.kernels.window_attention import window_attention

try:
    import flash_attn
except ImportError:  # only the flash path calls it
    flash_attn = None

GRID_SIZE = 0.05  # metres per grid cell, PTv3's default
PATCH_SIZE = 128
# Contextual relative position: coordinates within a patch in cells of CONTEXT_CELLS grid cells
# (0.2 m), CONTEXT_GRID of them per axis (4.8 m from the patch's least cell; farther points share
# the last), so tables of 2 * CONTEXT_GRID - 1 rows, SpTr's size at its default quantization.
CONTEXT_CELLS, CONTEXT_GRID = 4, 24
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


def patch_coordinates(grid: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Each serialized point's cell (N, 3) in [0, CONTEXT_GRID-1] within its patch: its grid cell
    less the patch's least on each axis, in units of CONTEXT_CELLS, the last cell taking the rest.
    grid: (N, 3) cells in serialized order, N a multiple of patch_size."""
    patches = grid.reshape(-1, patch_size, 3)
    within = (patches - patches.amin(1, keepdim=True)) // CONTEXT_CELLS
    return within.clamp(max=CONTEXT_GRID - 1).reshape(-1, 3)


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
    def __init__(self, channels: int, heads: int, patch_size: int, rel_pos: bool, flash: bool = False,
                 contextual: bool = False):
        super().__init__()
        if flash and flash_attn is None:
            raise ImportError("flash=True calls flash-attn, which is not installed (pip install flash-attn)")
        if (flash or contextual) and rel_pos:
            raise ValueError("PTv3's relative position bias is its own path's: rel_pos=False with flash=True or "
                             "contextual=True")
        if flash and contextual:
            raise ValueError("contextual=True runs lowconv's kernel in place of flash-attn's: one of the two")
        self.heads, self.patch_size, self.scale = heads, patch_size, (channels // heads) ** -0.5
        self.flash = flash
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.softmax = nn.Softmax(dim=-1)
        self.rpe = RelativePositionBias(patch_size, heads) if rel_pos else None
        # SpTr's tables (L, 3, heads, head_dim) for q, k and v, initialised as SphereFormer's
        self.contextual = nn.ParameterList(
            nn.Parameter(nn.init.trunc_normal_(torch.empty(2 * CONTEXT_GRID - 1, 3, heads, channels // heads),
                                               std=0.02))
            for _ in range(3)) if contextual else None

    def forward(self, feat, grid, order, inverse):
        H, K, C = self.heads, self.patch_size, feat.shape[1]
        if self.contextual is not None:  # each patch one window of lowconv's kernel
            q, k, v = self.qkv(feat)[order].reshape(-1, 3, H, C // H).unbind(dim=1)
            offsets = torch.arange(0, q.shape[0] + 1, K, device=q.device)
            out = window_attention(q, k, v, offsets, scale=self.scale, coords=patch_coordinates(grid[order], K),
                                   tables=tuple(self.contextual), validate=False)
            return self.proj(out.reshape(-1, C)[inverse])
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
    def __init__(self, channels: int, heads: int, patch_size: int, rel_pos: bool, flash: bool, contextual: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.attn = SerializedAttention(channels, heads, patch_size, rel_pos, flash, contextual)
        self.mlp = nn.Sequential(nn.Linear(channels, 4 * channels), nn.GELU(), nn.Linear(4 * channels, channels))

    def forward(self, feat, grid, order, inverse):
        feat = feat + self.attn(self.norm1(feat), grid, order, inverse)
        return feat + self.mlp(self.norm2(feat))


class SerializedNet(nn.Module):
    """Per-point classes from (x, y, z, intensity): DEPTH blocks of serialized-patch attention."""

    def __init__(self, rel_pos: bool = True, patch_size: int = PATCH_SIZE, flash: bool = False,
                 contextual: bool = False):
        super().__init__()
        self.patch_size = patch_size
        self.embed = nn.Linear(4, CHANNELS)
        self.blocks = nn.ModuleList(Block(CHANNELS, HEADS, patch_size, rel_pos, flash, contextual)
                                    for _ in range(DEPTH))
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
