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
