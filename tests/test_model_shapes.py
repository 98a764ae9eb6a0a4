"""Models beyond the examples: the shapes of real code that the spine must convert, save, load, compare."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowconv
from lowconv.errors import LowconvError
from lowconv.recipe import parse_recipe


def roundtrip(model, inputs, recipe, tmp_path, load_inputs=None):
    """convert -> save -> load: the reloaded model's outputs equal the converted one's."""
    converted = lowconv.convert(model, recipe, inputs)
    lowconv.save(converted, tmp_path)
    again = lowconv.load(model, tmp_path, example_inputs=load_inputs)
    with torch.no_grad():
        first = lambda o: o if isinstance(o, torch.Tensor) else o[0]  # noqa: E731
        assert torch.equal(first(again(*inputs)), first(converted(*inputs)))
    return converted


class MupAttention(nn.Module):
    """Scores scaled by 1/head_dim computed from a size: the scale is known only with shapes."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = ((q @ k.transpose(-2, -1)) / k.size(-1)).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


def test_site_matched_with_shapes_loads_and_compares(tmp_path):
    model, inputs = MupAttention().eval(), (torch.randn(2, 8, 64),)
    converted = roundtrip(model, inputs, "sparse-attention-bf16", tmp_path, load_inputs=inputs)
    [decision] = converted.lowconv_plan.converted()
    assert decision.site.info.scale == 1 / 16
    report = lowconv.compare(model, converted, inputs)
    assert report.sites[0].alone.sqnr_db > 40
    # Without inputs the site is found again by its graph; the scale comes from the plan.
    with torch.no_grad():
        assert torch.equal(lowconv.load(model, tmp_path)(*inputs), converted(*inputs))


def test_load_refuses_a_model_whose_code_changed(tmp_path):
    model, inputs = MupAttention().eval(), (torch.randn(2, 8, 64),)
    lowconv.save(lowconv.convert(model, "sparse-attention-bf16", inputs), tmp_path)
    class Changed(MupAttention):  # the same parameters; a softmax in float32 now
        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            att = ((q @ k.transpose(-2, -1)) / k.size(-1)).float().softmax(dim=-1)
            return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))

    changed = Changed().eval()
    with pytest.raises(LowconvError, match="attention is not the site that was converted"):
        lowconv.load(changed, tmp_path)


class LongRowsScaled(MupAttention):
    def forward(self, x):  # a branch on the input's shape: load traces it again on inputs
        return super().forward(x * 0.5 if x.shape[1] > 4 else x)


class PackedRows(nn.Module):
    """Rows cut into parts by the sizes of an int input, then attended: run on stand-ins (ones) of
    the sizes, the split does not add up."""

    def __init__(self):
        super().__init__()
        self.attention = LongRowsScaled()

    def forward(self, x, sizes):
        return self.attention(torch.cat(torch.split(x, sizes.tolist(), dim=1), dim=1))


def test_load_on_made_up_inputs_that_the_model_refuses_says_to_pass_them(tmp_path):
    model, inputs = PackedRows().eval(), (torch.randn(2, 8, 64), torch.tensor([3, 5]))
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    lowconv.save(converted, tmp_path)
    with pytest.raises(LowconvError, match=r"stand-ins of the inputs .* example_inputs=\.\.\."):
        lowconv.load(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(lowconv.load(model, tmp_path, example_inputs=inputs)(*inputs), converted(*inputs))


def test_train_mode_model_keeps_its_batchnorm_statistics():
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))  # train mode
    inputs = (torch.randn(8, 32) * 3 + 1,)
    before = copy.deepcopy(model.state_dict())
    converted = lowconv.convert(model, "keep-all", inputs)
    report = lowconv.compare(model, converted, inputs)
    assert report.outputs[0].metrics.max_abs == 0 and converted.training
    assert all(torch.equal(v, converted.state_dict()[k]) for k, v in before.items())


def test_transformer_encoder_attention_converts(tmp_path):
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    inputs = (torch.randn(2, 10, 64),)
    # the layers are traced into (their fast path is never taken): their branches need the inputs
    converted = roundtrip(model, inputs, "sparse-attention-bf16", tmp_path, load_inputs=inputs)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == ["layers.0.self_attn", "layers.1.self_attn"]
    report = lowconv.compare(model, converted, inputs)
    assert report.outputs[0].metrics.sqnr_db > 40 and len(report.sites) == 2


