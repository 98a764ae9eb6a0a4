"""Training a converted model under FSDP2 (torch.distributed.fsdp.fully_shard) on the CPU: two
processes (gloo, world size 2) against one process on the whole batch, and the checkpoint that
lowconv.save writes from the sharded model, read back by lowconv.load; fp8's FP8 all-gather: the bytes
FSDP2 gathers, the numbers against the same recipe without it."""
import json
import os
import socket
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import lowconv
import lowconv.distributed
from lowconv.kernels.fp8_all_gather import Fp8MasterWeight, all_gather_into
from lowconv.ops.fp8 import Fp8Linear
from lowconv.recipe import parse_recipe

WORLD = 2
STEPS = 3


def fp8_rule(granularity: str, all_gather: bool = False) -> str:
    return (f'op = "fp8"\noptions = {{ training = true, granularity = "{granularity}"'
            f'{", fp8_all_gather = true" if all_gather else ""} }}')


RECIPES = {  # 2:4 training runs the masked dense product on the CPU: exact, so the runs agree to rounding
    "semi_sparse": ('op = "semi_sparse"\noptions = { training = true }', 1e-5),
    # FP8 scales each rank's half of the batch by its own amax: close, not equal
    "fp8": (fp8_rule("row"), 5e-2),
    "fp8_all_gather_row": (fp8_rule("row", all_gather=True), 5e-2),
    # x scaled per tensor: each rank's half of the batch by one scale of its own, further apart (FP8 all-gather
    # itself changes no number: test_fp8_all_gather_computes_what_the_recipe_without_it_does)
    "fp8_all_gather_tensor": (fp8_rule("tensor", all_gather=True), 1e-1),
}
# FP8 all-gather's recipes, and the same without it: sharded, the two compute the same numbers
WITHOUT_ALL_GATHER = {"fp8_all_gather_row": fp8_rule("row"), "fp8_all_gather_tensor": fp8_rule("tensor")}


def recipe(name, rule=None):
    return parse_recipe(f'name = "{name}"\n[[rules]]\nkind = "linear"\n{rule or RECIPES[name][0]}\n')


def original():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 32))


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)) for _ in range(STEPS)]


