#!/usr/bin/env python3
"""Plot scripts/bench_fp16acc.py's results: per shape, lowconv's relative error vs float64 against
the number of splits S, beside cuBLAS fp32-acc and fp16-acc (horizontal lines) and lowconv's
splits="auto" (marked); below it, the time over cuBLAS fp32-acc's against S.

    python3 scripts/plot_fp16acc.py RESULTS.json OUT.png

Needs matplotlib, which lowconv itself does not (install it where you run this).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

SWEEP_PREFIX = "lowconv S="
CUBLAS_LINES = {"cuBLAS fp32-acc": "tab:green", "cuBLAS fp16-acc": "tab:red"}
# lowconv's splits="auto" results; the cuBLAS backend has the kernel's error, so its marker is an
# open square drawn under the kernel's star.
AUTO_MARKERS = {"lowconv cublas auto": dict(color="tab:purple", marker="s", markerfacecolor="none", markersize=14),
                "lowconv auto": dict(color="tab:blue", marker="*", markersize=12),
                "lowconv auto, fp16 combine": dict(color="tab:orange", marker="D", markersize=9)}


def ok_results(data):
    """{shape label: {peer: result}} of the results that were measured."""
    shapes = {}
    for result in data["results"]:
        if result["status"] == "ok":
            shapes.setdefault(result["shape"], {})[result["peer"]] = result
    return shapes


def sweep(results, value):
    """(S values, value(result)) of the lowconv S=... results, by S."""
    points = sorted((r["splits"], value(r)) for peer, r in results.items() if peer.startswith(SWEEP_PREFIX))
    return [s for s, _ in points], [v for _, v in points]


def plot_errors(ax, label, results):
    splits, errors = sweep(results, lambda r: r["rel_error"])
    ax.plot(splits, errors, "o-", color="tab:blue", label="lowconv, S chunks")
    for peer, color in CUBLAS_LINES.items():
        if peer in results:
            ax.axhline(results[peer]["rel_error"], color=color, linestyle="--", label=peer)
    for peer, style in AUTO_MARKERS.items():
        if peer in results:
            r = results[peer]
            ax.plot([r["splits"]], [r["rel_error"]], linestyle="none", label=f"{peer} (S={r['splits']})", **style)
    ax.set(title=label, xscale="log", yscale="log", xlabel="splits S", ylabel="relative error vs float64")
    ax.set_xticks(splits or [1], [str(s) for s in splits] or ["1"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_times(ax, results):
    baseline = results.get("cuBLAS fp32-acc")
    if baseline is None:
        ax.set_axis_off()
        return
    splits, times = sweep(results, lambda r: r["ms"] / baseline["ms"])
    ax.plot(splits, times, "o-", color="tab:blue", label="lowconv, S chunks")
    ax.axhline(1.0, color=CUBLAS_LINES["cuBLAS fp32-acc"], linestyle="--", label="cuBLAS fp32-acc")
    if "cuBLAS fp16-acc" in results:
        ax.axhline(results["cuBLAS fp16-acc"]["ms"] / baseline["ms"], color=CUBLAS_LINES["cuBLAS fp16-acc"],
                   linestyle="--", label="cuBLAS fp16-acc")
    for peer, style in AUTO_MARKERS.items():
        if peer in results:
            r = results[peer]
            ax.plot([r["splits"]], [r["ms"] / baseline["ms"]], linestyle="none", label=peer, **style)
    ax.set(xscale="log", yscale="log", xlabel="splits S", ylabel="time / cuBLAS fp32-acc's")
    ax.set_xticks(splits or [1], [str(s) for s in splits] or ["1"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    results_path, out_path = sys.argv[1:]
    with open(results_path) as f:
        data = json.load(f)
    shapes = ok_results(data)
    if not shapes:
        sys.exit(f"{results_path}: no measured results to plot")
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.2 * len(shapes), 7.5), squeeze=False)
    for column, (label, results) in enumerate(shapes.items()):
        plot_errors(axes[0][column], label, results)
        plot_times(axes[1][column], results)
    header = data["header"]
    fig.suptitle(f"fp16 accumulation with split K: {header['device']}, torch {header['torch']}, "
                 f"triton {header['triton']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


if __name__ == "__main__":
    main()