@pytest.mark.parametrize("module, inputs, recipe", [
    (nn.Linear(64, 32), (torch.randn(4, 64),), "fp8-dynamic"),
    (nn.MultiheadAttention(64, 4, batch_first=True), (torch.randn(2, 5, 64),) * 3, "sparse-attention-bf16"),
])
def test_a_site_module_as_the_whole_model(module, inputs, recipe, tmp_path):
    converted = roundtrip(module.eval(), inputs, recipe, tmp_path)
    assert [d.fqn for d in converted.lowconv_plan.converted()] == [""]


def test_swaps_only_keep_the_models_class():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
    converted = lowconv.convert(model, "fp8-dynamic", (torch.randn(4, 32),))
    assert type(converted) is nn.Sequential


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2Attention(nn.Module):
    """Hugging Face's GPT-2 pattern (Conv1D projections) under code that does not trace: a branch
    on data stops tracing here, not in Conv1D."""

    def __init__(self, dim=64):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(3 * dim, dim), Conv1D(dim, dim)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        w = q @ k.transpose(-1, -2)
        if w.isnan().any():
            w = w.nan_to_num()
        return self.c_proj(w.softmax(-1) @ v)


def test_conv1d_under_untraceable_code_converts(tmp_path):
    model, inputs = GPT2Attention().eval(), (torch.randn(2, 6, 64),)
    converted = roundtrip(model, inputs, "fp8-row", tmp_path)
    plan = converted.lowconv_plan
    assert [u["fqn"] for u in plan.untraced] == [""]
    assert [d.fqn for d in plan.converted()] == ["c_attn.linear", "c_proj.linear"]
    assert lowconv.compare(model, converted, inputs).outputs[0].metrics.sqnr_db > 20


class SdpaBlock(nn.Module):
    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_mask_kind_follows_the_mask_given_at_run_time():
    q = torch.randn(2, 4, 8, 16)
    keep = torch.rand(2, 1, 8, 8) > 0.3
    keep[..., 0] = True
    converted = lowconv.convert(SdpaBlock(), "sparse-attention-bf16", (q, q, q, keep))  # traced with a bool mask
    for mask in (keep, torch.where(keep, 0.0, float("-inf"))):
        ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(),
                                             attn_mask=mask if mask.dtype == torch.bool else mask.double())
        out = converted(q, q, q, mask)
        assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_argument_that_was_none_is_traced_as_none():
    """`if mask is None` must take the branch the example took, and say so when called otherwise."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, q, mask=None):
            causal = mask is None
            return self.proj(F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=causal))

    model, q = Masked().eval(), torch.randn(2, 4, 8, 16)
    converted = lowconv.convert(model, "sparse-attention-bf16", (q,))
    [attention] = converted.lowconv_plan.converted()
    assert attention.site.info.causal and converted.lowconv_plan.none_args == {"": ["mask"]}
    assert lowconv.compare(model, converted, (q,)).outputs[0].metrics.sqnr_db > 40
    with pytest.raises(AssertionError, match="mask was None in the example inputs at conversion"):
        converted(q, torch.ones(8, 8, dtype=torch.bool))


class NanoGPTAttention(nn.Module):
    """nanoGPT's manual path: a causal tril buffer sliced to T, masked_fill with -inf."""

    def __init__(self, dim=64, heads=4, context=16):
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


def test_nanogpt_causal_buffer_becomes_causal(tmp_path):
    model, inputs = NanoGPTAttention().eval(), (torch.randn(2, 12, 64),)
    converted = roundtrip(model, inputs, "mixed", tmp_path)
    attention = next(d for d in converted.lowconv_plan.converted() if d.site.kind == "attention")
    assert attention.site.info.causal and attention.site.info.mask == "none"
    assert attention.site.info.scale is None  # 1/sqrt(head_dim), found from the code
    assert "bias" in converted.state_dict()  # the user's buffer stays
    assert lowconv.compare(model, converted, inputs).outputs[0].metrics.sqnr_db > 20


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, q):
        y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1 if self.training else 0.0)
        return self.proj(F.dropout(y, 0.1, training=self.training))


def test_model_converted_in_train_mode_is_traced_in_eval_mode_with_a_warning():
    model, q = FunctionalDropout().train(), torch.randn(2, 4, 8, 16)
    converted = lowconv.convert(model, "sparse-attention-bf16", (q,))
    assert converted.training and "branches on self.training" in converted.lowconv_plan.warnings[0]
    converted.eval()
    with torch.no_grad():
        assert torch.equal(converted(q), converted(q))  # no dropout frozen in


class ReadsWeights(nn.Module):
    """Code that reads linears' parameters itself, beside calling the linears."""

    def __init__(self):
        super().__init__()
        self.fc, self.free = nn.Linear(16, 16), nn.Linear(16, 16)
        self.inner = nn.Sequential(nn.Linear(16, 16))

    def forward(self, x):
        return self.free(self.inner(self.fc(x) + self.fc.weight.sum())) * self.inner[0].bias.norm()