def train(model, steps):
    """The loss of each step (AdamW), each step's batch a list of (x, target)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, target in steps:
        loss = (model(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class CountingAllGather:
    """FSDP2's all-gather (FSDPModule.set_custom_all_gather's protocol), recording each one's bytes
    (its output's: what each rank receives)."""

    def __init__(self):
        self.bytes = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.bytes.append(output_tensor.nbytes)
        return all_gather_into(output_tensor, input_tensor, group=group, async_op=async_op)


def sharded(model, mesh) -> dict[str, CountingAllGather]:
    """model with each layer that has parameters sharded (fully_shard), then the whole; each sharded
    layer's all-gathers counted, by the layer's name."""
    from torch.distributed.fsdp import fully_shard

    counters = {}
    for name, layer in model.named_children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
            counters[name] = CountingAllGather()
            layer.set_custom_all_gather(counters[name])
    fully_shard(model, mesh=mesh)
    return counters


@dataclass
class ShardedTraining:
    model: nn.Module
    losses: list[float]  # the whole batches'
    all_gathers: dict[str, CountingAllGather]  # by layer name
    weight_types: set[str]  # the types of the weights the fp8 layers computed with


def sharded_training(rule: str, rank: int, mesh) -> ShardedTraining:
    """original() converted by `rule`, sharded and trained on this rank's half of each batch."""
    converted = lowconv.convert(original(), recipe("sharded", rule), (torch.randn(4, 32),)).train()
    counters = sharded(converted, mesh)
    weight_types = set()
    for module in converted.modules():
        if isinstance(module, Fp8Linear):  # after fully_shard: sees the weight FSDP2 all-gathered
            module.register_forward_pre_hook(lambda module, args: weight_types.add(type(module.weight).__name__))
    half = [(x.chunk(WORLD)[rank], target.chunk(WORLD)[rank]) for x, target in batches()]
    losses = torch.tensor(train(converted, half))
    torch.distributed.all_reduce(losses)  # the mean of the halves' losses: the whole batch's
    return ShardedTraining(converted, (losses / WORLD).tolist(), counters, weight_types)


def sharded_run(rank, name, port, out):
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        run = sharded_training(RECIPES[name][0], rank, mesh)
        result = {"losses": run.losses, "weight_types": sorted(run.weight_types),
                  "all_gather_bytes": {layer: sorted(set(c.bytes)) for layer, c in run.all_gathers.items()}}
        if name in WITHOUT_ALL_GATHER:
            result["losses_without_all_gather"] = sharded_training(WITHOUT_ALL_GATHER[name], rank, mesh).losses
            result["uneven"] = uneven_shards_differences(run.model[0].options, mesh)
            result["meta_load"] = meta_load(RECIPES[name][0], run.model, mesh)
        trained = lowconv.distributed.full_state_dict(run.model)
        result["path"] = str(lowconv.save(run.model, out / "checkpoint"))
        if rank == 0:
            torch.save(trained, out / "trained.pt")
            (out / "result.json").write_text(json.dumps(result))
        torch.distributed.barrier()  # both ranks done
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    # Out without tearing gloo down: its teardown aborted a rank now and then in full CI runs
    # ("terminate called without an active exception"), after the results were written, with and
    # without a barrier before destroy_process_group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def uneven_shards_differences(options, mesh) -> dict[str, float]:
    """An fp8 layer of 33 outputs (FSDP2 pads the second rank's 16 rows to 17), sharded (and gathered
    again for the backward) against whole: the largest differences of its output and its gradients,
    one forward and backward of the same batch on both ranks."""
    def layer():
        gen = torch.Generator().manual_seed(2)
        module = Fp8Linear(32, 33, True, torch.float32, options)
        module.set_params(torch.randn(33, 32, generator=gen), torch.randn(33, generator=gen))
        return nn.Sequential(module)

    whole, split = layer(), layer()
    sharded(split, mesh)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    outputs = [model(x) for model in (whole, split)]
    for y in outputs:
        y.square().sum().backward()
    return {"output": (outputs[0] - outputs[1]).abs().max().item(),
            **{name: (getattr(whole[0], name).grad - getattr(split[0], name).grad.full_tensor()).abs().max().item()
               for name in ("weight", "bias")}}


def meta_load(rule: str, trained, mesh) -> dict:
    """The trained model's whole state dict loaded, from rank 0, into the model converted by `rule`
    on the meta device and sharded (torch.distributed.checkpoint's large-model load:
    load_state_dict(assign=True)): the types of the first layer's local shard and of the weight its
    forward sees, and whether it computes what the trained model does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = lowconv.distributed.full_state_dict(trained)
    model = lowconv.convert(original(), recipe("meta", rule), (torch.randn(4, 32),)).train().to("meta")
    seen = []
    model[0].register_forward_pre_hook(lambda module, args: seen.append(type(module.weight).__name__))
    sharded(model, mesh)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    return {"local": type(model[0].weight._local_tensor).__name__, "seen": seen,
            "same": torch.equal(model(x), trained(x))}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded_result(tmp_path_factory):
    """name -> (the run's folder, its result.json): each recipe trained in two processes once."""
    results = {}

    def result(name):
        if name not in results:
            out = tmp_path_factory.mktemp(name)
            mp.start_processes(sharded_run, args=(name, free_port(), out), nprocs=WORLD, start_method="spawn")
            results[name] = out, json.loads((out / "result.json").read_text())
        return results[name]
    return result


@pytest.mark.parametrize("name", RECIPES)
def test_fsdp2_training_matches_one_process_and_its_checkpoint_loads(name, sharded_result):
    out, sharded = sharded_result(name)
    model = original()
    alone = lowconv.convert(model, recipe(name), (torch.randn(4, 32),)).train()
    losses = train(alone, batches())
    tolerance = RECIPES[name][1]
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(losses), rtol=tolerance, atol=0)
    loaded = lowconv.load(model, out / "checkpoint")  # the weights trained in two processes, whole
    trained = dict(alone.named_parameters())
    for param_name, tensor in loaded.named_parameters():
        error = ((tensor - trained[param_name]).norm() / trained[param_name].norm()).item()
        assert error < tolerance, param_name
    assert sharded["path"] == str(out / "checkpoint" / "model.safetensors")
    gathered = torch.load(out / "trained.pt")  # the sharded model's state dict, whole
    state = loaded.state_dict()
    assert state.keys() == gathered.keys()
    for key, tensor in state.items():
        assert type(tensor) is torch.Tensor and torch.equal(tensor, gathered[key]), key


@pytest.mark.parametrize("name", ["fp8", *WITHOUT_ALL_GATHER])
def test_fsdp2_all_gathers_fp8_weights_in_a_byte_per_element(name, sharded_result):
    """Each fp8 layer's all-gather moves its weight, its bias (float32) and, per row, its scales
    (float32): the weight in e4m3 with FP8 all-gather, else in float32 (its training dtype)."""
    _, sharded = sharded_result(name)
    all_gather = name in WITHOUT_ALL_GATHER
    for layer_name, layer in original().named_children():
        if isinstance(layer, nn.Linear):
            rows = layer.out_features
            row_scales = rows * 4 if "row" in name and all_gather else 0
            expected = layer.weight.numel() * (1 if all_gather else 4) + row_scales + rows * 4
            assert sharded["all_gather_bytes"][layer_name] == [expected], layer_name
    assert sharded["weight_types"] == ["GatheredFp8Weight" if all_gather else "Parameter"]


@pytest.mark.parametrize("name", WITHOUT_ALL_GATHER)
def test_a_model_made_on_the_meta_device_keeps_fp8_all_gather_when_loaded(name, sharded_result):
    assert sharded_result(name)[1]["meta_load"] == {"local": "Fp8MasterWeight", "seen": ["GatheredFp8Weight"],
                                                    "same": True}


@pytest.mark.parametrize("name", WITHOUT_ALL_GATHER)
def test_fp8_all_gather_computes_what_the_recipe_without_it_does(name, sharded_result):
    """The same e4m3 weights and scales (the tensor scale from the ranks' amaxes all-reduced), so
    the same losses, bit for bit; and on a layer whose rows FSDP2 pads (33 over 2 ranks)."""
    _, sharded = sharded_result(name)
    assert sharded["losses"] == sharded["losses_without_all_gather"]
    assert sharded["uneven"] == {"output": 0.0, "weight": 0.0, "bias": 0.0}


@pytest.mark.parametrize("name", RECIPES)
def test_a_training_layers_output_is_no_view(name):
    """FSDP2 registers its pre-backward hook on a sharded module's output; an in-place op on a view
    would drop it (FSDP2 warns of a module that returns one). nn.Linear's output is no view either."""
    converted = lowconv.convert(original(), recipe(name), (torch.randn(4, 32),)).train()
    for layer, width in ((converted[0], 32), (converted[2], 64)):
        assert not layer(torch.randn(2, 4, width, requires_grad=True))._is_view()


def test_fp8_all_gather_outside_fsdp_is_the_training_layer_as_before():
    """Unsharded, a layer with fp8_all_gather (its weight an Fp8MasterWeight) is the one without: the
    same state dict (plain tensors, the same keys and dtypes), the same training steps (AdamW), eager
    and compiled whole (fullgraph), the same dtype casts, and revert gives the plain master weight."""
    models = [lowconv.convert(original(), recipe("r", fp8_rule("row", all_gather)), (torch.randn(4, 32),)).train()
              for all_gather in (False, True)]
    assert isinstance(models[1][0].weight, Fp8MasterWeight) and isinstance(models[1][0].weight, nn.Parameter)
    states = [model.state_dict() for model in models]
    assert [(key, type(t), t.dtype) for key, t in states[0].items()] == \
        [(key, type(t), t.dtype) for key, t in states[1].items()]
    assert all(torch.equal(states[0][key], states[1][key]) for key in states[0])
    assert train(models[0], batches()) == train(models[1], batches())
    x = torch.randn(8, 32, requires_grad=True)
    compiled = torch.compile(models[1], fullgraph=True, backend="aot_eager")
    outputs = [model(x) for model in (models[0], compiled)]
    grads = [torch.autograd.grad(y.square().sum(), (x, model[0].weight))
             for y, model in zip(outputs, models)]
    assert torch.equal(outputs[0], outputs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    models[1].double()
    assert isinstance(models[1][0].weight, Fp8MasterWeight) and models[1][0].weight.master.dtype == torch.float64
    reverted = lowconv.revert(models[1].float())
    assert type(reverted[0].weight.data) is torch.Tensor
    assert torch.equal(reverted[0].weight, models[0][0].weight)


def test_fp8_all_gather_weight_takes_data_assignments_assign_loads_and_inference_mode():
    """What a user's trial found the weight subclass missed outside FSDP2: `weight.data = t` (and
    vector_to_parameters) sets the master weight, inference_mode runs a row-scaled layer, and
    load_state_dict(assign=True) (a model made on the meta device) keeps the weight an Fp8MasterWeight."""
    import copy

    models = [lowconv.convert(original(), recipe("r", fp8_rule("row", all_gather)), (torch.randn(4, 32),))
              for all_gather in (False, True)]
    x = torch.randn(8, 32)
    before = models[1](x)
    for model in models:
        vector = torch.nn.utils.parameters_to_vector(model.parameters())
        torch.nn.utils.vector_to_parameters(vector * 0.5, model.parameters())
    assert not torch.equal(models[1](x), before) and torch.equal(models[1](x), models[0](x))
    with torch.inference_mode():
        assert torch.equal(models[1](x), models[0](x))
    on_meta = copy.deepcopy(models[1]).to("meta")
    on_meta.load_state_dict(models[1].state_dict(), assign=True)
    assert isinstance(on_meta[0].weight, Fp8MasterWeight) and isinstance(on_meta[0].weight, nn.Parameter)
    assert torch.equal(on_meta(x), models[1](x))
