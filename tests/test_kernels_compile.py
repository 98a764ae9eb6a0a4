"""lowconv's Triton kernels compile for the H100 (sm_90), here on the CPU: Triton's interpreter
(the other tests) runs the Python of a kernel and takes code that the compiler rejects (e.g.
returns of different shapes from a constexpr branch). ptxas ships with triton. The compiler
needs triton without the interpreter, so the compiles run in a child process."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
H100_SHARED_BYTES = 232448  # per block
POINTER = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
WINDOW_KERNELS = ("_forward_kernel", "_backward_query_kernel", "_backward_key_kernel")
# SphereFormer's grid (G = 24: L = 47) in every dtype, and a small grid (G = 4, the CPU tests' grid) whose
# narrow per-axis blocks once failed to compile; a split axis (last field: -1 none) as SphereFormer's
# radial one (axis 2, L = 48).
WINDOW_CASES = ([(kernel, dtype, rel, 24, -1) for kernel in WINDOW_KERNELS for dtype in ("fp16", "bf16", "fp32")
                 for rel in (False, True)] + [(kernel, "fp16", True, 4, -1) for kernel in WINDOW_KERNELS]
                + [(kernel, "fp16", True, 24, 2) for kernel in WINDOW_KERNELS])
FP8_CASES = ([("amax", "e4m3", mul, wide) for mul in (0, 1, 2) for wide in (False, True)]
             + [("cast", fp8, mul, mode) for fp8 in ("e4m3", "e5m2") for mul in (0, 1) for mode in ("dynamic", "count")]
             + [("cast_transposed", fp8, mul, mode) for fp8 in ("e4m3", "e5m2") for mul in (0, 1, 2)
                for mode in ("dynamic", "given")]
             + [("rowwise", fp8, 0, block_k) for fp8 in ("e4m3", "e5m2") for block_k in (1024, 2048)])
BLOCK_KERNELS = ("_forward_kernel", "_backward_query_kernel", "_backward_key_kernel")
# Block attention: every dtype at head_dim 128 (the most registers), dense and unlisted, and the
# half-precision band tiles (BAND_TILES) at head_dim 64 too; the model-mask variants (listed
# tiles, band, key padding) at smaller head dims.
BLOCK_CASES = ([(kernel, dtype, 128, "none", "dense") for kernel in BLOCK_KERNELS for dtype in ("fp16", "bf16", "fp32")]
               + [(kernel, dtype, d, "none", "band") for kernel in BLOCK_KERNELS for dtype in ("fp16", "bf16")
                  for d in (64, 128)]
               + [(kernel, "fp16", 64, "bool", "listed") for kernel in BLOCK_KERNELS]
               + [(kernel, "bf16", 16, "additive", "listed") for kernel in BLOCK_KERNELS])
# The fixed-mask 2:4 kernels, with int32 and int64 (WIDE) offsets; the packing from a strided source.
PACK_CASES = [(kernel, dtype, wide) for kernel in ("pack", "transpose") for dtype in ("fp16", "bf16")
              for wide in (False, True)]
FP16ACC_CASES = [(has_bias, combine_fp32, block_m) for has_bias in (False, True) for combine_fp32 in (False, True)
                 for block_m in (16, 64)]
# The Gluon wgmma GEMM: the forward's operand layouts and the backward's (dX: w transposed; dW: both),
# both combines, 64-, 32- and 16-wide k-tiles, chunks unrolled (1, 2 and 32 k-tiles) and looped (0).
FP16ACC_WGMMA_CASES = [(True, True, False, True, 64, 2), (True, True, True, False, 16, 0),
                       (True, False, True, True, 64, 32), (False, False, False, True, 32, 1),
                       (True, True, True, False, 64, 0)]
# ptxas's notes on wgmmas it serializes (C7514) or waits for (C7515-C7517)
WGMMA_NOTES = re.compile(r"\(C751[4-7]\)")


def signature(kernel, constexprs, types):
    """Each argument's type: constexpr, an explicit type from `types`, else a pointer of types['*']."""
    return {name: "constexpr" if name in constexprs else types.get(name, types["*"]) for name in kernel.arg_names}


def compiled_for_sm90(kernel, types, constexprs, num_warps, num_stages=None):
    """The kernel compiled for sm_90 (triton's CompiledKernel: metadata, and its asm by stage)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, signature(kernel, constexprs, types),
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_for_sm90(kernel, types, constexprs, num_warps, num_stages=None):
    """Shared memory bytes of the compiled kernel, or the compiler's error."""
    try:
        compiled = compiled_for_sm90(kernel, types, constexprs, num_warps, num_stages)
    except Exception as error:
        return f"{type(error).__name__}: {error}"[-2000:]
    return compiled.metadata.shared