def test_a_linear_whose_parameters_other_code_reads_is_kept():
    model, inputs = ReadsWeights().eval(), (torch.randn(4, 16),)
    converted = lowconv.convert(model, "fp8-row", inputs)
    decisions = {d.site.fqn: d for d in converted.lowconv_plan.decisions}
    assert [d.site.fqn for d in converted.lowconv_plan.converted()] == ["free"]
    assert "fc.weight is also read by other code" in decisions["fc"].reason
    assert "inner.0.bias is also read by other code" in decisions["inner.0"].reason
    with torch.no_grad():
        converted(*inputs)


def test_convert_names_a_wrong_argument():
    model, inputs = nn.Linear(4, 4), (torch.randn(2, 4),)
    with pytest.raises(LowconvError, match="example_inputs is None"):
        lowconv.convert(model, "fp8-dynamic", None)
    with pytest.raises(LowconvError, match="model must be a torch.nn.Module, got str"):
        lowconv.convert("model.py", "fp8-dynamic", inputs)
    with pytest.raises(LowconvError, match="recipe must be a file path, a built-in recipe's name or a Recipe, got int"):
        lowconv.convert(model, 5, inputs)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(LowconvError, match=r"2 tensors on the meta device \(no values\), e.g. 0.weight, 0.bias: load"):
        lowconv.convert(empty, "fp8-dynamic", (torch.randn(4, 32, device="meta"),))


