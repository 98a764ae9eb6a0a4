"""The launch order of a GEMM's output tiles, shared by the fp16acc kernels (Triton and Gluon)."""
import triton
import triton.language as tl

GROUP_M = tl.constexpr(8)  # tile rows per band in the launch order, so bands of W stay in L2


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """program_id(0) -> (tile row, tile column), GROUP_M tile rows at a time down each column band."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % band) % rows, (pid % band) // rows
