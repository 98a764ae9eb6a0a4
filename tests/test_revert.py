"""lowconv.revert: converted linears back to nn.Linear with the weights they compute with, and the
`dense` op that it writes into the plan (so save and load keep the reverted model)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowconv
from lowconv.api import plan_of
from lowconv.errors import LowconvError
from lowconv.model_file import load_model_file
from lowconv.ops.fp8 import Fp8Linear
from lowconv.ops.semi_sparse import RuntimeSemiSparseLinear
from lowconv.recipe import parse_recipe


def recipe(options: str, op: str = "semi_sparse"):
    return parse_recipe(f'name = "t"\n[[rules]]\nkind = "linear"\nop = "{op}"\noptions = {{ {options} }}\n')


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def is_24(weight: torch.Tensor) -> bool:
    """At most 2 nonzeros in every group of 4 consecutive input features."""
    return bool(((weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1) <= 2).all())


def test_reverted_2_4_model_is_dense_linears_with_the_pruned_weights(tmp_path):
    example = load_model_file("examples/vit.py")
    converted = lowconv.convert(example.model, "semi-sparse", example.inputs)
    reverted = lowconv.revert(converted)
    sparse = [d.fqn for d in plan_of(converted).converted() if d.op == "semi_sparse"]
    assert sparse
    for fqn in sparse:
        linear = reverted.get_submodule(fqn)
        assert type(linear) is nn.Linear and is_24(linear.weight)
        assert torch.equal(linear.weight, converted.get_submodule(fqn).linear_weight())
    assert all(d.op == "dense" and "reverted from semi_sparse" in d.reason
               for d in plan_of(reverted).decisions if d.fqn in sparse)
    torch.testing.assert_close(run(reverted, example.inputs), run(converted, example.inputs))
    assert plan_of(converted).converted()[0].op == "semi_sparse"  # the converted model is left as it was

    lowconv.save(reverted, tmp_path)
    again = lowconv.load(example.model, tmp_path)
    assert torch.equal(run(again, example.inputs), run(reverted, example.inputs))
    assert all(type(again.get_submodule(fqn)) is nn.Linear for fqn in sparse)


def test_runtime_mask_reverts_to_its_dense_weight():
    example = load_model_file("examples/vit.py")
    converted = lowconv.convert(example.model, recipe('target = "weight", mask = "runtime", training = true'),
                                example.inputs)
    fqn, module = next((n, m) for n, m in converted.named_modules() if isinstance(m, RuntimeSemiSparseLinear))
    reverted = lowconv.revert(converted)
    assert torch.equal(reverted.get_submodule(fqn).weight, module.weight)
    assert not is_24(module.weight)  # the dense weight, not its pruned view


def test_revert_only_the_ops_named():
    example = load_model_file("examples/vit.py")
    converted = lowconv.convert(example.model, "mixed", example.inputs)
    reverted = lowconv.revert(converted, ops=["semi_sparse"])
    ops = {d.fqn: d.op for d in plan_of(reverted).decisions}
    assert "dense" in ops.values() and "fp8" in ops.values() and "semi_sparse" not in ops.values()
    assert all(isinstance(reverted.get_submodule(fqn), Fp8Linear) for fqn, op in ops.items() if op == "fp8")
    one = lowconv.revert(converted, ops="semi_sparse")  # one op by name, as a string
    assert {d.fqn: d.op for d in plan_of(one).decisions} == ops


def test_a_trained_model_reverted_converts_again_for_inference(tmp_path):
    """README's deploy path: train converted, revert, convert that; its checkpoint loads on the original."""
    torch.manual_seed(0)
    model, inputs = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), (torch.randn(4, 32),)
    trained = lowconv.convert(model, recipe('training = true, granularity = "row"', op="fp8"), inputs)
    trained(*inputs).square().sum().backward()
    with torch.no_grad():
        for p in trained.parameters():
            p -= 0.1 * p.grad
    served = lowconv.convert(lowconv.revert(trained).eval(), "fp8-row", inputs)
    assert {d.op for d in plan_of(served).converted()} == {"fp8"}
    with torch.no_grad():
        torch.testing.assert_close(run(served, inputs), run(trained.eval(), inputs))  # the same e4m3 numerics
    lowconv.save(served, tmp_path)
    torch.testing.assert_close(run(lowconv.load(model, tmp_path), inputs), run(served, inputs))


def test_a_partly_reverted_model_is_refused_naming_the_ops_left():
    example = load_model_file("examples/vit.py")
    partly = lowconv.revert(lowconv.convert(example.model, "mixed", example.inputs), ops="semi_sparse")
    with pytest.raises(LowconvError, match=r"made by lowconv and \d+ of its sites are lowconv's op modules "
                                           r"\(fp8, sparse_attention; e\.g\. "):
        lowconv.convert(partly, "fp8-row", example.inputs)


def test_reverted_fp8_linear_holds_the_dequantized_weight():
    example = load_model_file("examples/vit.py")
    converted = lowconv.convert(example.model, "fp8-dynamic", example.inputs)
    fqn, module = next((n, m) for n, m in converted.named_modules() if isinstance(m, Fp8Linear))
    linear = lowconv.revert(converted).get_submodule(fqn)
    assert linear.weight.dtype == module.weight_scale.dtype
    assert torch.equal(linear.weight, module.weight.float() * module.weight_scale.float())


def test_revert_names_bad_ops_and_unconverted_models():
    example = load_model_file("examples/vit.py")
    converted = lowconv.convert(example.model, "semi-sparse", example.inputs)
    with pytest.raises(LowconvError, match=r"\['sparse_attention'\] are not linear ops.*valid choices: fp16acc, fp8, fp8_semi_sparse, semi_sparse"):
        lowconv.revert(converted, ops=["sparse_attention"])
    with pytest.raises(LowconvError, match="has no plan"):
        lowconv.revert(example.model)


class FunctionalLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64))
        self.b = nn.Parameter(torch.randn(32))

    def forward(self, x):
        return F.gelu(F.linear(x, self.w, self.b))


def test_dense_op_makes_a_graph_site_an_nn_linear(tmp_path):
    model, inputs = FunctionalLinear(), (torch.randn(5, 64),)
    converted = lowconv.convert(model, recipe("", op="dense"), inputs)
    assert any(type(m) is nn.Linear for m in converted.modules())
    assert torch.equal(run(converted, inputs), run(model, inputs))
    reverted = lowconv.revert(lowconv.convert(model, recipe('target = "weight", mask = "fixed"'), inputs))
    lowconv.save(reverted, tmp_path)
    assert torch.equal(run(lowconv.load(model, tmp_path, example_inputs=inputs), inputs), run(reverted, inputs))
