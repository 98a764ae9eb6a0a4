"""A SphereFormer-like LiDAR segmenter: a U-Net of five levels over voxels, a SphereFormer block at
each level, whose attention runs on half its heads within cubic windows and on the other half
within radial windows (narrow in azimuth and elevation, 80 m along the beam), both with SpTr's
contextual relative position through lowconv.compat.sptr. Along the beam the relative position is
split exponentially, as SphereFormer's split function does: a bucket per 1.25 cm near a point,
doubling in length every second bucket. Between levels the points are pooled to voxels twice as
large (SphereFormer downsamples with sparse convolutions; here a mean per voxel) and brought back
up at the end. 10 window-attention chains, all converted:

    lowconv inspect examples/sphereformer.py sparse-attention-bf16
    lowconv convert examples/sphereformer.py sparse-attention-bf16 -o out/

In Python, lowconv.load takes the example inputs too (the windows are found from the points, so
the sites are found again only on a run with them):

    converted = lowconv.load(build_model(), "out/", example_inputs=example_inputs())

lowconv model file: build_model() returns the model, example_inputs() its forward arguments
(feats, xyz, batch) for a synthetic two-scan LiDAR scene (point_transformer.py's).
"""
import math
from functools import partial

import torch
from torch import nn

from lowconv.compat import sptr
from point_transformer import CLASSES, KITTI_AZIMUTH_STEPS, VOXEL_SIZE, Mlp, synthetic_lidar_scene

LOGITS = True  # per-point class logits: the report adds KL divergence and top-1 agreement

N_POINTS = 1000
CHANNELS = (32, 32, 64, 64, 128)  # SphereFormer has 32, 64, 128, 256, 256; head_dim 16 as its
CUBIC_WINDOW = 0.3  # metres at the first level, doubling per level
SPHERE_WINDOW = (2.0, 2.0, 80.0)  # degrees of azimuth and elevation, metres of range; x1.5 per level in angle
GRID = 24  # quant cells per window side: quant size = window / 24
RADIAL_SPLIT = VOXEL_SIZE / 4  # a, the first radial bucket's length


def cartesian_to_spherical(xyz):
    """(azimuth, elevation from the zenith) in degrees and range in metres, per point."""
    x, y, z = xyz.unbind(1)
    azimuth = (torch.atan2(y, x) + math.pi) * (180 / math.pi)
    elevation = torch.atan2(torch.sqrt(x * x + y * y), z) * (180 / math.pi)
    return torch.stack([azimuth, elevation, torch.sqrt(x * x + y * y + z * z)], 1)


def exponential_split(xyz, index_0, index_1, relative_position_index, a=RADIAL_SPLIT):
    """SphereFormer's radial buckets of the range difference d between a query and a key: bucket
    0 is [0, a), 1 [a, 2a), 2 [2a, 4a), 3 [4a, 6a), 4 [6a, 10a), ... (each length used twice, then
    doubled), negative d mirrored to -1, -2, ...; written into the relative index's third column
    offset by GRID."""
    d = xyz[:, 2][index_0.long()] - xyz[:, 2][index_1.long()]
    size, positive = d.abs(), (d >= 0).float()
    octave = torch.floor(torch.log2((size + 2 * a) / a)) - 1  # bucket pairs [0, 2a), [2a, 6a), [6a, 14a), ...
    bucket = 2 * octave + ((3 * 2 ** octave - 2) * a <= size).float()
    relative_position_index[:, 2] = (bucket * (2 * positive - 1) + (positive - 1)).long() + GRID
    return relative_position_index