def test_a_model_whose_own_output_is_nan_is_named_as_such():
    model = nn.Sequential(nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    inputs = (torch.randn(2, 16),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    with pytest.raises(LowconvError, match=r"the model's own output \(output\) holds 2 NaN values"):
        lowconv.compare(model, converted, inputs)


class MaskedLogits(nn.Module):
    """Logits of illegal actions set to -inf, as in constrained decoding or RL action masks."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.register_buffer("legal", torch.arange(64) < 48)

    def forward(self, x):
        return self.fc(x).masked_fill(~self.legal, float("-inf"))


def test_an_output_with_inf_is_compared_where_it_is_finite():
    model, inputs = MaskedLogits().eval(), (torch.randn(4, 64),)
    report = lowconv.compare(model, lowconv.convert(model, "fp8-dynamic", inputs), inputs, logits=True)
    out = report.outputs[0]
    assert report.passed and 20 < out.metrics.sqnr_db < 40 and out.metrics.changed_inf == 0
    assert out.logits.kl < 0.1


@pytest.mark.parametrize("calibration, message", [
    ([], "calibration holds no batch"),
    (5, "calibration must be an iterable of example inputs .* got int"),
    (torch.randn(4, 16), "calibration must be an iterable of example inputs .* got Tensor"),
])
def test_static_scales_need_real_calibration_batches(calibration, message):
    model, inputs = nn.Sequential(nn.Linear(16, 16)), (torch.randn(2, 16),)
    with pytest.raises(LowconvError, match=message):
        lowconv.convert(model, "fp8-static", inputs, calibration=calibration)


def test_a_map_style_dataset_calibrates():
    model, inputs = nn.Sequential(nn.Linear(16, 16)), (torch.randn(2, 16),)
    dataset = torch.utils.data.TensorDataset(torch.randn(3, 2, 16))  # items are 1-tuples: forward args
    converted = lowconv.convert(model, "fp8-static", inputs, calibration=dataset)
    with torch.no_grad():
        assert torch.isfinite(converted(*inputs)).all()


def test_converting_a_converted_model_is_refused_with_the_way_out():
    """Its checkpoint would hold a plan of the second conversion only: loaded on the original, another model."""
    model, inputs = nn.Sequential(nn.Linear(16, 16)), (torch.randn(2, 16),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    with pytest.raises(LowconvError, match=r"made by lowconv and 1 of its sites are lowconv's op modules .* "
                                           r"lowconv.revert\(model\) first"):
        lowconv.convert(converted, "fp8-dynamic", inputs)


def test_loading_into_a_converted_model_says_to_pass_the_original(tmp_path):
    model, inputs = nn.Sequential(nn.Linear(16, 16)).eval(), (torch.randn(2, 16),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    lowconv.save(converted, tmp_path)
    with pytest.raises(LowconvError, match="made by lowconv .* pass the model as it was before convert"):
        lowconv.load(converted, tmp_path)


def test_python_convert_warns_of_its_plans_warnings_and_of_weights_training_leaves():
    model, inputs = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).train(), (torch.randn(2, 16),)
    with pytest.warns(lowconv.LowconvWarning, match=r"train mode, but 2 converted linears \(0, 1\) hold"):
        converted = lowconv.convert(model, "fp8-dynamic", inputs)
    assert converted.lowconv_plan.warnings == []  # the plan (and its checkpoint) is the same in eval mode
    training = parse_recipe('[[rules]]\nop = "fp8"\noptions = { training = true }')
    with warnings.catch_warnings():
        warnings.simplefilter("error", lowconv.LowconvWarning)
        assert lowconv.convert(model, training, inputs).lowconv_plan.warnings == []


def test_a_recipe_whose_sites_all_refuse_its_op_says_nothing_was_converted():
    model, inputs = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval(), (torch.randn(2, 64),)
    with pytest.warns(lowconv.LowconvWarning, match=r"no site is converted: the recipe's rules chose an op for 2 "
                                                     r"sites and none took it \(e.g. 0: rule 2 chose fp8, but fp8 block"):
        lowconv.convert(model, "fp8-block", inputs)
    assert lowconv.convert(model, "keep-all", inputs).lowconv_plan.warnings == []  # keeping is what it chose


class GeneratesToo(nn.Module):
    """A functional linear in the model's own forward (GPT-2's Conv1D is one): the whole model
    becomes a GraphModule, which has forward() only."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        return F.linear(x, self.weight)

    def generate(self, x):
        return self(x).argmax(-1)


def test_a_model_rewritten_whole_warns_of_the_methods_it_loses(tmp_path):
    model, inputs = GeneratesToo().eval(), (torch.randn(2, 32),)
    with pytest.warns(lowconv.LowconvWarning, match=r"GraphModule of the whole GeneratesToo .*: generate\(\) is not"):
        converted = lowconv.convert(model, "fp8-dynamic", inputs)
    assert not hasattr(converted, "generate")
    lowconv.save(converted, tmp_path)
    with pytest.warns(lowconv.LowconvWarning, match=r"generate\(\) is not on it"):
        lowconv.load(model, tmp_path)
    with warnings.catch_warnings():  # a conversion that swaps modules keeps the model's class and methods
        warnings.simplefilter("error", lowconv.LowconvWarning)
        lowconv.convert(nn.Sequential(nn.Linear(16, 16)).eval(), "fp8-dynamic", (torch.randn(2, 16),))


class ReadsWeightDevice(nn.Module):
    """Code that reads a linear's weight only for its device (a common way to place new tensors)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) + torch.ones(16, device=self.fc.weight.device)


def test_a_linear_whose_weight_device_other_code_reads_converts_where_the_op_keeps_a_weight():
    model, inputs = ReadsWeightDevice().eval(), (torch.randn(4, 16),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    assert [d.site.fqn for d in converted.lowconv_plan.converted()] == ["fc"]
    with torch.no_grad():
        assert torch.isfinite(converted(*inputs)).all()
    recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "semi_sparse"\n', "r.toml")
    [decision] = lowconv.convert(model, recipe, inputs).lowconv_plan.decisions
    assert decision.op == "keep" and "reads this layer's weight (its device)" in decision.reason


@pytest.mark.parametrize("rule", ['op = "fp8"\noptions = { training = true }',
                                  'op = "fp8"\noptions = { training = true, scaling = "delayed" }',
                                  'op = "semi_sparse"\noptions = { target = "activation" }',
                                  'op = "semi_sparse"\noptions = { training = true }'])
def test_an_empty_batch_runs_forward_and_backward(rule):
    model, x = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)), torch.randn(8, 64)
    converted = lowconv.convert(model, lowconv.recipe.parse_recipe(f"[[rules]]\n{rule}\n", "r.toml"), (x,))
    empty = torch.randn(0, 64, requires_grad=True)
    y = converted(empty)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert empty.grad.shape == (0, 64)


def test_a_deepcopy_of_a_rewritten_graph_keeps_the_plan():
    model, inputs = MupAttention().eval(), (torch.randn(2, 8, 64),)
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert isinstance(converted, torch.fx.GraphModule)  # the attention site rewrote the graph
    copied = copy.deepcopy(converted)
    assert copied.lowconv_plan == converted.lowconv_plan
    lowconv.revert(copied)


@pytest.mark.parametrize("rule", ['op = "fp8"', 'op = "fp8"\noptions = { training = true }',
                                  'op = "semi_sparse"', 'op = "semi_sparse"\noptions = { training = true }',
                                  'op = "semi_sparse"\noptions = { mask = "runtime" }'])
def test_converted_linears_answer_autocast_as_nn_linear_does(rule):
    model, x = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)), torch.randn(8, 64)
    converted = lowconv.convert(model, lowconv.recipe.parse_recipe(f"[[rules]]\n{rule}\n", "r.toml"), (x,))
    with torch.autocast("cpu", torch.bfloat16):
        want, got = model(x), converted(x)
    assert got.dtype == want.dtype == torch.bfloat16
    got.float().sum().backward()  # differentiable through the cast


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_an_fp8_linear_casts_an_fp32_input_under_autocast_as_nn_linear_does(training):
    """Its GEMM writes autocast's dtype (on the GPU an fp32 x with row scales would take the fp32
    reference GEMM): the layer computes, forward and backward, what it computes on x in that dtype."""
    model, x = nn.Sequential(nn.Linear(64, 32)), torch.randn(8, 64)
    recipe = f'[[rules]]\nop = "fp8"\noptions = {{ granularity = "row", training = {str(training).lower()} }}\n'
    converted = lowconv.convert(model, lowconv.recipe.parse_recipe(recipe, "r.toml"), (x,))
    x_autocast, x_cast = x.clone().requires_grad_(), x.bfloat16().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        got = converted(x_autocast)
    want = converted(x_cast)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    want.float().sum().backward()
    assert x_autocast.grad.dtype == torch.float32 and torch.equal(x_autocast.grad, x_cast.grad.float())


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_an_fp16acc_linear_takes_an_fp32_input_under_autocast(autocast_dtype):
    model, x = nn.Sequential(nn.Linear(64, 32)).half(), torch.randn(8, 64)
    converted = lowconv.convert(model, "fp16acc", (x.half(),))
    with torch.autocast("cpu", autocast_dtype):
        want, got = model(x), converted(x)
    assert got.dtype == want.dtype == autocast_dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class Chained(nn.Module):
    """Sites that read each other's outputs: a low-rank pair of F.linear, and q, k, v straight
    from F.linear into SDPA."""

    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Parameter(torch.randn(16, 64) / 8), nn.Parameter(torch.randn(64, 16) / 4)
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(64, 64) / 8) for _ in range(3))

    def forward(self, x):
        h = F.linear(F.linear(x, self.down), self.up)
        return F.scaled_dot_product_attention(F.linear(h, self.wq), F.linear(h, self.wk), F.linear(h, self.wv))


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "mixed"])
def test_sites_that_read_each_others_outputs_convert(recipe, tmp_path):
    torch.manual_seed(0)
    model, inputs = Chained().eval(), (torch.randn(2, 8, 64),)
    converted = roundtrip(model, inputs, recipe, tmp_path)
    fqns = {d.fqn for d in converted.lowconv_plan.converted()}
    assert {"down", "up", "wq", "wk", "wv"} <= fqns and ("attention" in fqns) == (recipe == "mixed")
    report = lowconv.compare(model, converted, inputs)
    assert report.passed and report.outputs[0].metrics.sqnr_db > 15  # fp8 and bf16 attention: ~20-30 dB


class KeywordCalls(nn.Module):
    """An nn.Linear and an F.linear called with keyword arguments, as their signatures allow."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.w, self.b = nn.Parameter(torch.randn(32, 64) / 8), nn.Parameter(torch.zeros(32))

    def forward(self, x):
        return F.linear(input=self.fc(input=x), weight=self.w, bias=self.b)


