#!/usr/bin/env python3
"""What the window-attention kernels' key loop costs per pair, statically: each kernel compiled for
sm_90 (on any machine: triton compiles, nvdisasm disassembles), its SASS counted by instruction
within the innermost loop, and the loop's warp-instructions per (query, key) pair of a tile, without
and with contextual relative position (the cases tests/test_kernels_compile.py builds: G = 24, no
split). A proxy for the GPU time of a design, to compare designs before a GPU measures them:
register gathers show as SHFL, layout conversions through shared memory as STS, LDS and BAR.

    PYTHONPATH=. python3 scripts/sass_window_attention.py [--dtype fp16] [--kernels _forward_kernel]
"""
import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from tests.test_kernels_compile import WINDOW_KERNELS, compiled_for_sm90, window_case  # noqa: E402

import lowconv.kernels.window_attention_triton as wa  # noqa: E402

SHOWN = 16  # instruction kinds listed per loop


def instructions(sass: str) -> list[tuple[str | None, str | None, str]]:
    """(label, None, line) for a label, (None, opcode, text) for an instruction, in order."""
    out = []
    for line in sass.splitlines():
        text = line.strip()
        label = re.match(r"^\.?(\w+):$", text)
        if label:
            out.append((label.group(1), None, text))
            continue
        parts = text.split("\t", 1)  # control codes, then the instruction
        if len(parts) == 2 and re.fullmatch(r"[-0-9a-fA-FY:]+", parts[0].replace(" ", "")):
            body = re.sub(r"^@!?U?P\w+\s+", "", parts[1].strip())  # a predicate
            opcode = re.match(r"[A-Z][A-Z0-9_]*", body)
            if opcode:
                out.append((None, opcode.group(0), body))
    return out


def innermost_loop(code: list) -> list:
    """The instructions between the label a backward branch jumps to and that branch, the
    shortest such range that holds more than the branch itself."""
    labels = {label: i for i, (label, _, _) in enumerate(code) if label}
    loops = []
    for i, (_, opcode, text) in enumerate(code):
        target = re.search(r"(\w+)\s*\)?`?\s*;?\s*$", text) if opcode == "BRA" else None
        if target and labels.get(target.group(1), i) < i:
            loops.append(code[labels[target.group(1)]:i + 1])
    loops = [loop for loop in loops if sum(1 for _, opcode, _ in loop if opcode) > 1]
    return min(loops, key=len) if loops else []


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--kernels", default=",".join(WINDOW_KERNELS))
    args = parser.parse_args()
    for name in args.kernels.split(","):
        for rel in (False, True):
            compiled = window_case(name, args.dtype, rel, 24, -1, compile=compiled_for_sm90)
            tiles = wa.tile_config(getattr(wa, name), rel, False)
            loop = collections.Counter(opcode for _, opcode, _ in innermost_loop(instructions(compiled.asm["sass"]))
                                       if opcode)
            count = sum(loop.values())
            per_pair = count * tiles.num_warps / (tiles.block_m * tiles.block_n)
            print(f"{name} rel={rel}: tiles {tiles.block_m} x {tiles.block_n}, {tiles.num_warps} warps, "
                  f"shared {compiled.metadata.shared} B; loop {count} instructions, "
                  f"{per_pair:.2f} warp-instructions a pair")
            print("    " + ", ".join(f"{opcode} {n}" for opcode, n in loop.most_common(SHOWN)))


if __name__ == "__main__":
    main()
