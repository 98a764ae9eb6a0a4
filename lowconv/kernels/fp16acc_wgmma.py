"""The fp16-accumulating split-K GEMM of fp16acc.py as a Gluon kernel for Hopper (sm_90): TMA loads
into a ring of shared-memory stages, wgmma with an fp16 accumulator on 128 x 256 output tiles.

Why a second kernel: the Triton kernel (fp16acc_triton.py) reaches about 65% of cuBLAS's speed at 4096^3
and 8192^3 on the H100: Triton 3.6 runs an fp16-accumulator wgmma synchronously and holds at most
128 x 128 tiles. This one issues each k-tile's wgmmas asynchronously, waits for them one tile
later, keeps up to STAGES tiles of TMA loads in flight, and holds 128 x 256 tiles (half the L2
traffic per MMA of 128 x 128).

Warp-specialized ping-pong: one warp issues the TMA loads; two consumer warpgroups each hold 64 x 256
of the tile (an fp32 total and an fp16 accumulator: 192 registers per thread, so the load warp
gives its registers to them). Each chunk ends with a fold of the fp16 accumulator into the total
(convert and add, 256 instructions per thread), during which a warpgroup issues no wgmma. Issued in
lockstep, both warpgroups folded at once and the tensor cores idled (at 4096^3 and 32 splits, a
fold every two k-tiles, about 15% of the time). So the consumers take turns of TURN_TILES k-tiles
(an mbarrier each; two tiles where they divide the chunk), consumer 1 a turn behind: each folds
while the other's last turn of the chunk runs. A stage is released (an mbarrier of count 2) once
both consumers' wgmmas on it completed. The ring holds 256 k-columns (4 stages of 64-wide k-tiles,
192 KB): that leaves no room for a separate output buffer, so each consumer stages its output
tile in its own x halves of the ring, which are idle by then (`schedule`).

Keeping the wgmmas in flight: ptxas serializes every wgmma of a kernel (its note C7514) where any
other instruction reads an accumulator register while a wgmma may still write it. Triton keeps an
fp16 accumulator as 16-bit values, so it unpacks the packed registers wherever the accumulator is
a loop-carried value or tied to a wait (`warpgroup_mma_wait(deps=(acc,))`), right after the
wgmma is issued. So a chunk of at most MAX_UNROLLED_TILES k-tiles is unrolled (UNROLLED_TILES,
one compile per chunk length) and its per-tile waits, which only free a stage for the next load,
are tied to a small dummy tensor: the accumulator then goes from wgmma to wgmma untouched and is
read once, after the chunk's last wait. Longer chunks (few splits of a long K) keep a loop over
their tiles, which carries the accumulator: there ptxas waits for each tile's wgmmas before the
loop's copies read them (its notes C7514 and C7517), so their tiles do not overlap, and the
consumers do not take turns. The cap: on the H100
(ptxas of triton 3.6), unrolled chains of 230 or more wgmma instructions (k16 steps) gave wrong
results, at 16-, 32- and 64-wide k-tiles alike, while chains of up to 225 equal the looped kernel
bit for bit; 32 k-tiles are at most 128 wgmmas. BENCHMARKS.md has the configs measured.

Numerics are fp16acc.py's, and on the H100 its output equals the Triton kernel's bit for bit:
chunk c of K (CHUNK_TILES k-tiles) is summed in an fp16 accumulator by k16 MMA steps and folded
into the tile's total (fp32, or fp16 for combine "fp16") in chunk order; then the bias in fp32 and
one rounding to fp16. Loads past M, N or K read zeros (TMA), which add nothing; so a chunk must be
whole k-tiles (`wgmma_tile_k`), and the last chunk may end past K.
Triton's interpreter cannot run Gluon: the CPU suite compiles this kernel for sm_90 (and checks
that ptxas keeps the unrolled chunks' wgmmas in flight), and the GPU tests compare it with the
Triton kernel. fp16acc_triton.py launches it through an op of its own (lowconv::fp16acc_wgmma, a
custom_op: Gluon kernels do not go through wrap_triton).
"""
import functools

