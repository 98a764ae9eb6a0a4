"""The window-attention kernels compile for the H100 (sm_90), here on the CPU: Triton's
interpreter (the other tests) runs the Python of a kernel and takes code that the compiler
rejects (e.g. returns of different shapes from a constexpr branch). ptxas ships with triton.
The compiler needs triton without the interpreter, so the compiles run in a child process."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

POINTER = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
INT_POINTERS = ("start", "end", "coords")
FP32_POINTERS = ("lse", "delta", "dtq", "dtk", "dtv")
H100_SHARED_BYTES = 232448  # per block
CASES = [(kernel, dtype, rel) for kernel in ("_forward_kernel", "_backward_query_kernel", "_backward_key_kernel")
         for dtype in ("fp16", "bf16", "fp32") for rel in (False, True)]


def signature(kernel, dtype, constexprs):
    """Argument types as a launch on (N, h, d) tensors of `dtype` would give them."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("N", "H", "G"):
            types[name] = "i32"
        elif name == "scale":
            types[name] = "fp32"
        elif name in INT_POINTERS:
            types[name] = "*i32"
        elif name in FP32_POINTERS:
            types[name] = "*fp32"
        else:
            types[name] = POINTER[dtype]
    return types


def compile_case(kernel_name, dtype, rel):
    """Shared memory bytes of the kernel compiled with its tile_config, or the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lowconv.kernels.window_attention as wa

    kernel = getattr(wa, kernel_name)
    g = 24  # SphereFormer's grid: L = 47 table rows
    tiles = wa.tile_config(kernel, rel)
    constexprs = dict(D=16, REL=rel, **wa.padded_widths(g), PRECISION="tf32x3" if dtype == "fp32" else "tf32",
                      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
    source = ASTSource(kernel, signature(kernel, dtype, constexprs),
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": tiles.num_warps})
    except Exception as error:
        return f"{type(error).__name__}: {error}"[-2000:]
    return compiled.metadata.shared


def test_kernels_compile_for_sm90():
    # The child imports this checkout's lowconv (not an installed one) and compiles, not interprets.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.splitlines()[-1])
    failed = {case: result for case, result in results.items() if isinstance(result, str)}
    assert not failed, "\n\n".join(f"{case}: {error}" for case, error in failed.items())
    too_big = {case: shared for case, shared in results.items() if shared > H100_SHARED_BYTES}
    assert not too_big, f"shared memory beyond the H100's {H100_SHARED_BYTES} bytes: {too_big}"
    assert len(results) == len(CASES)


if __name__ == "__main__":
    print(json.dumps({f"{k} {d} rel={r}": compile_case(k, d, r) for k, d, r in CASES}))
