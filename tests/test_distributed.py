"""Training a converted model under FSDP2 (torch.distributed.fsdp.fully_shard) on the CPU: two
processes (gloo, world size 2) against one process on the whole batch, and the checkpoint that
lowconv.save writes from the sharded model, read back by lowconv.load."""
import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import lowconv
from lowconv.recipe import parse_recipe

WORLD = 2
STEPS = 3
RECIPES = {  # 2:4 training runs the masked dense product on the CPU: exact, so the runs agree to rounding
    "semi_sparse": ('op = "semi_sparse"\noptions = { training = true }', 1e-5),
    # FP8 scales each rank's half of the batch by its own amax: close, not equal
    "fp8": ('op = "fp8"\noptions = { training = true, granularity = "row" }', 5e-2),
}


def recipe(name):
    return parse_recipe(f'name = "{name}"\n[[rules]]\nkind = "linear"\n{RECIPES[name][0]}\n')


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


def sharded_run(rank, name, port, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD)
    try:
        model = original()
        converted = lowconv.convert(model, recipe(name), (torch.randn(4, 32),)).train()
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in converted.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(converted, mesh=mesh)
        half = [(x.chunk(WORLD)[rank], target.chunk(WORLD)[rank]) for x, target in batches()]
        losses = torch.tensor(train(converted, half))
        torch.distributed.all_reduce(losses)  # the mean of the halves' losses: the whole batch's
        path = lowconv.save(converted, out / "checkpoint")
        if rank == 0:
            (out / "losses.json").write_text(json.dumps({"losses": (losses / WORLD).tolist(), "path": str(path)}))
        # Both ranks done before either tears its group down (a full CI run once saw rank 0 abort in
        # gloo's teardown, "terminate called without an active exception").
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", RECIPES)
def test_fsdp2_training_matches_one_process_and_its_checkpoint_loads(name, tmp_path):
    mp.start_processes(sharded_run, args=(name, free_port(), tmp_path), nprocs=WORLD, start_method="spawn")
    sharded = json.loads((tmp_path / "losses.json").read_text())
    model = original()
    alone = lowconv.convert(model, recipe(name), (torch.randn(4, 32),)).train()
    losses = train(alone, batches())
    tolerance = RECIPES[name][1]
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(losses), rtol=tolerance, atol=0)
    loaded = lowconv.load(model, tmp_path / "checkpoint")  # the weights trained in two processes, whole
    trained = dict(alone.named_parameters())
    for name, tensor in loaded.named_parameters():
        error = ((tensor - trained[name]).norm() / trained[name].norm()).item()
        assert error < tolerance, name
    assert sharded["path"] == str(tmp_path / "checkpoint" / "model.safetensors")


@pytest.mark.parametrize("name", RECIPES)
def test_a_training_layers_output_is_no_view(name):
    """FSDP2 registers its pre-backward hook on a sharded module's output; an in-place op on a view
    would drop it (FSDP2 warns of a module that returns one). nn.Linear's output is no view either."""
    converted = lowconv.convert(original(), recipe(name), (torch.randn(4, 32),)).train()
    for layer, width in ((converted[0], 32), (converted[2], 64)):
        assert not layer(torch.randn(2, 4, width, requires_grad=True))._is_view()