import torch
from torch._subclasses.fake_tensor import is_fake
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lowconv.kernels.tile_order import grouped_tile
from lowconv.kernels.triton_ops import cdiv

BLOCK_M, BLOCK_N = 128, 256  # each of the two consumer warpgroups holds HALF_M x 256
HALF_M = BLOCK_M // 2
RING_K = BLOCK_N  # k-columns in the shared-memory ring: 4 stages of 64-wide k-tiles, 48 KB each
WARPGROUP = 4  # warps
# Registers per thread: the launch's cap over all 12 warps (two consumer warpgroups, one load warp
# in a warpgroup of its own) fits the register file; the load warp gives its share to the consumers.
MAX_REGISTERS = 168
LOAD_REGISTERS = gl.constexpr(24)
CONSUMER_REGISTERS = gl.constexpr(240)
MAX_UNROLLED_TILES = 32  # longest chunk whose k-tiles are unrolled (see the module doc)


def wgmma_tile_k(chunk_k: int) -> int:
    """The k-tile width for chunks of chunk_k: the widest of 64, 32, 16 that divides it."""
    return next(width for width in (64, 32, 16) if chunk_k % width == 0)


def wgmma_runs(x, w, multiprocessors: int) -> bool:
    """Whether the wgmma kernel takes x (M, K) @ w (N, K)^T into a new (M, N) output: an sm_90
    device; x and w each with one unit stride and 16-byte aligned rows, and N a multiple of 8 (the
    output's rows: what TMA reads and writes); and 128 x 256
    output tiles for at least 3/4 of the SMs. On the H100 at auto splits, while its wgmmas still
    ran serialized, it took 0.76-0.90x the Triton kernel's time from 128 tiles up (1.09x at 144: one
    wave and a ninth), and 1.3-1.6x at 32 and 64 tiles, where the Triton kernel's smaller tiles keep
    more SMs busy. Unrolling the chunks then cut its own time to 0.89-0.91x (4096^3, 8192^3, 13008 x 4096 x 1024,
    S = 32); at one k-tile per chunk (13008 x 1024 x 4096, S = 16) it stayed the same (1.00x)."""
    if not x.is_cuda or not is_sm90(x.device):
        return False
    tiles = cdiv(x.shape[0], BLOCK_M) * cdiv(w.shape[0], BLOCK_N)
    return 4 * tiles >= 3 * multiprocessors and w.shape[0] % 8 == 0 and all(
        wgmma_aligned(t) and 1 in t.stride() and max(t.stride()) % 8 == 0 for t in (x, w))


def wgmma_aligned(t: torch.Tensor) -> bool:
    """Whether t's data is 16-byte aligned, as TMA reads it. A fake tensor (torch.compile tracing)
    has no address: taken as aligned, which inductor's own buffers are; the op that launches the
    kernel checks again when it runs."""
    return is_fake(t) or t.data_ptr() % 16 == 0


@functools.cache
def is_sm90(device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.cache
def shared_layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of an fp16 (rows, cols) block (made once: a few
    microseconds of Python per call, on a launch that is host-bound for small GEMMs)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float16)


def operand_descriptor(t, rows: int, tile_k: int) -> tuple[TensorDescriptor, bool]:
    """A TMA descriptor of t (rows x K: x, or w) in (rows, tile_k) blocks where K is the unit stride
    (k-major), else of its transpose in (tile_k, rows) blocks; and whether it is k-major."""
    k_major = t.stride(1) == 1
    view = t if k_major else t.t()
    block = [rows, tile_k] if k_major else [tile_k, rows]
    return TensorDescriptor.from_tensor(view, block, shared_layout(*block)), k_major


