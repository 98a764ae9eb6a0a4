"""fast_launch.launch: the same results as kernel[grid](...), Triton's binding skipped only where
the specialization is one it has compiled (GPU), and the interpreter's path on the CPU."""
import pytest
import torch
import triton
import triton.language as tl

from lowconv.kernels import fast_launch


@triton.jit
def _scaled_gather(x, out, n, stride, scale, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    """out[i] = x[i * stride] * scale (squared with SQUARE), i < n."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x + i * stride, mask=i < n).to(tl.float32) * scale
    if SQUARE:
        y = y * y
    tl.store(out + i, y.to(out.dtype.element_ty), mask=i < n)


def expected(x, n, stride, scale, square):
    y = x[: n * stride: stride].double() * scale
    return y * y if square else y


def run(x, n, stride, scale, square, out_dtype):
    out = torch.full((n,), float("nan"), dtype=out_dtype, device=x.device)
    fast_launch.launch(_scaled_gather, (triton.cdiv(n, 64),), (x, out, n, stride, scale),
                       {"BLOCK": 64, "SQUARE": square}, num_warps=4)
    return out


# (offset into the buffer in elements, n, stride, scale, SQUARE, x dtype, out dtype, whether the
# call is a new specialization): aligned and misaligned addresses, ints that Triton specializes (1,
# multiples of 16) or not, SQUARE as True and as 1, each dtype, and
# repeats with other values of the same specialization, which must launch the compiled kernel
# with their own values.
CALLS = [(0, 100, 1, 2.0, False, torch.float32, torch.float32, True),
         (0, 100, 1, 3.0, False, torch.float32, torch.float32, False),  # scale is not specialized
         (0, 99, 1, 3.0, False, torch.float32, torch.float32, False),  # nor is n, unless 1 or 16k
         (1, 100, 1, 3.0, False, torch.float32, torch.float32, True),  # misaligned
         (0, 77, 3, 0.5, False, torch.float32, torch.float32, True),
         (0, 77, 5, 0.5, False, torch.float32, torch.float32, False),
         (0, 77, 3, 0.5, True, torch.float32, torch.float32, True),
         (0, 77, 3, 0.5, 1, torch.float32, torch.float32, True),
         (0, 77, 3, 0.5, True, torch.float16, torch.float32, True),
         (0, 77, 3, 0.5, True, torch.float16, torch.float16, True),
         (1, 100, 1, 2.0, False, torch.float32, torch.float32, False),
         (3, 96, 16, 1.5, True, torch.float16, torch.float16, True),
         (3, 112, 32, 1.5, True, torch.float16, torch.float16, False)]


def check_calls(device):
    buffer = torch.randn(4096, device=device)
    for offset, n, stride, scale, square, x_dtype, out_dtype, _ in CALLS:
        x = buffer.to(x_dtype)[offset:]
        got = run(x, n, stride, scale, square, out_dtype)
        want = expected(x, n, stride, scale, square)
        # fp16 outputs: relative to the largest value (small squares round to fp16 subnormals).
        tolerance = 1e-6 if out_dtype == torch.float32 else 1e-3
        assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item()), \
            (offset, n, stride, x_dtype)


def test_argument_keys():
    aligned = torch.zeros(8)
    assert fast_launch._arg_key(aligned) == (torch.float32, True)
    assert fast_launch._arg_key(aligned[1:]) == (torch.float32, False)
    assert fast_launch._arg_key(aligned.half()[8:]) == (torch.float16, True)
    assert fast_launch._arg_key(torch.nn.Parameter(aligned)) == (torch.float32, True)  # a module's weight
    assert [fast_launch._arg_key(n) for n in (1, 16, 0, 7, 2 ** 40, 2 ** 40 + 1, 2 ** 63)] == \
        ["1", "D", "D", "", "i64D", "i64", "u64D"]
    assert fast_launch._arg_key(True) == (bool, True) != fast_launch._arg_key(1)
    assert fast_launch._arg_key(None) is type(None) and fast_launch._arg_key(0.5) is float
    with pytest.raises(TypeError):
        fast_launch._arg_key("a string")


def test_tensor_descriptor_keys():
    """Gluon's descriptors: keyed by what Triton puts in their type (dtype, block shape, layout),
    and padding; not by the tensor's shape or strides, which the launcher passes at run time. Equal
    keys have equal Triton types."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    def descriptor(t, block, swizzle=128, padding="zero"):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
        return TensorDescriptor.from_tensor(t, block, layout, padding)

    a = torch.zeros(256, 512, dtype=torch.float16)
    same = [descriptor(a, [64, 64]), descriptor(torch.zeros(64, 1024, dtype=torch.float16)[:, 512:], [64, 64])]
    assert fast_launch._arg_key(same[0]) == fast_launch._arg_key(same[1])
    assert mangle_type(same[0]) == mangle_type(same[1])
    others = [descriptor(a, [64, 32]), descriptor(a, [64, 64], swizzle=64), descriptor(a.bfloat16(), [64, 64]),
              descriptor(a, [64, 64], padding="nan")]
    assert len({fast_launch._arg_key(d) for d in [same[0], *others]}) == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path; the GPU test covers CUDA")
def test_interpreter_path_on_cpu():
    check_calls("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_launches_match_and_skip_the_binding(monkeypatch):
    bindings = []
    run_with_binding = _scaled_gather.run
    monkeypatch.setattr(_scaled_gather, "run", lambda *a, **kw: bindings.append(1) or run_with_binding(*a, **kw))
    fast_launch._COMPILED.clear()
    check_calls("cuda")
    assert len(bindings) == sum(new for *_, new in CALLS)  # only new specializations were bound
    torch.cuda.synchronize()
