"""Windowed attention: the torch reference and the Triton kernels (run by Triton's interpreter
on the CPU) against a float64 dense computation, window by window."""
import pytest
import torch

from lowconv.kernels.window_attention import (COORD_LIMIT, SplitAxis, launch_row_windows, row_windows_from_offsets,
                                              window_attention, window_attention_reference)

# On the CPU, the Triton kernels run in Triton's interpreter (switched on in conftest.py). Where
# CUDA is present (a GPU run collects this file too) the same tests run compiled, on CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter's loop over a loaded bound warns about numpy scalar conversion; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

# Many tiny windows in one tile, empty and size-1 windows, one window larger than any tile
# (70 > BLOCK_M), and a ragged tail: N = 181 is no multiple of the tile sizes.
SIZES = [2, 1, 3, 0, 1, 2, 2, 1, 3, 1, 1, 2, 0, 3, 1, 2, 2, 1, 1, 3, 2, 1, 2, 70, 1, 0, 5, 9,
         2, 13, 1, 1, 4, 2, 3, 6, 1, 2, 1, 7, 0]
G = 4  # coordinates in [0, 3], tables of L = 7 rows
# The split kernels' tiles are narrower (16 or 32 rows): a window of 40 spans several, and the
# interpreter runs these kernels slowest, so fewer rows than SIZES.
SPLIT_SIZES = [2, 1, 3, 0, 1, 2, 40, 1, 0, 5, 9, 2, 13, 7, 0]
# Relative L2 error bounds vs float64 for the compute dtype: forward and every gradient.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def rel_error(x, ref):
    x, ref = x.double(), ref.double()
    assert not x.isnan().any(), "NaN in the result"
    return ((x - ref).norm() / ref.norm()).item()