def schedule(chunk_tiles: int, tile_k: int) -> dict:
    """The kernel's constexprs for chunks of chunk_tiles k-tiles of tile_k: UNROLLED_TILES (the
    chunk's length, or 0 for a looped chunk: module doc); TURN_TILES, the k-tiles a consumer issues
    per turn (two where they divide an unrolled chunk: half the handovers; looped chunks take no
    turns); STAGES, the ring's depth in k-tiles: RING_K columns of K. A consumer's x halves over
    the ring then hold RING_K x HALF_M fp16, its whole output block (HALF_M x BLOCK_N) as RING_K =
    BLOCK_N: the epilogue reuses them."""
    unrolled = chunk_tiles if chunk_tiles <= MAX_UNROLLED_TILES else 0
    return dict(UNROLLED_TILES=unrolled, TURN_TILES=2 if unrolled and unrolled % 2 == 0 else 1,
                STAGES=RING_K // tile_k)


def launch_fp16acc_wgmma(x, w, bias, out, chunk_k: int, splits: int, combine_fp32: bool):
    """out (M, N contiguous fp16) = x (M, K) @ w (N, K)^T + bias with the numerics of fp16acc.py
    (`splits` chunks of chunk_k)."""
    m, n = x.shape[0], w.shape[0]
    tile_k = wgmma_tile_k(chunk_k)
    x_desc, x_k_major = operand_descriptor(x, HALF_M, tile_k)
    w_desc, w_k_major = operand_descriptor(w, BLOCK_N, tile_k)
    out_desc = TensorDescriptor.from_tensor(out, [HALF_M, BLOCK_N], shared_layout(HALF_M, BLOCK_N))
    grid = (cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N),)
    chunk_tiles = chunk_k // tile_k
    _fp16acc_wgmma_kernel[grid](x_desc, w_desc, out_desc, bias if bias is not None else out, m, n, chunk_tiles, splits,
                                HAS_BIAS=bias is not None, COMBINE_FP32=combine_fp32, X_K_MAJOR=x_k_major,
                                W_K_MAJOR=w_k_major, **schedule(chunk_tiles, tile_k), num_warps=WARPGROUP,
                                maxnreg=MAX_REGISTERS)


@gluon.jit
def _load_partition(descs, buffers, bars, off_m, off_n, CHUNK_TILES, CHUNKS, X_K_MAJOR: gl.constexpr,
                    W_K_MAJOR: gl.constexpr):
    """One warp: the TMA loads of every k-tile (both halves of x's rows, and w's) into the ring,
    each stage once both consumers have released it."""
    x_desc, w_desc = descs[0], descs[1]
    x_smem, w_smem = buffers
    ready, empty = bars[0], bars[1]
    STAGES: gl.constexpr = w_smem.type.shape[0]
    TILE_K: gl.constexpr = x_desc.block_type.shape[1] if X_K_MAJOR else x_desc.block_type.shape[0]
    HALF_M: gl.constexpr = x_desc.block_type.shape[0] if X_K_MAJOR else x_desc.block_type.shape[1]
    for i in range(CHUNKS * CHUNK_TILES):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        k = i * TILE_K
        for half in gl.static_range(2):
            rows = off_m + half * HALF_M
            x_stage = x_smem.index(half * STAGES + stage)
            if X_K_MAJOR:
                tma.async_copy_global_to_shared(x_desc, [rows, k], bar, x_stage)
            else:
                tma.async_copy_global_to_shared(x_desc, [k, rows], bar, x_stage)
        if W_K_MAJOR:
            tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_smem.index(stage))
        else:
            tma.async_copy_global_to_shared(w_desc, [k, off_n], bar, w_smem.index(stage))


