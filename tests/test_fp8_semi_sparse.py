"""The fp8_semi_sparse op on the CPU: a 2:4 e4m3 weight that computes fp8's products of the pruned
weight, its options and load checks, its checkpoint served as fp8's, the compiled reference path,
and the scaling kernel of its cuSPARSELt path (Triton's interpreter in CI)."""
import pytest
import torch

from lowconv.errors import LowconvError
from lowconv.hf import quantization_config
from lowconv.kernels.fp8 import E4M3
from lowconv.kernels.fp8_sparse24 import scale_product, scale_product_reference
from lowconv.kernels.sparse24 import prune_24
from lowconv.ops import fp8
from lowconv.ops.fp8_semi_sparse import Fp8SemiSparseLinear, Fp8SemiSparseOptions
from lowconv.plan import Decision, Plan
from lowconv.recipe import decide, load_recipe, parse_recipe
from tests.compiled import compile_recording, lowconv_ops
from tests.sites import linear_site

from_site, empty, site_problem = (Fp8SemiSparseLinear.from_site, Fp8SemiSparseLinear.empty,
                                  Fp8SemiSparseLinear.site_problem)


def layer(options=None, in_features=64, out_features=48, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    site = linear_site(in_features, out_features, True, str(dtype).removeprefix("torch."))
    params = {"weight": torch.randn(out_features, in_features, dtype=dtype),
              "bias": torch.randn(out_features, dtype=dtype)}
    return site, params, from_site(site, options or Fp8SemiSparseOptions(), params)


@pytest.mark.parametrize("granularity", ["tensor", "row", "token"])
def test_the_weight_is_2_4_and_the_layer_computes_fp8s_product_of_the_pruned_weight(granularity):
    options = Fp8SemiSparseOptions(granularity=granularity)
    site, params, module = layer(options)
    nonzero = (module.weight.view(torch.uint8) & 0x7F) != 0
    assert (nonzero.reshape(48, -1, 4).sum(-1) <= 2).all()
    pruned = {**params, "weight": prune_24(params["weight"])}
    dense = fp8.Fp8Linear.from_site(site, fp8.Fp8Options(granularity=granularity), pruned)
    assert torch.equal(module.weight.view(torch.uint8), dense.weight.view(torch.uint8))
    x = torch.randn(3, 7, 64)
    assert torch.equal(module(x), dense(x))
    assert torch.equal(module(x, activation="gelu"), dense(x, activation="gelu"))
    assert "no CUDA backend chosen yet" in module.plan_note()


@pytest.mark.parametrize("option", ['scaling = "static"', "training = true", "amax_history_len = 4",
                                    "fp8_all_gather = true"])
def test_fp8s_other_options_are_no_keys_of_this_op(option):
    """Inference with x scaled dynamically: fp8's scaling, training and delayed-scaling options are
    unknown keys here, and the error lists the valid ones."""
    text = f'name = "r"\n[[rules]]\nkind = "linear"\nop = "fp8_semi_sparse"\noptions = {{ {option} }}\n'
    with pytest.raises(LowconvError, match=option.split()[0]) as error:
        parse_recipe(text, "r.toml")
    assert "backend" in str(error.value) and "granularity" in str(error.value)


def test_the_layer_prints_what_it_reads_of_fp8s_options():
    """Its Options fix what fp8's layer reads but this op does not take (fp8_all_gather too)."""
    assert "scaling=dynamic, granularity=row, training=False" in repr(layer()[2])


@pytest.mark.parametrize("recipe", ["fp8-semi-sparse", "semi-sparse", "mixed"])
def test_the_2_4_recipes_find_mlps_by_their_common_names_but_not_routers(recipe):
    rules = load_recipe(recipe).rules
    mlp = [linear_site(64, 64, fqn=fqn) for fqn in
           ("model.layers.0.mlp.gate_proj", "model.decoder.layers.3.fc1", "transformer.layer.0.ffn.lin1",
            "blocks.0.mlp.fc2", "layers.1.feed_forward.0")]
    router = linear_site(64, 64, fqn="model.layers.0.mlp.gate")  # a mixture of experts' (Qwen's)
    two_four = {"semi_sparse", "fp8_semi_sparse"}
    assert all(decide(site, rules).op in two_four for site in mlp)
    assert decide(router, rules).op not in two_four


def test_check_names_the_shapes_it_cannot_take():
    options = Fp8SemiSparseOptions()
    assert "divisible by 4" in site_problem(linear_site(66, 48), options)
    assert site_problem(linear_site(64, 48), options) is None
    # cuSPARSELt's e4m3 GEMM takes multiples of 32; "auto" would run the dense FP8 GEMM there
    assert "multiples of 32" in site_problem(linear_site(64, 48), Fp8SemiSparseOptions(backend="cusparselt"))


def test_a_loaded_weight_that_is_not_2_4_is_named():
    site, params, module = layer()
    state = module.state_dict()
    loaded = empty(site, Fp8SemiSparseOptions())
    loaded.load_state_dict(state)
    assert loaded.loaded_state_problem() is None
    dense = state["weight"].clone()
    dense[0, :4] = torch.tensor([1.0, 2.0, 3.0, 0.0]).to(E4M3)
    loaded.load_state_dict({**state, "weight": dense})
    assert "1 groups keep more" in loaded.loaded_state_problem()


def test_the_checkpoint_is_served_as_an_fp8_one():
    options = Fp8SemiSparseOptions(granularity="row", fast_accum=True, backend="auto")
    site = linear_site(64, 64, fqn="mlp.fc1")
    site.module_backed = True
    decision = Decision(site=site.describe(), op="fp8_semi_sparse", options=options, rule=1, reason="")
    config = quantization_config(Plan("r", "", [decision], [], {}, []))
    group = config["config_groups"]["group_0"]
    assert config["quant_method"] == "compressed-tensors" and group["targets"] == ["mlp.fc1"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"


def test_the_layer_compiles_whole_on_the_reference_path():
    torch._dynamo.reset()
    _, _, module = layer()
    run, graphs = compile_recording(module)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(run(x), module(x), rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1 and lowconv_ops(graphs) == {"lowconv::fp8_gemm"}


@pytest.mark.parametrize("x_rows, w_rows, bias", [(True, True, True), (False, False, False), (True, False, True)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_scaling_kernel_computes_the_reference(x_rows, w_rows, bias, out_dtype):
    """The product comes as cuSPARSELt lays it out (y^T row-major, M padded, read through its
    transposed view); the kernel writes y row-major, the reference's numbers to the last place (on
    the GPU too: scripts/gpu_check.sh runs this file there)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    m, n = 70, 96
    stored = (torch.randn(n, 80, generator=gen, device=device) * 1e4).to(torch.bfloat16)
    product = stored[:, :m].t().reshape(2, 35, n)
    x_scale = torch.rand((2, 35, 1) if x_rows else (1,), generator=gen, device=device)
    w_scale = torch.rand((n, 1) if w_rows else (1,), generator=gen, device=device).to(torch.bfloat16)
    b = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if bias else None
    got = scale_product(product, x_scale, w_scale, b, out_dtype)
    assert got.is_contiguous() and got.shape == (2, 35, n) and got.dtype == out_dtype
    want = scale_product_reference(product, x_scale, w_scale, b, out_dtype)
    # Both within a rounding of float64's numbers: the kernel adds the bias in an FMA (one rounding
    # fewer than the reference), and the interpreter's bf16 cast truncates.
    scaled = product.double() * x_scale.double() * w_scale.double().reshape(-1)
    exact = scaled + (0 if b is None else b.double())
    bound = 2 * torch.finfo(out_dtype).eps * (scaled.abs() + (0 if b is None else b.double().abs()))
    assert ((got.double() - exact).abs() <= bound).all() and ((want.double() - exact).abs() <= bound).all()


def test_forcing_cusparselt_without_a_gpu_says_why():
    from lowconv.kernels.fp8_sparse24 import GemmCase, choose_backend
    case = GemmCase(64, 64, 64, True, True, False, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(LowconvError, match="CUDA"):
        choose_backend("cusparselt", case)
    assert choose_backend("auto", case).backend == "dense"