@pytest.mark.parametrize("recipe, dtype", [("fp8-dynamic", torch.float32), ("semi_sparse", torch.float32),
                                           ("fp16acc", torch.float16)])
def test_linears_called_with_keywords_convert(recipe, dtype, tmp_path):
    model, inputs = KeywordCalls().eval().to(dtype), (torch.randn(4, 64, dtype=dtype),)
    if recipe == "semi_sparse":  # every linear, not only the MLPs the built-in recipe takes
        recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "semi_sparse"\n', "r.toml")
    converted = roundtrip(model, inputs, recipe, tmp_path)
    assert {d.fqn for d in converted.lowconv_plan.converted()} == {"fc", "w"}


@pytest.mark.parametrize("op, options", [("fp8", "{ training = true }"), ("fp8", "{}"),
                                         ("semi_sparse", "{ training = true }"), ("dense", "{}")])
def test_frozen_parameters_stay_frozen(op, options, tmp_path):
    model, inputs = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)), (torch.randn(8, 32),)
    model[0].requires_grad_(False)
    recipe = lowconv.recipe.parse_recipe(f'[[rules]]\nop = "{op}"\noptions = {options}\n', "r.toml")
    converted = lowconv.convert(model, recipe, inputs)
    lowconv.save(converted, tmp_path)
    trainable = {name for name, p in converted.named_parameters() if p.requires_grad}
    assert trainable and not {name for name in trainable if name.startswith("0.")}
    assert {n for n, p in lowconv.load(model, tmp_path).named_parameters() if p.requires_grad} == trainable
    reverted = lowconv.revert(converted) if op != "dense" else converted
    assert not any(p.requires_grad for p in reverted[0].parameters())
    assert reverted[2].bias.requires_grad