@gluon.jit
def _issue_tile(x_smem, w_smem, ready, i, acc, use_acc, HALF: gl.constexpr, X_K_MAJOR: gl.constexpr,
                W_K_MAJOR: gl.constexpr):
    """acc (+)= k-tile i's product for this consumer's half of the rows, issued asynchronously
    once the tile's load has landed."""
    STAGES: gl.constexpr = w_smem.type.shape[0]
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    a = x_smem.index(HALF * STAGES + stage)
    a = a if X_K_MAJOR else a.permute((1, 0))
    b = w_smem.index(stage).permute((1, 0)) if W_K_MAJOR else w_smem.index(stage)
    return warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _unrolled_chunk(x_smem, w_smem, ready, empty, turn, first, acc, tie, UNROLLED_TILES: gl.constexpr,
                    TURN_TILES: gl.constexpr, HALF: gl.constexpr, X_K_MAJOR: gl.constexpr, W_K_MAJOR: gl.constexpr):
    """The chunk's product (in flight), acc's value ignored. The consumers take turns of
    TURN_TILES k-tiles (which divides the chunk). After each tile's wgmmas, the wait for every
    earlier one lets this consumer release tile i - 1's stage; it is tied to `tie`, not to acc,
    so that nothing reads the accumulator while wgmmas run (module doc)."""
    STAGES: gl.constexpr = w_smem.type.shape[0]
    for t in gl.static_range(UNROLLED_TILES):
        if t % TURN_TILES == 0:  # consumer 0 goes first
            mbarrier.wait(turn.index(HALF), (((first + t) // TURN_TILES) & 1) ^ 1 ^ HALF)
        acc = _issue_tile(x_smem, w_smem, ready, first + t, acc, t > 0, HALF, X_K_MAJOR, W_K_MAJOR)
        if t % TURN_TILES == TURN_TILES - 1:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        tie = warpgroup_mma_wait(num_outstanding=1, deps=(tie,))
        if t > 0:
            mbarrier.arrive(empty.index((first + t - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _looped_chunk(x_smem, w_smem, ready, empty, first, acc, CHUNK_TILES, HALF: gl.constexpr,
                  X_K_MAJOR: gl.constexpr, W_K_MAJOR: gl.constexpr):
    """_unrolled_chunk for chunks too long to unroll: the loop carries acc, so its tiles do not overlap
    (ptxas waits for each one's wgmmas), and the consumers do not take turns: that would serialize
    the two as well."""
    STAGES: gl.constexpr = w_smem.type.shape[0]
    for t in range(CHUNK_TILES):
        acc = _issue_tile(x_smem, w_smem, ready, first + t, acc, t > 0, HALF, X_K_MAJOR, W_K_MAJOR)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((first + t - 1) % STAGES), count=1, pred=t > 0)
    return acc


@gluon.jit
def _mma_partition(descs, buffers, bars, off_m, off_n, CHUNK_TILES, CHUNKS, UNROLLED_TILES: gl.constexpr,
                   TURN_TILES: gl.constexpr, HAS_BIAS: gl.constexpr, COMBINE_FP32: gl.constexpr,
                   X_K_MAJOR: gl.constexpr, W_K_MAJOR: gl.constexpr, HALF: gl.constexpr):
    """One consumer warpgroup: rows HALF * HALF_M of the tile over every chunk, then their store.
    The two consumers take turns issuing TURN_TILES k-tiles' wgmmas, consumer 1 a turn behind:
    each folds its chunk into the total while the other's last turn of the chunk keeps the tensor
    cores busy (issued at once, both would fold at the same time)."""
    x_desc, w_desc, out_desc, bias, N = descs
    x_smem, w_smem = buffers
    ready, empty, turn = bars
    STAGES: gl.constexpr = w_smem.type.shape[0]
    HALF_M: gl.constexpr = x_desc.block_type.shape[0] if X_K_MAJOR else x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0] if W_K_MAJOR else w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    total = gl.zeros([HALF_M, BLOCK_N], gl.float32 if COMBINE_FP32 else gl.float16, layout)
    # two int32 per thread: the smallest tensor Triton's wait lowering takes as a dependency
    tie = gl.zeros([256], gl.int32, gl.BlockedLayout([2], [32], [4], [0]))
    acc = gl.zeros([HALF_M, BLOCK_N], gl.float16, layout)  # each chunk's first MMA ignores it
    for chunk in range(CHUNKS):
        first = chunk * CHUNK_TILES
        if UNROLLED_TILES > 0:
            acc = _unrolled_chunk(x_smem, w_smem, ready, empty, turn, first, acc, tie, UNROLLED_TILES, TURN_TILES,
                                  HALF, X_K_MAJOR, W_K_MAJOR)
        else:
            acc = _looped_chunk(x_smem, w_smem, ready, empty, first, acc, CHUNK_TILES, HALF, X_K_MAJOR, W_K_MAJOR)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((first + CHUNK_TILES - 1) % STAGES), count=1)
        total = (total.to(gl.float32) + acc.to(gl.float32)).to(total.dtype)

    y = total.to(gl.float32)
    if HAS_BIAS:
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        y += gl.expand_dims(gl.load(bias + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    # The store is staged in this consumer's x halves of the ring (schedule): its wgmmas are
    # done, every load into them has landed, and no other reads or fills them. The output's
    # 128-byte swizzle needs x's buffer 1024-byte aligned, which x's own layout does not ask for at
    # 16- and 32-wide k-tiles: Triton 3.6 places x after w (128 KB), and the GPU tests compare
    # every element at those widths with the Triton kernel.
    TILE_K: gl.constexpr = x_desc.block_type.shape[1] if X_K_MAJOR else x_desc.block_type.shape[0]
    gl.static_assert(STAGES * TILE_K == BLOCK_N, "the output tile is staged in the ring: RING_K must be BLOCK_N")
    out_smem = x_smem._reinterpret(gl.float16, [2, HALF_M, BLOCK_N], out_desc.layout).index(HALF)
    out_smem.store(y.to(gl.float16))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m + HALF * HALF_M, off_n], out_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _fp16acc_wgmma_kernel(x_desc, w_desc, out_desc, bias, M, N, CHUNK_TILES, CHUNKS, UNROLLED_TILES: gl.constexpr,
                          TURN_TILES: gl.constexpr, HAS_BIAS: gl.constexpr, COMBINE_FP32: gl.constexpr,
                          X_K_MAJOR: gl.constexpr, W_K_MAJOR: gl.constexpr, STAGES: gl.constexpr,
                          num_warps: gl.constexpr):
    """One (2 HALF_M, BLOCK_N) output tile over all CHUNKS chunks of CHUNK_TILES k-tiles (unrolled
    when UNROLLED_TILES, which then equals CHUNK_TILES, is not 0): a load warp and two consumer
    warpgroups (the default partition takes the first half of the rows)."""
    HALF_M: gl.constexpr = x_desc.block_type.shape[0] if X_K_MAJOR else x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0] if W_K_MAJOR else w_desc.block_type.shape[1]
    pid_m, pid_n = grouped_tile(M, N, 2 * HALF_M, BLOCK_N)
    off_m = pid_m * 2 * HALF_M
    off_n = pid_n * BLOCK_N
    x_smem = gl.allocate_shared_memory(gl.float16, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float16, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=2)  # released by both consumers
    for half in gl.static_range(2):
        mbarrier.init(turn.index(half), count=1)
    descs = (x_desc, w_desc, out_desc, bias, N)
    buffers = (x_smem, w_smem)
    bars = (ready, empty, turn)
    gl.warp_specialize([
        (_mma_partition, (descs, buffers, bars, off_m, off_n, CHUNK_TILES, CHUNKS, UNROLLED_TILES, TURN_TILES,
                          HAS_BIAS, COMBINE_FP32, X_K_MAJOR, W_K_MAJOR, 0)),
        (_mma_partition, (descs, buffers, bars, off_m, off_n, CHUNK_TILES, CHUNKS, UNROLLED_TILES, TURN_TILES,
                          HAS_BIAS, COMBINE_FP32, X_K_MAJOR, W_K_MAJOR, 1)),
        (_load_partition, (descs, buffers, bars, off_m, off_n, CHUNK_TILES, CHUNKS, X_K_MAJOR, W_K_MAJOR)),
    ], [num_warps, 1], [CONSUMER_REGISTERS, LOAD_REGISTERS])
