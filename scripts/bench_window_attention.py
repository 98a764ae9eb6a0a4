"""Time window_attention's Triton kernels against the pair-list torch reference (SpTr's
formulation) at the SpTr scale: N = 268,720 points, h = 4, head_dim 16, fp16, windows of mean 10
("dense") and mean 3 ("kitti"), relative position off and on (G = 24, L = 47).

On the lent GPU:  PYTHONPATH=. python3 scripts/bench_window_attention.py
Forward errors vs the float64 reference are checked before anything is timed; times are
triton.testing.do_bench medians of the whole call (input checks included), memory is the peak
allocated above the inputs during one call.
"""
import torch
import triton

import lowconv.kernels.window_attention as wa
from tests.test_window_attention_gpu import random_inputs, scene_offsets

N, HEADS, HEAD_DIM, DTYPE = 268_720, 4, 16, torch.float16
TILE_CONFIGS = {False: [(64, 64, 4), (32, 32, 4), (16, 16, 4)],
                True: [(32, 32, 8), (32, 32, 4), (16, 16, 4)]}


def run_once(fn, leaves, grad_out, backward):
    for t in leaves:
        t.grad = None
    out = fn()
    if backward:
        out.backward(grad_out)
    return out


def peak_mb(fn, leaves, grad_out, backward):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run_once(fn, leaves, grad_out, backward)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(fn, leaves, grad_out):
    """(fwd ms, fwd+bwd ms, fwd MB, fwd+bwd MB)."""
    times = [triton.testing.do_bench(lambda: run_once(fn, leaves, grad_out, backward),
                                     return_mode="median") for backward in (False, True)]
    return (*times, *(peak_mb(fn, leaves, grad_out, backward) for backward in (False, True)))


def main():
    default_config = wa.tile_config
    rows = []
    for scene, mean in (("dense", 10), ("kitti", 3)):
        offsets = scene_offsets(N, mean, seed=mean)
        windows = len(offsets) - 1
        for rel in (False, True):
            q, k, v, coords, tables, grad_out = random_inputs(N, HEADS, HEAD_DIM, rel)
            with torch.no_grad():
                want = wa.window_attention_reference(q, k, v, offsets, coords=coords, tables=tables)
            leaves = [t.to(DTYPE).requires_grad_() for t in (q, k, v, *(tables or ()))]
            half_tables = tuple(leaves[3:]) or None
            grad_out = grad_out.to(DTYPE)

            def call(backend):
                return lambda: wa.window_attention(*leaves[:3], offsets, coords=coords,
                                                   tables=half_tables, backend=backend)

            for config in TILE_CONFIGS[rel]:
                wa.tile_config = lambda rel, dtype, config=config: config
                with torch.no_grad():
                    got = call("triton")()
                error = ((got.double() - want).norm() / want.norm()).item()
                assert error < 3e-3 and not got.isnan().any(), (scene, rel, config, error)
                rows.append((scene, windows, rel, f"triton {config}", error,
                             *measure(call("triton"), leaves, grad_out)))
            wa.tile_config = default_config
            rows.append((scene, windows, rel, "torch pair list", float("nan"),
                         *measure(call("reference"), leaves, grad_out)))
            del q, k, v, tables, want, leaves
    print(f"N={N} h={HEADS} d={HEAD_DIM} {DTYPE}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'scene':6} {'windows':>8} {'rel':5} {'impl':24} {'fwd err':>8} {'fwd ms':>8} "
          f"{'f+b ms':>8} {'fwd MB':>8} {'f+b MB':>8}")
    for scene, windows, rel, impl, error, fwd, both, fwd_mb, both_mb in rows:
        print(f"{scene:6} {windows:8d} {str(rel):5} {impl:24} {error:8.1e} {fwd:8.3f} "
              f"{both:8.3f} {fwd_mb:8.0f} {both_mb:8.0f}")


if __name__ == "__main__":
    main()