def make_problem(sizes=SIZES, h=2, d=16, rel=True, seed=0, g=G):
    """float64 leaves q, k, v (and tables), offsets, coords, and a random output gradient."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    offsets = torch.tensor([0] + sizes).cumsum(0).to(torch.int32).to(DEVICE)
    n = int(offsets[-1])
    q, k, v = (draw(n, h, d) for _ in range(3))
    coords = torch.randint(0, g, (n, 3), generator=gen).to(DEVICE) if rel else None
    tables = tuple(0.5 * draw(2 * g - 1, 3, h, d) for _ in range(3)) if rel else None
    return q, k, v, offsets, coords, tables, draw(n, h, d)


def leaves_of(problem):
    q, k, v, _, _, tables, _ = problem
    return [q, k, v, *(tables or ())]


def dense_window_attention64(q, k, v, offsets, scale, coords=None, tables=None):
    """The definition, in float64, one dense softmax per window."""
    outs = [q.new_zeros(0, *q.shape[1:]).double()]
    for w in range(len(offsets) - 1):
        s, e = int(offsets[w]), int(offsets[w + 1])
        qw, kw, vw = q[s:e].double() * scale, k[s:e].double(), v[s:e].double()
        logits = torch.einsum("ihd,jhd->hij", qw, kw)
        if tables is not None:
            g = (tables[0].shape[0] + 1) // 2
            rel = (coords[s:e, None, :] - coords[None, s:e, :] + g - 1).long()
            aq, ak, av = (sum(t.double()[rel[..., a], a] for a in range(3)) for t in tables)
            logits = logits + torch.einsum("ihd,ijhd->hij", qw, aq) \
                + torch.einsum("jhd,ijhd->hij", kw, ak)
            vw = vw[None] + av
        else:
            vw = vw[None].expand(e - s, -1, -1, -1)
        outs.append(torch.einsum("hij,ijhd->ihd", logits.softmax(-1), vw))
    return torch.cat(outs)


def outputs_and_grads(fn, problem):
    """fn's output and the gradients of every leaf, with the problem's output gradient."""
    leaves = [t.detach().requires_grad_() for t in leaves_of(problem)]
    q, k, v, *tables = leaves
    _, _, _, offsets, coords, _, grad_out = problem
    out = fn(q, k, v, offsets, coords, tuple(tables) if tables else None)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def errors_vs_dense(fn, problem, scale):
    got = outputs_and_grads(fn, problem)
    want = outputs_and_grads(lambda q, k, v, o, c, t: dense_window_attention64(q, k, v, o, scale, c, t),
                             problem)
    return [rel_error(x, ref) for x, ref in zip(got, want)]


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_dense_float64(rel, dtype):
    problem = make_problem(rel=rel)

    def reference(q, k, v, offsets, coords, tables):
        return window_attention(q, k, v, offsets, coords=coords, tables=tables, dtype=dtype,
                                backend="reference")

    errors = errors_vs_dense(reference, problem, 16 ** -0.5)
    assert max(errors) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("rel,d", [(False, 16), (False, 64), (True, 16), (True, 32)])
def test_triton_float32_matches_dense_float64(rel, d):
    problem = make_problem(d=d, rel=rel, seed=1)

    def triton_fp32(q, k, v, offsets, coords, tables):
        return window_attention(q, k, v, offsets, coords=coords, tables=tables, scale=0.3,
                                dtype=torch.float32, backend="triton")

    errors = errors_vs_dense(triton_fp32, problem, 0.3)
    assert max(errors) < TOLERANCE[torch.float32], errors


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_matches_dense_float64(rel, dtype):
    """Within the dtype's tolerance, and within 3x the reference's own error (which rounds the
    same operands, but not dS as the kernels do): a kernel bug shows far above it."""
    problem = make_problem(rel=rel, seed=2)

    def run(backend):
        return lambda q, k, v, offsets, coords, tables: window_attention(
            q, k, v, offsets, coords=coords, tables=tables, dtype=dtype, backend=backend)

    errors = errors_vs_dense(run("triton"), problem, 16 ** -0.5)
    reference_errors = errors_vs_dense(run("reference"), problem, 16 ** -0.5)
    assert max(errors) < TOLERANCE[dtype], errors
    assert all(e < 3 * r + 1e-6 for e, r in zip(errors, reference_errors)), (errors, reference_errors)


def test_triton_output_keeps_the_input_dtype_and_matches_the_reference():
    q, k, v, offsets, coords, tables, _ = make_problem(seed=3)
    q, k, v = (t.float() for t in (q, k, v))
    tables = tuple(t.float() for t in tables)
    got = window_attention(q, k, v, offsets, coords=coords, tables=tables, dtype=torch.float16,
                           backend="triton")
    want = window_attention_reference(q, k, v, offsets, coords=coords, tables=tables,
                                      dtype=torch.float16)
    assert got.dtype == torch.float32
    assert rel_error(got, want) < 2e-3


def test_calls_without_gradients_give_the_autograd_path_bits():
    """Under no_grad (or with nothing requiring grad) the forward kernel runs without the op's
    autograd (which would save tensors for the backward): the same output, and no graph."""
    q, k, v, offsets, coords, tables, _ = make_problem(seed=5)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    tables = tuple(t.float() for t in tables)
    recorded = window_attention(q, k, v, offsets, coords=coords, tables=tables, backend="triton")

    def saved(t):
        pytest.fail("the op's autograd saved tensors")

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
        with torch.no_grad():
            unrecorded = window_attention(q, k, v, offsets, coords=coords, tables=tables, backend="triton")
        plain = window_attention(*(t.detach() for t in (q, k, v)), offsets, coords=coords, tables=tables,
                                 backend="triton")
    assert recorded.grad_fn is not None and unrecorded.grad_fn is None and plain.grad_fn is None
    assert torch.equal(unrecorded, recorded.detach()) and torch.equal(plain, recorded.detach())


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_points(backend):
    q = torch.randn(0, 2, 16, device=DEVICE)
    out = window_attention(q, q, q, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                           backend=backend)
    assert out.shape == (0, 2, 16)


def test_row_windows_kernel_matches_torch_with_empty_windows():
    offsets = torch.tensor([0, 0, 2, 2, 2, 3, 9, 9, 10, 10], dtype=torch.int32, device=DEVICE)
    got = launch_row_windows(offsets, 10)
    want = row_windows_from_offsets(offsets, 10)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert want[0].tolist() == [0, 0, 2, 3, 3, 3, 3, 3, 3, 9]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_row_windows_give_the_same_result_as_offsets(backend):
    """Row windows written out by hand (not from row_windows_from_offsets, which the offsets path uses)."""
    q, k, v, offsets, coords, tables, _ = make_problem(seed=4)
    q, k, v = (t.float() for t in (q, k, v))
    tables = tuple(t.float() for t in tables)
    bounds = offsets.tolist()
    start = torch.tensor([s for s, e in zip(bounds, bounds[1:]) for _ in range(s, e)], device=DEVICE)
    end = torch.tensor([e for s, e in zip(bounds, bounds[1:]) for _ in range(s, e)], device=DEVICE)
    by_offsets = window_attention(q, k, v, offsets, coords=coords, tables=tables, backend=backend)
    by_rows = window_attention(q, k, v, row_windows=(start, end), coords=coords, tables=tables,
                               backend=backend, validate=False)
    torch.testing.assert_close(by_rows, by_offsets)  # the reference's index_add is not bitwise stable on CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sphereformer_grid_in_triton_matches_dense_float64(dtype):
    """G = 24 (L = 47 table rows, padded to 64 per axis), as SphereFormer quantizes: relative
    indices reach both halves of the kernels' products by relative index."""
    problem = make_problem(sizes=[3, 17, 1, 40, 2, 0, 9], seed=5, g=24)

    def triton(q, k, v, offsets, coords, tables):
        return window_attention(q, k, v, offsets, coords=coords, tables=tables, dtype=dtype,
                                backend="triton")

    errors = errors_vs_dense(triton, problem, 16 ** -0.5)
    assert max(errors) < TOLERANCE[dtype], errors