def test_frozen_attention_projections_stay_frozen():
    model, inputs = TinyMha().eval(), (torch.randn(2, 5, 32),)
    model.mha.in_proj_weight.requires_grad_(False)
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert {n for n, p in converted.named_parameters() if not p.requires_grad} == {"mha.in_proj_weight"}


class TinyMha(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class SharedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.b.bias = self.a.bias

    def forward(self, x):
        return self.b(self.a(x))


def test_a_bias_shared_by_two_linears_keeps_both():
    model, inputs = SharedBias(), (torch.randn(4, 32),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    assert not converted.lowconv_plan.converted()
    assert all("bias is tied to" in d.reason for d in converted.lowconv_plan.decisions)


@pytest.mark.parametrize("parametrize", ["weight_norm", "spectral_norm"])
def test_a_parametrized_linear_is_kept_with_the_reason(parametrize):
    model, inputs = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval(), (torch.randn(8, 32),)
    getattr(torch.nn.utils.parametrizations, parametrize)(model[0])
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    decisions = {d.fqn: d for d in converted.lowconv_plan.decisions}
    assert decisions["0"].op == "keep" and "computed on access" in decisions["0"].reason
    assert decisions["2"].op == "fp8"
    assert torch.allclose(converted(*inputs), model(*inputs), atol=0.1)


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_a_model_that_cannot_be_copied_is_a_lowconv_error():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    torch.nn.utils.weight_norm(model[0])  # the legacy form: its hook holds a non-leaf weight
    with pytest.raises(LowconvError, match="the model cannot be copied .*RuntimeError: Only Tensors created"):
        lowconv.convert(model, "fp8-dynamic", (torch.randn(8, 32),))


def test_hooks_on_swapped_modules_still_run():
    model, inputs = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval(), (torch.randn(8, 32),)
    model[2].register_forward_hook(lambda module, args, output: output + 100)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    assert converted[2].__class__.__name__ != "Linear" and 99 < converted(*inputs).mean() < 101
    assert lowconv.compare(model, converted, inputs).passed
    assert 99 < lowconv.revert(converted)(*inputs).mean() < 101


def test_hooks_of_a_traced_region_run_at_its_root_and_are_warned_about_inside():
    from lowconv.model_file import load_model_file
    loaded = load_model_file("examples/vit.py")
    seen = []
    loaded.model.register_forward_hook(lambda *args: seen.append("root"))
    loaded.model.blocks[0].attn.register_forward_hook(lambda *args: seen.append("attn"))
    converted = lowconv.convert(loaded.model, "sparse-attention-bf16", loaded.inputs)
    seen.clear()
    converted(*loaded.inputs)
    assert seen == ["root"]
    assert any("traced through blocks.0.attn, which has hooks: tracing ran them once" in w
               for w in converted.lowconv_plan.warnings)


class Looped(nn.Module):
    """One linear applied four times: its error grows from call to call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        for _ in range(4):
            x = torch.tanh(self.fc(x))
        return x


def test_a_site_called_several_times_reports_its_worst_call():
    from lowconv.report import tensor_metrics
    model, inputs = Looped().eval(), (torch.randn(8, 64),)
    converted = lowconv.convert(model, lowconv.recipe.parse_recipe('[[rules]]\nop = "semi_sparse"\n', "r.toml"), inputs)
    [row] = lowconv.compare(model, converted, inputs).sites
    outputs = {}
    for name, net in (("original", model), ("converted", converted)):
        fc = net.get_submodule("fc")
        handle = fc.register_forward_hook(lambda m, a, o, name=name: outputs.setdefault(name, []).append(o))
        with torch.no_grad():
            net(*inputs)
        handle.remove()
    per_call = [tensor_metrics(a, b).sqnr_db for a, b in zip(outputs["original"], outputs["converted"])]
    assert len(per_call) == 4 and row.metrics.sqnr_db == pytest.approx(min(per_call))
    assert row.note == f"the worst of 4 calls (call {per_call.index(min(per_call)) + 1})"
    assert row.alone.sqnr_db == pytest.approx(per_call[0])


class CachedDecoding(nn.Module):
    """A causal mask sliced to the queries' count (nanoGPT), which a KV-cache step of one query
    against more keys broadcasts: that query sees every key."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.register_buffer("bias", torch.ones(16, 16, dtype=torch.bool).tril())

    def forward(self, q, k, v):
        t = q.size(-2)
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:t, :t])
        scores = (q @ k.transpose(-2, -1) * k.size(-1) ** -0.5).masked_fill(~self.bias[:t, :t], float("-inf"))
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("sdpa", [False, True])
def test_a_causal_mask_sliced_to_the_queries_holds_at_a_decoding_step(sdpa):
    def qkv(queries, keys):
        return [torch.randn(2, 4, n, 16) for n in (queries, keys, keys)]

    model = CachedDecoding(sdpa).eval()
    recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }\n', "r")
    converted = lowconv.convert(model, recipe, qkv(8, 8))
    [decision] = converted.lowconv_plan.converted()
    assert decision.site.info.causal and decision.site.info.causal_from_mask
    for queries, keys in ((8, 8), (1, 9)):
        inputs = qkv(queries, keys)
        assert torch.allclose(converted(*inputs), model(*inputs), atol=1e-5)
    with pytest.raises(ValueError, match="3 queries and 9 keys do not fit it"):
        converted(*qkv(3, 9))