def window_case(kernel_name, dtype, rel, g, split, compile=compile_for_sm90):
    """A window-attention kernel with its tile_config, on a grid of G coordinates per axis, with a
    split axis (split >= 0: tables of 2G rows) or none, compiled by `compile`."""
    import lowconv.kernels.window_attention_triton as wa

    kernel = getattr(wa, kernel_name)
    tiles = wa.tile_config(kernel, rel, split >= 0)
    rows = 2 * g if split >= 0 else 2 * g - 1
    widths = wa.padded_widths(g, rows)
    constexprs = dict(D=16, REL=rel, SPLIT=split, **widths, **wa.split_widths(rows - 1 if split >= 0 else 0, rows,
                                                                             widths["LP"]),
                      PRECISION="tf32x3" if dtype == "fp32" else "tf32", BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                      **({} if split >= 0 else {"split_values": None, "thresholds": None}))
    types = {"*": POINTER[dtype], "scale": "fp32", **{name: "i32" for name in ("N", "H", "G", "L", "T", "FIRST")},
             **{name: "*i32" for name in ("start", "end", "coords")},
             **{name: "*fp32" for name in ("lse", "delta", "dtq", "dtk", "dtv", "split_values", "thresholds")}}
    return compile(kernel, types, constexprs, tiles.num_warps, tiles.num_stages)


def block_case(kernel_name, dtype, d, mask, variant):
    """A block-attention kernel on the tiles it launches with (kernel_tiles): no mask, a bool or
    an additive (fp32) one; variant "dense" (no band), "band" (a band alone, as causal and local
    run) or "listed" (a band, listed tiles and key padding)."""
    import torch
    import lowconv.kernels.block_attention_triton as ba

    kernel = getattr(ba, kernel_name)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    listed = variant == "listed"
    tiles = ba.kernel_tiles(kernel_name, d, torch_dtype, listed=listed)
    optional = {"mask": {"none": None, "bool": "*u8", "additive": "*fp32"}[mask],
                **{name: "*i32" if listed else None for name in ("count", "index")},
                "padding": "*u8" if listed else None}
    constexprs = dict(D=d, BANDED=variant != "dense", MASK=mask, PADDING=listed, LISTED=listed, PRECISION="tf32x3" if dtype == "fp32" else "tf32",
                      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                      **{name: None for name, pointer in optional.items() if pointer is None})
    types = {"*": POINTER[dtype], "scale": "fp32",
             **{name: pointer for name, pointer in optional.items() if pointer is not None},
             "stats": "*fp32", "delta": "*fp32",
             **{name: "i32" for name in kernel.arg_names if name[0].isupper() or name in ("lower", "upper")
                or name.startswith(("mask_s", "list_s"))}}
    return compile_for_sm90(kernel, types, constexprs, tiles.num_warps, tiles.num_stages)


def fp16acc_case(has_bias, combine_fp32, block_m):
    """The fp16-accumulating split-K GEMM as launch_fp16acc launches it."""
    import lowconv.kernels.fp16acc_triton as ft

    constexprs = dict(HAS_BIAS=has_bias, COMBINE_FP32=combine_fp32, BLOCK_M=block_m, BLOCK_N=64, TILE_K=64)
    types = {"*": "*fp16", **{name: "i32" for name in ft._fp16acc_kernel.arg_names if name[0].isupper() or
                              name.startswith("stride")}}
    return compile_for_sm90(ft._fp16acc_kernel, types, constexprs, 4)