def test_largest_grid_in_triton_matches_dense_float64():
    """G = COORD_LIMIT, the most the Triton backend takes, with every coordinate at 0 or G - 1: a
    field of the packed coordinates not masked, or narrower than G's bits, shows here."""
    g = COORD_LIMIT
    q, k, v, offsets, _, tables, grad = make_problem(sizes=[5, 6], seed=6, g=g)
    coords = torch.randint(0, 2, (q.shape[0], 3), generator=torch.Generator().manual_seed(6)).to(DEVICE) * (g - 1)

    def triton_fp32(q, k, v, offsets, coords, tables):
        return window_attention(q, k, v, offsets, coords=coords, tables=tables,
                                dtype=torch.float32, backend="triton")

    errors = errors_vs_dense(triton_fp32, (q, k, v, offsets, coords, tables, grad), 16 ** -0.5)
    assert max(errors) < TOLERANCE[torch.float32], errors


def bad_inputs():
    """(what to change in a valid call, the error's message)."""
    q, k, v, offsets, coords, tables, _ = make_problem()
    n = q.shape[0]
    good = dict(q=q, k=k, v=v, offsets=offsets, coords=coords, tables=tables)
    short_tables = tuple(t[:-1] for t in tables)
    wide_tables = tuple(t.new_zeros(2 * COORD_LIMIT + 1, *t.shape[1:]) for t in tables)  # G = COORD_LIMIT + 1
    start, end = row_windows_from_offsets(offsets, n)
    shifted = end.clone()
    shifted[1] += 1  # row 1 ends its window elsewhere than row 0 of the same window
    return [
        (dict(q=q.int()), "q must be a floating-point"),
        (dict(offsets=None), "as offsets or as row_windows"),
        (dict(row_windows=(start, end)), "as offsets or as row_windows"),
        (dict(offsets=None, row_windows=(start, end[:-1])), "row_windows must be"),
        (dict(offsets=None, row_windows=(start + 1, end)), "must hold each row"),
        (dict(offsets=None, row_windows=(start, shifted)), "contiguous windows"),
        (dict(k=k[:-1]), "one shape"),
        (dict(offsets=offsets.float()), "offsets must be a 1-D integer"),
        (dict(offsets=torch.cat([offsets[:-1], offsets[-1:] + 1])), "end at N"),
        (dict(offsets=torch.tensor([0, 5, 3, n], dtype=torch.int32, device=DEVICE)),
         "non-decreasing"),
        (dict(coords=None), "both coords and tables"),
        (dict(coords=coords[:, :2]), "coords must be an integer"),
        (dict(coords=coords + G), r"coords must lie in \[0, 3\]"),
        (dict(tables=tables[:2]), "tables must be a"),
        (dict(tables=short_tables), "odd L"),
        (dict(tables=(tables[0], tables[1][:, :, :1], tables[2])), "table tk must be"),
        (dict(scale="0.1"), "scale must be a number"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(dtype=torch.float64, backend="triton"), "Triton backend computes in"),
        (dict(tables=wide_tables, dtype=torch.float32, backend="triton"), "Triton backend takes G <= 128"),
        (dict(q=q[..., :12], k=k[..., :12], v=v[..., :12], coords=None, tables=None,
              dtype=torch.float32, backend="triton"), "head_dim a power of two"),
    ], good


