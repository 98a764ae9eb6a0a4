"""Windowed attention's Triton kernels on CUDA at real sizes, against the float64 reference
(run on the lent GPU by scripts/gpu_check.sh)."""
import pytest
import torch

from lowconv.kernels.window_attention import window_attention, window_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

G = 24  # SphereFormer's quantization: L = 47 table rows
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def scene_offsets(n, mean, big=(), seed=0):
    """Offsets of windows of 1 + Poisson(mean - 1) points, plus the `big` ones and a few empty
    ones, in random order, summing to n points."""
    gen = torch.Generator().manual_seed(seed)
    small = 1 + torch.poisson(torch.full((n,), mean - 1.0), generator=gen).long()
    count = int((small.cumsum(0) < n - sum(big)).sum()) + 1
    small = small[:count]
    small[-1] -= int(small.sum()) + sum(big) - n
    sizes = torch.cat([small[small > 0], torch.tensor(big, dtype=torch.long), torch.zeros(3, dtype=torch.long)])
    sizes = sizes[torch.randperm(len(sizes), generator=gen)]
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32).cuda()


def random_inputs(n, h, d, rel, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, grad_out = (torch.randn(n, h, d, generator=gen, device="cuda", dtype=torch.float64)
                         for _ in range(4))
    coords = torch.randint(0, G, (n, 3), generator=gen, device="cuda") if rel else None
    tables = tuple(0.5 * torch.randn(2 * G - 1, 3, h, d, generator=gen, device="cuda",
                                     dtype=torch.float64) for _ in range(3)) if rel else None
    return q, k, v, coords, tables, grad_out


def outputs_and_grads(fn, q, k, v, tables, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, *(tables or ()))]
    out = fn(*leaves[:3], tuple(leaves[3:]) or None)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def rel_errors(got, want):
    errors = []
    for x, ref in zip(got, want):
        assert not x.isnan().any(), "NaN in the result"
        errors.append(((x.double() - ref).norm() / ref.norm()).item())
    return errors


def check_against_float64(offsets, h, d, dtype, rel, seed=0):
    q, k, v, coords, tables, grad_out = random_inputs(int(offsets[-1]), h, d, rel, seed)

    def triton(q, k, v, tables):
        return window_attention(q, k, v, offsets, coords=coords, tables=tables, dtype=dtype)

    def reference(q, k, v, tables):
        return window_attention_reference(q, k, v, offsets, coords=coords, tables=tables)

    errors = rel_errors(outputs_and_grads(triton, q, k, v, tables, grad_out),
                        outputs_and_grads(reference, q, k, v, tables, grad_out))
    assert max(errors) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("h,d", [(4, 16), (1, 64)])
@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mean", [3, 10])
def test_scene_matches_float64(mean, dtype, rel, h, d):
    """50k points in windows of mean 3 (SemanticKITTI-like) or 10, plus three of 500+."""
    offsets = scene_offsets(50_000, mean, big=(520, 610, 700), seed=mean)
    check_against_float64(offsets, h, d, dtype, rel)


def test_over_a_hundred_thousand_windows():
    offsets = scene_offsets(240_000, 2, seed=1)
    assert len(offsets) - 1 > 100_000
    check_against_float64(offsets, 1, 16, torch.float16, rel=True)


def test_forward_is_deterministic():
    """The forward has no atomics: two runs agree bit for bit (a race would show here)."""
    offsets = scene_offsets(50_000, 10, big=(700,), seed=2)
    q, k, v, coords, tables, _ = random_inputs(50_000, 4, 16, rel=True)
    runs = [window_attention(q, k, v, offsets, coords=coords, tables=tables, dtype=torch.float16)
            for _ in range(2)]
    assert torch.equal(*runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_axis_matches_float64(dtype):
    """SphereFormer's radial split on axis 2 (47 thresholds, buckets 0 to 47 over tables of 2G
    rows), values spread as ranges in metres, on a scene of 50k points with windows of 500+."""
    from lowconv.kernels.window_attention import SplitAxis
    offsets = scene_offsets(50_000, 10, big=(520, 610, 700), seed=3)
    q, k, v, coords, _, grad_out = random_inputs(int(offsets[-1]), 4, 16, rel=True, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    tables = tuple(0.5 * torch.randn(2 * G, 3, 4, 16, generator=gen, device="cuda", dtype=torch.float64)
                   for _ in range(3))
    values = 40 * torch.rand(len(q), generator=gen, device="cuda")
    a, steps = 0.0125, [1, 2, 4, 6, 10, 14, 22, 30, 46, 62, 94, 126, 190, 254, 382, 510, 766, 1022, 1534, 2046,
                        3070, 4094, 6142]
    positive = torch.tensor([a * s for s in steps], device="cuda")
    thresholds = torch.cat([-positive.flip(0), torch.zeros(1, device="cuda"), positive])  # 47
    split = SplitAxis(2, values, thresholds, 0)

    def run(compute, backend):
        def fn(q, k, v, tables):
            return window_attention(q, k, v, offsets, coords=coords, tables=tables, split=split, dtype=compute,
                                    backend=backend)
        return fn

    errors = rel_errors(outputs_and_grads(run(dtype, "triton"), q, k, v, tables, grad_out),
                        outputs_and_grads(run(torch.float64, "reference"), q, k, v, tables, grad_out))
    assert max(errors) < TOLERANCE[dtype], errors


def test_sphereformer_example_converts_on_cuda():
    """examples/sphereformer.py on CUDA: its 10 chains (5 radial ones split) run the kernels, in
    float32 within the kernels' rounding of the original (SpTr's pair formulation in torch)."""
    import lowconv
    from lowconv.model_file import load_model_file
    from lowconv.recipe import parse_recipe

    loaded = load_model_file("examples/sphereformer.py")
    model = loaded.model.cuda()
    inputs = tuple(t.cuda() for t in loaded.inputs)
    recipe = parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }')
    converted = lowconv.convert(model, recipe, inputs)
    assert len(converted.lowconv_plan.converted()) == 10
    with torch.no_grad():
        got, want = converted(*inputs), model(*inputs)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