class BroadcastMemory(nn.Module):
    """Attention over learned memory slots that the original broadcasts over the batch."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.keys, self.values = nn.Parameter(torch.randn(1, 4, 6, 16)), nn.Parameter(torch.randn(1, 4, 6, 16))

    def forward(self, q):
        if self.sdpa:
            return F.scaled_dot_product_attention(q, self.keys, self.values)
        return (q @ self.keys[0, 0].transpose(0, 1) * 0.25).softmax(-1) @ self.values[0, 0]  # 2-D k and v


@pytest.mark.parametrize("sdpa", [True, False])
def test_attention_whose_operands_broadcast_is_kept_with_the_reason(sdpa):
    model, inputs = BroadcastMemory(sdpa).eval(), (torch.randn(2, 4, 8, 16),)
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    [decision] = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
    assert decision.op == "keep" and ("broadcast against each other" in decision.reason
                                      or "of one rank" in decision.reason)
    assert torch.equal(converted(*inputs), model(*inputs))


class RepeatedSequence(nn.Module):
    """repeat_interleave along the sequence of (batch, seq, dim) keys: not a GQA repeat of heads."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1),
                                              is_causal=True)


def test_a_repeat_along_the_sequence_is_not_taken_for_grouped_heads():
    model, inputs = RepeatedSequence().eval(), [torch.randn(2, 8, 16) for _ in range(3)]
    recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }\n', "r")
    converted = lowconv.convert(model, recipe, inputs)
    assert torch.allclose(converted(*inputs), model(*inputs), atol=1e-5)


class SharedMha(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.MultiheadAttention(32, 4, batch_first=True), nn.MultiheadAttention(32, 4, batch_first=True)
        self.b.in_proj_weight = self.a.in_proj_weight

    def forward(self, x):
        return self.b(self.a(x, x, x, need_weights=False)[0], x, x, need_weights=False)[0]


def test_attention_modules_that_share_parameters_are_kept():
    model, inputs = SharedMha().eval(), (torch.randn(2, 8, 32),)
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    decisions = {d.fqn: d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"}
    assert decisions["a"].op == decisions["b"].op == "keep"
    assert "b.in_proj_weight" in decisions["a"].reason and "a.in_proj_weight" in decisions["b"].reason
    assert converted.a.in_proj_weight is converted.b.in_proj_weight


class SharedDropout(nn.Module):
    """Dropped-out probabilities read by P @ V and by a second product (Shaw's relative values)."""

    def __init__(self):
        super().__init__()
        self.drop, self.rel_v = nn.Dropout(0.3), nn.Parameter(torch.randn(8, 8, 16))

    def forward(self, q, k, v):
        probs = self.drop((q @ k.transpose(-2, -1) * 0.25).softmax(-1))
        return probs @ v + torch.einsum("bhqk,qkd->bhqd", probs, self.rel_v)


def test_dropped_out_probabilities_read_twice_are_not_a_site():
    """The op would draw its own dropout mask, and the second product would see another."""
    model, inputs = SharedDropout().eval(), [torch.randn(1, 1, 8, 16) for _ in range(3)]
    converted = lowconv.convert(model, "sparse-attention-bf16", inputs)
    assert not [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]


class DropoutSwitchedOff(nn.Module):
    """F.dropout whose training argument a flag turns off: it never drops, in either mode."""

    def __init__(self):
        super().__init__()
        self.attn_dropout = False

    def forward(self, q, k, v):
        probs = (q @ k.transpose(-2, -1) * 0.25).softmax(-1)
        return F.dropout(probs, p=0.1, training=self.training and self.attn_dropout) @ v


def test_a_dropout_whose_training_argument_is_false_drops_nothing():
    model, inputs = DropoutSwitchedOff(), [torch.randn(2, 4, 8, 16) for _ in range(3)]
    recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }\n', "r")
    converted = lowconv.convert(model, recipe, inputs).train()
    [decision] = converted.lowconv_plan.converted()
    assert decision.site.info.dropout == 0.0
    assert torch.allclose(converted(*inputs), model.train()(*inputs), atol=1e-5)


class FiniteFill(nn.Module):
    """masked_fill with a finite value: a query row it masks whole averages v."""

    def __init__(self, fill, bias=False):
        super().__init__()
        self.fill = fill
        self.bias = nn.Parameter(torch.randn(1, 4, 6, 6)) if bias else None

    def forward(self, q, k, v, keep):
        scores = q @ k.transpose(-2, -1)
        scores = scores * 0.25 if self.bias is None else scores + self.bias
        return scores.masked_fill(~keep, self.fill).softmax(-1) @ v


@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min, -1e4, float("-inf")])
def test_a_finite_fill_averages_the_rows_it_masks_whole(fill):
    inputs = [torch.randn(2, 4, 6, 16) for _ in range(3)]
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[1, :, :, 3:] = False
    keep[1, :, 4:, :] = False  # padded queries: every key masked
    model = FiniteFill(fill).eval()
    recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }\n', "r")
    converted = lowconv.convert(model, recipe, (*inputs, keep))
    [decision] = converted.lowconv_plan.converted()
    assert decision.site.info.finite_fill == (fill != float("-inf"))
    expected = model(*inputs, keep)
    if fill == float("-inf"):  # the original's rows are NaN; the op gives zeros (its rule)
        expected = expected.nan_to_num(0.0)
    assert torch.allclose(converted(*inputs, keep), expected, atol=1e-5)