class SphereAttention(nn.Module):
    """Multi-head attention, the first half of the heads within cubic windows of xyz, the second
    within spherical windows (radial split), each with its own relative position tables;
    `rel_pos` False leaves relative position out, `radial_split` False the split (for benchmarks)."""

    def __init__(self, dim, level, rel_pos=True, radial_split=True):
        super().__init__()
        self.rel_pos, self.radial_split = rel_pos, radial_split
        self.heads, head_dim = dim // 16, 16
        self.scale = head_dim ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.cubic_window = sptr.to_3d_numpy(CUBIC_WINDOW * 2 ** level)
        angle = 1.5 ** level
        self.sphere_window = sptr.to_3d_numpy([SPHERE_WINDOW[0] * angle, SPHERE_WINDOW[1] * angle, SPHERE_WINDOW[2]])
        half = self.heads // 2
        # 2G-1 rows where rel_idx = P[i] - P[j] + G - 1; the split column reaches 2G-1 (2G rows)
        self.cubic_tables = nn.Parameter(torch.randn(3, 2 * GRID - 1, 3, half, head_dim) * 0.5)
        self.sphere_tables = nn.Parameter(torch.randn(3, 2 * GRID, 3, self.heads - half, head_dim) * 0.5)

    def branch(self, q, k, v, xyz, batch, window, tables, split_func=None):
        layout = sptr.get_indices_params(xyz, batch, window, False)
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = layout
        # int32 indices, as SphereFormer passes them: SpTr's CUDA ops take no others
        return sptr.sparse_self_attention(
            q, k, v, xyz, index_0.int(), index_0_offsets.int(), n_max, index_1.int(), index_1_offsets.int(), sort_idx,
            window, False,
            pe_type="contextual" if self.rel_pos else "none", rel_query=True, rel_key=True, rel_value=True,
            quant_size=window / GRID,
            quant_grid_length=GRID, relative_pos_query_table=tables[0], relative_pos_key_table=tables[1],
            relative_pos_value_table=tables[2], split_func=split_func)

    def forward(self, feats, xyz, batch):
        n, c = feats.shape
        q, k, v = self.qkv(feats).reshape(n, 3, self.heads, c // self.heads).unbind(1)
        q, half = q * self.scale, self.heads // 2
        cubic = self.branch(q[:, :half], k[:, :half], v[:, :half], xyz, batch, self.cubic_window, self.cubic_tables)
        split = partial(exponential_split, a=RADIAL_SPLIT) if self.radial_split else None
        sphere = self.branch(q[:, half:], k[:, half:], v[:, half:], cartesian_to_spherical(xyz), batch,
                             self.sphere_window, self.sphere_tables, split)
        return self.proj(torch.cat([cubic, sphere], 1).reshape(n, c))


class SphereFormerBlock(nn.Module):
    def __init__(self, dim, level, **attention):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), SphereAttention(dim, level, **attention)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 4 * dim)

    def forward(self, feats, xyz, batch):
        feats = feats + self.attn(self.norm1(feats), xyz, batch)
        return feats + self.mlp(self.norm2(feats))


def pool(feats, xyz, batch, voxel):
    """The points pooled to voxels of side `voxel` per scan: (mean feats, mean xyz, batch) of each
    occupied voxel, and each point's voxel."""
    cell = torch.floor(xyz / voxel).long()
    cell = cell - cell.amin(0)
    extent = cell.amax(0) + 1
    key = ((batch * extent[0] + cell[:, 0]) * extent[1] + cell[:, 1]) * extent[2] + cell[:, 2]
    voxels, parent, count = torch.unique(key, return_inverse=True, return_counts=True)
    order = torch.argsort(parent, stable=True)
    pooled_batch = batch.new_zeros(voxels.shape[0]).scatter(0, parent, batch)
    return segment_mean(feats, order, count), segment_mean(xyz, order, count), pooled_batch, parent


def segment_mean(x, order, count):
    """Each voxel's mean of the rows of x (x[order]: rows grouped by voxel, `count` rows each), each
    summed in order by one thread (segment_reduce): the same bits on every CUDA run, where
    index_add's atomic adds come in any order, and a mean xyz one ulp off can move a point across a
    window's edge."""
    return torch.segment_reduce(x[order], "mean", lengths=count, axis=0)


class SphereFormerNet(nn.Module):
    """Per-point classes from (x, y, z, intensity)."""

    def __init__(self, in_channels=4, classes=CLASSES):
        super().__init__()
        self.embed = nn.Linear(in_channels, CHANNELS[0])
        self.blocks = nn.ModuleList(SphereFormerBlock(dim, level) for level, dim in enumerate(CHANNELS))
        self.down = nn.ModuleList(nn.Linear(a, b) for a, b in zip(CHANNELS, CHANNELS[1:]))
        self.up = nn.ModuleList(nn.Linear(b, a) for a, b in zip(CHANNELS, CHANNELS[1:]))
        self.norm, self.head = nn.LayerNorm(CHANNELS[0]), nn.Linear(CHANNELS[0], classes)

    def forward(self, feats, xyz, batch):
        x, skips = self.embed(feats), []
        for level, block in enumerate(self.blocks):
            x = block(x, xyz, batch)
            if level < len(self.down):
                skips.append((x, xyz, batch))
                pooled, xyz, batch, parent = pool(x, xyz, batch, VOXEL_SIZE * 2 ** (level + 1))
                x = self.down[level](pooled)
                skips[-1] += (parent,)
        for level in reversed(range(len(self.up))):
            skip, xyz, batch, parent = skips[level]
            x = skip + self.up[level](x)[parent]
        return self.head(self.norm(x))


def build_model():
    return SphereFormerNet().eval()


def example_inputs():
    xyz, batch = synthetic_lidar_scene(N_POINTS, KITTI_AZIMUTH_STEPS)
    intensity = torch.rand(N_POINTS, 1)
    return torch.cat([xyz, intensity], 1), xyz, batch