@pytest.mark.parametrize("case", range(len(bad_inputs()[0])))
def test_bad_inputs_raise_clear_errors(case):
    changes, good = bad_inputs()
    change, message = changes[case]
    args = {**good, **change}
    positional = [args.pop(name) for name in ("q", "k", "v", "offsets")]
    with pytest.raises(ValueError, match=message):
        window_attention(*positional, **args)


def test_row_windows_from_sptr_pairs_match_offsets():
    from lowconv.compat import sptr
    counts = torch.tensor([s for s in SIZES if s], device=DEVICE)  # SpTr has no empty windows
    n = int(counts.sum())
    index_0_offsets, _, _, index_1 = sptr.precompute_all(n, len(counts), int(counts.max()), counts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    got = sptr.row_windows_from_pairs(index_0_offsets, index_1)
    assert [t.tolist() for t in got] == [t.tolist() for t in row_windows_from_offsets(offsets, n)]


@pytest.mark.parametrize("dtype, axis", [(torch.float32, 0), (torch.float16, 2)])
def test_split_axis_matches_float64(dtype, axis):
    """A split axis (SplitAxis: one axis's index from per-point values, buckets 0 to 2G-1 over
    tables of 2G rows) on Triton, forward and every gradient, against the torch reference in
    float64."""
    q, k, v, offsets, coords, _, grad_out = make_problem(sizes=SPLIT_SIZES)
    gen = torch.Generator().manual_seed(1)
    tables = tuple(0.5 * torch.randn(2 * G, 3, 2, 16, generator=gen, dtype=torch.float64).to(DEVICE) for _ in range(3))
    values = torch.randn(q.shape[0], generator=gen).to(DEVICE)
    thresholds = torch.tensor([-1.0, -0.5, -0.1, 0.0, 0.0, 0.4, 1.2]).to(DEVICE)  # buckets 0 to 7
    problem = q, k, v, offsets, coords, tables, grad_out

    def with_split(backend, compute):
        def fn(q, k, v, offsets, coords, tables):
            split = SplitAxis(axis, values, thresholds, 0)
            return window_attention(q, k, v, offsets, coords=coords, tables=tables, split=split, dtype=compute,
                                    backend=backend)
        return fn

    expected = outputs_and_grads(with_split("reference", torch.float64), problem)
    got = outputs_and_grads(with_split("triton", dtype), problem)
    errors = [rel_error(x, ref) for x, ref in zip(got, expected)]
    assert max(errors) < TOLERANCE[dtype], errors