def test_a_finite_fill_among_other_scores_steps_is_not_folded_into_an_added_mask():
    inputs = [torch.randn(2, 4, 6, 16) for _ in range(3)]
    model, keep = FiniteFill(-1e4, bias=True).eval(), torch.rand(2, 1, 6, 6) > 0.3
    converted = lowconv.convert(model, "sparse-attention-bf16", (*inputs, keep))
    [decision] = [d for d in converted.lowconv_plan.decisions if d.site.kind == "attention"]
    assert decision.op == "keep" and "more than one attention mask" in decision.reason


class UntracedCaller(nn.Module):
    """Its forward branches on data (it does not trace), so its MHA is a region of its own, and
    it reads the attention weights when they come."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.mha(x, x, x)
        if (x.sum() > 0).item():
            out = out * 2.0
        return out if weights is None else out + weights.mean(-1, keepdim=True)


def test_an_mha_whose_caller_is_not_traced_returns_the_weights_when_asked(tmp_path):
    model, inputs = UntracedCaller().eval(), (torch.randn(2, 8, 32),)
    recipe = lowconv.recipe.parse_recipe('[[rules]]\nop = "sparse_attention"\noptions = { dtype = "float32" }\n', "r")
    converted = roundtrip(model, inputs, recipe, tmp_path)
    [decision] = converted.lowconv_plan.converted()
    assert decision.fqn == "mha" and "may read the attention weights" in decision.note
    assert torch.allclose(converted(*inputs), model(*inputs), atol=1e-6)
    x = inputs[0]
    out, weights = converted.mha(x, x, x, need_weights=False)
    assert weights is None and torch.allclose(out, model.mha(x, x, x, need_weights=False)[0], atol=1e-5)


class MatmulPlusBias(nn.Module):
    """The x @ W + b form (GPT-2's Conv1D), the bias added on either side."""

    def __init__(self, bias_first):
        super().__init__()
        self.bias_first = bias_first
        self.weight, self.bias = nn.Parameter(torch.randn(64, 32) / 8), nn.Parameter(torch.zeros(32))

    def forward(self, x):
        return self.bias + x @ self.weight if self.bias_first else x @ self.weight + self.bias


@pytest.mark.parametrize("bias_first", [False, True])
def test_a_matmul_plus_bias_site_leaves_no_dense_weight_or_matmul(bias_first):
    model, inputs = MatmulPlusBias(bias_first), (torch.randn(4, 64),)
    converted = lowconv.convert(model, "fp8-dynamic", inputs)
    assert sorted(converted.state_dict()) == ["linear.bias", "linear.weight", "linear.weight_scale"]
    assert not [n for n in converted.graph.nodes if n.op == "call_function" and "matmul" in str(n.target)]
