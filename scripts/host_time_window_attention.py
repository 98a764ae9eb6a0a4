#!/usr/bin/env python3
"""Where the time of a small window_attention call goes: host (Python, autograd, launches) vs GPU.

For each scene of bench_sparse_attention.py at fp16, h = 1 and 4, no relative position: the
host time per call (perf_counter over calls that queue without waiting for the GPU), the
do_bench median of the call (what bench_sparse_attention.py reports), and the kernels alone
(their launches timed by do_bench, which include their own host launch cost). When the call's
median is near its host time, the call is host-bound: the GPU waits for Python.

    python3 scripts/host_time_window_attention.py --out DIR
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402
from tabulate import tabulate  # noqa: E402

import lowconv.kernels.window_attention_triton as wa  # noqa: E402
from scripts.bench_sparse_attention import (FULL_POINTS, build_scene, forward_call, lowconv_peer,  # noqa: E402
                                            make_inputs, train_call)
from scripts.bench_common import host_ms  # noqa: E402

HOST_CALLS = 100  # few enough that the GPU queue never fills and blocks the host


def host_us(fn):
    return host_ms(fn, HOST_CALLS) * 1e3


def kernels_alone(scene, x):
    """The forward kernel, and the two backward kernels, launched directly on prepared buffers."""
    q, k, v = (t.detach() for t in (x.q, x.k, x.v))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    delta, grads = torch.empty_like(lse), [torch.empty_like(q) for _ in range(3)]
    launch = wa.Launch(q, None, *scene.row_windows, None, 1.0)
    forward = lambda: launch.run(wa._forward_kernel, q, k, v, out, lse, None, None, None)  # noqa: E731
    forward()

    def backward():
        launch.run(wa._backward_query_kernel, q, k, v, out, x.grad_out, lse, delta, grads[0],
                   None, None, None, None, None)
        launch.run(wa._backward_key_kernel, q, k, v, x.grad_out, lse, delta, grads[1], grads[2],
                   None, None, None, None)
    return forward, backward


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for name in ("dense", "kitti"):
        scene = build_scene(name, FULL_POINTS, torch.device("cuda"))
        attention = lowconv_peer(scene)
        for heads in (1, 4):
            x = make_inputs(scene.n, heads, torch.float16, torch.device("cuda"), seed=0)
            forward, backward = kernels_alone(scene, x)
            bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
            fwd, train = forward_call(attention, x, False), train_call(attention, x, False)
            rows.append([name, heads, f"{host_us(fwd):.0f}", f"{bench(fwd):.3f}", f"{bench(forward):.3f}",
                         f"{host_us(train):.0f}", f"{bench(train):.3f}",
                         f"{bench(forward) + bench(backward):.3f}"])
    text = tabulate(rows, headers=["scene", "h", "fwd host us", "fwd ms", "fwd kernel ms",
                                   "fwd+bwd host us", "fwd+bwd ms", "fwd+bwd kernels ms"],
                    tablefmt="github")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_time_window_attention.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