def fp16acc_wgmma_case(x_k_major, w_k_major, combine_fp32, has_bias, tile_k, unrolled_tiles):
    """The Gluon fp16-accumulating GEMM (fp16acc_wgmma) with its TMA descriptors as launched; an
    error where ptxas holds back the wgmmas of unrolled chunks (WGMMA_NOTES), whose point is to
    keep them in flight, or does not for looped ones (so that the check is known to see them)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    import lowconv.kernels.fp16acc_wgmma as fw

    def descriptor_type(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16)
        return mangle_type(TensorDescriptor.from_tensor(torch.zeros(512, 512, dtype=torch.float16), block, layout))

    kernel = fw._fp16acc_wgmma_kernel
    constexprs = dict(HAS_BIAS=has_bias, COMBINE_FP32=combine_fp32, X_K_MAJOR=x_k_major, W_K_MAJOR=w_k_major,
                      **fw.schedule(unrolled_tiles or fw.MAX_UNROLLED_TILES + 1, tile_k), num_warps=fw.WARPGROUP)
    types = {"x_desc": descriptor_type([fw.HALF_M, tile_k] if x_k_major else [tile_k, fw.HALF_M]),
             "w_desc": descriptor_type([fw.BLOCK_N, tile_k] if w_k_major else [tile_k, fw.BLOCK_N]),
             "out_desc": descriptor_type([fw.HALF_M, fw.BLOCK_N]), "bias": "*fp16",
             **{name: "i32" for name in ("M", "N", "CHUNK_TILES", "CHUNKS")}, **{name: "constexpr" for name in constexprs}}
    source = GluonASTSource(kernel, types, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": fw.WARPGROUP,
                                                                                "maxnreg": fw.MAX_REGISTERS})
    except Exception as error:
        return f"{type(error).__name__}: {error}"[-2000:]
    notes = WGMMA_NOTES.findall(ptxas_notes(compiled.asm["ptx"]))
    if unrolled_tiles and notes:
        return f"ptxas holds back the wgmmas of {unrolled_tiles} unrolled k-tiles: {notes}"
    if not unrolled_tiles and not notes:
        return "ptxas gave no wgmma note for looped chunks: does WGMMA_NOTES still match its notes?"
    return compiled.metadata.shared


def ptxas_notes(ptx: str) -> str:
    """What ptxas -v says about a PTX module compiled for sm_90a."""
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(path), "-o",
                               str(path.with_suffix(".cubin"))], capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def fp8_case(kernel_name, fp8, mul, variant):
    """An FP8 quantization kernel as fp8_quant launches it (bf16 x)."""
    import torch
    import lowconv.kernels.fp8_quant as fq

    fp8_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fp8]
    fp8_type = {"FP8_MAX": torch.finfo(fp8_dtype).max, "FP8": fq.FP8_TL[fp8_dtype]}
    fp8_pointer = "*fp8e4nv" if fp8 == "e4m3" else "*fp8e5"
    types = {"*": "*fp32", "x": "*bf16", "out": fp8_pointer, "out_t": fp8_pointer, "clipped": "*i64",
             "amax_bits": "*i32", **{name: "i32" for name in ("N", "K", "M", "STEPS")}}
    if kernel_name == "amax":
        kernel = fq._amax_kernel
        constexprs = dict(MUL=mul, WIDE=variant, BLOCK=fq.BLOCK)
    elif kernel_name == "cast":
        kernel = fq._cast_kernel
        constexprs = dict(MUL=mul, WIDE=False, SCALE_FROM_AMAX=variant == "dynamic", COUNT=variant == "count",
                          BLOCK=fq.BLOCK, **fp8_type)
    elif kernel_name == "cast_transposed":
        kernel = fq._cast_transposed_kernel
        constexprs = dict(MUL=mul, SCALE_FROM_AMAX=variant == "dynamic",
                          BLOCK_M=fq.TILE_2D[0], BLOCK_K=fq.TILE_2D[1], **fp8_type)
    else:
        kernel = fq._rowwise_kernel
        constexprs = dict(BLOCK_M=fq.BLOCK * 2 // variant, BLOCK_K=variant, **fp8_type)
    return compile_for_sm90(kernel, types, constexprs, 8)


def pack_case(kernel_name, dtype, wide):
    """A pack24 kernel as pack_kept / transpose_kept launch it."""
    import lowconv.kernels.pack24 as pack24

    kernel = pack24._pack_kept_kernel if kernel_name == "pack" else pack24._transpose_kept_kernel
    tile = pack24.PACK_TILE if kernel_name == "pack" else pack24.TRANSPOSE_TILE
    types = {"*": POINTER[dtype], "codes": "*u8", "codes_t": "*u8",
             **{name: "i32" for name in ("rows", "groups", "stride_row", "stride_col", "rows_t", "groups_t")}}
    return compile_for_sm90(kernel, types, dict(BLOCK_ROWS=tile[0], BLOCK_GROUPS=tile[1], WIDE=wide), tile[2])


def test_kernels_compile_for_sm90():
    # The child imports this checkout's lowconv (not an installed one) and compiles, not interprets.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.splitlines()[-1])
    assert len(results) == (len(WINDOW_CASES) + len(BLOCK_CASES) + len(FP16ACC_CASES) + len(FP16ACC_WGMMA_CASES)
                            + len(FP8_CASES) + len(PACK_CASES))
    failed = {case: result for case, result in results.items() if isinstance(result, str)}
    assert not failed, "\n\n".join(f"{case}: {error}" for case, error in failed.items())
    too_big = {case: shared for case, shared in results.items() if shared > H100_SHARED_BYTES}
    assert not too_big, f"shared memory beyond the H100's {H100_SHARED_BYTES} bytes: {too_big}"


if __name__ == "__main__":
    results = {f"window {k} {d} rel={r} G={g} split={a}": window_case(k, d, r, g, a) for k, d, r, g, a in WINDOW_CASES}
    results.update({f"block {k} {t} d={d} mask={m} {v}": block_case(k, t, d, m, v)
                    for k, t, d, m, v in BLOCK_CASES})
    results.update({f"fp16acc bias={b} fp32={c} block_m={m}": fp16acc_case(b, c, m) for b, c, m in FP16ACC_CASES})
    results.update({f"fp16acc wgmma x_k_major={x} w_k_major={w} fp32={c} bias={b} tile_k={t} unrolled={u}":
                    fp16acc_wgmma_case(x, w, c, b, t, u) for x, w, c, b, t, u in FP16ACC_WGMMA_CASES})
    results.update({f"fp8 {k} {f} mul={m} {v}": fp8_case(k, f, m, v) for k, f, m, v in FP8_CASES})
    results.update({f"pack24 {k} {t} wide={w}": pack_case(k, t, w) for k, t, w in PACK_CASES})
    print(json.dumps(results))
