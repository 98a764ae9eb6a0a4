"""2:4 semi-structured sparsity: pruning, the compressed-tensors bitmask format, and the linear.

2:4 runs along the last dim (K for a weight (N, K) and for an activation (..., K)): of every 4
consecutive values, 2 are kept.

Bitmask format (compressed-tensors' "sparse-24-bitmask", which vLLM reads):
    compressed  (rows, cols/2)       the kept values of each row, in row-major order
    bitmask     uint8 (rows, ceil(cols/8))   mask bit of column c is bit (c % 8) of byte c // 8,
                                     least significant bit first (numpy.packbits bitorder="little"),
                                     the last byte of a row zero-padded
    shape       int64 (2, 1)         [[rows], [cols]], the dense shape
The mask is the 2:4 mask, not `!= 0`: a group with fewer than 2 nonzeros still keeps 2 values
(zeros among them), so every row holds exactly cols/2 values.
"""
import itertools

import torch
import torch.nn.functional as F


def mask_24(x: torch.Tensor) -> torch.Tensor:
    """Bool mask keeping the 2 largest-|magnitude| values of each group of 4 along the last dim.

    Ties go to the lower index (stable sort), so the mask is deterministic.
    """
    if x.shape[-1] % 4:
        raise ValueError(f"2:4 sparsity needs the last dim divisible by 4, got shape {tuple(x.shape)}")
    groups = x.detach().abs().reshape(*x.shape[:-1], -1, 4)
    order = groups.argsort(dim=-1, descending=True, stable=True)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, order[..., :2], True)
    return mask.reshape(x.shape)


def transposable_patterns() -> torch.Tensor:
    """The 90 4x4 bool patterns with exactly 2 kept in every row and every column, (90, 16)."""
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]  # 6 ways to keep 2 of 4
    blocks = [block for block in itertools.product(rows, repeat=4) if all(sum(col) == 2 for col in zip(*block))]
    return torch.tensor(blocks, dtype=torch.bool).reshape(len(blocks), 16)


def mask_24_transposable(w: torch.Tensor) -> torch.Tensor:
    """Bool mask of a 2D (rows, cols) tensor that is 2:4 along cols AND along rows (so that w^T,
    which the backward GEMM dX = dY w multiplies, is 2:4 too): in every 4x4 block, the pattern
    with 2 kept per row and per column that keeps the most magnitude (exhaustive over the 90).
    Keeps at most what mask_24 keeps; ties go to the first pattern, so it is deterministic."""
    if w.dim() != 2 or w.shape[0] % 4 or w.shape[1] % 4:
        raise ValueError(f"transposable 2:4 sparsity needs a 2D tensor with both dims divisible by 4, "
                         f"got shape {tuple(w.shape)}")
    rows, cols = w.shape
    blocks = w.detach().abs().float().reshape(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    patterns = transposable_patterns().to(w.device)
    best = (blocks @ patterns.float().t()).argmax(dim=1)
    return patterns[best].reshape(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)


def prune_24(x: torch.Tensor) -> torch.Tensor:
    """x with the 2 smaller-magnitude values of each group of 4 (last dim) set to zero."""
    return torch.where(mask_24(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def prune_24_straight_through(x: torch.Tensor) -> torch.Tensor:
    """prune_24 forward, identity backward: the dense tensor gets the whole gradient (torchao's
    runtime sparsity), so pruned entries keep learning and may win their group back."""
    return x + (prune_24(x) - x).detach()


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool (rows, cols) -> uint8 (rows, ceil(cols/8)), little-endian bits within each byte."""
    rows, cols = mask.shape
    padded = F.pad(mask.to(torch.uint8), (0, -cols % 8))
    weights = 1 << torch.arange(8, dtype=torch.int32, device=mask.device)
    return (padded.reshape(rows, -1, 8).int() * weights).sum(-1).to(torch.uint8)


def unpack_bits(bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 (rows, ceil(cols/8)) -> bool (rows, cols); inverse of pack_bits."""
    bits = (bitmask.int().unsqueeze(-1) >> torch.arange(8, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :cols].bool()


def compress_bitmask(w_pruned: torch.Tensor):
    """2:4-pruned (rows, cols) -> (compressed (rows, cols/2), bitmask uint8, shape int64 (2, 1))."""
    if w_pruned.dim() != 2:
        raise ValueError(f"compress_bitmask takes a 2-D tensor, got shape {tuple(w_pruned.shape)}")
    rows, cols = w_pruned.shape
    mask = mask_24(w_pruned)
    if (w_pruned[~mask] != 0).any():
        raise ValueError("compress_bitmask: the tensor is not 2:4 sparse (prune it with prune_24 first)")
    compressed = w_pruned[mask].reshape(rows, cols // 2)
    shape = torch.tensor([[rows], [cols]], dtype=torch.int64)
    return compressed, pack_bits(mask), shape


def decompress_bitmask(compressed: torch.Tensor, bitmask: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """The dense 2:4 tensor that compress_bitmask stored (bit-exact)."""
    rows, cols = shape.flatten().tolist()
    mask = unpack_bits(bitmask, cols)
    if mask.shape != (rows, cols) or compressed.shape != (rows, cols // 2):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} and compressed {tuple(compressed.shape)} "
                         f"do not match the dense shape ({rows}, {cols})")
    dense = torch.zeros(rows, cols, dtype=compressed.dtype, device=compressed.device)
    dense[mask] = compressed.flatten()
    return dense


def semi_sparse_linear_reference(x: torch.Tensor, w_pruned: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Masked dense product: fp32 accumulation, one rounding to x's dtype (as the sparse GEMM)."""
    y = x.float() @ w_pruned.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def semi_sparse_linear(x: torch.Tensor, w_pruned: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x w_pruned^T + b with a 2:4 operand (the weight, or x itself). The entry point: checks
    its inputs and runs the masked-dense reference (on every device for now; cuSPARSELt plugs in
    here)."""
    if w_pruned.dim() != 2 or x.shape[-1] != w_pruned.shape[1]:
        raise ValueError(f"semi_sparse_linear: x {tuple(x.shape)} and w {tuple(w_pruned.shape)} do not match "
                         f"(w is (N, K))")
    if w_pruned.shape[1] % 4:
        raise ValueError(f"semi_sparse_linear: K={w_pruned.shape[1]} is not divisible by 4")
    return semi_sparse_linear_reference(x, w_pruned, bias)
