"""Models sharded by FSDP2 (torch.distributed.fsdp.fully_shard): their whole state dict gathered
for a checkpoint, written by rank 0 alone. Each function is a collective: every rank calls it."""
from typing import Callable, TypeVar

import torch
from torch import nn

from lowconv.errors import LowconvError

T = TypeVar("T")


def is_sharded(state: dict) -> bool:
    """Whether a state dict holds DTensors: an FSDP2 model's parameters, sharded across ranks."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    from torch.distributed.tensor import DTensor
    return any(isinstance(t, DTensor) for t in state.values())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with whole tensors, gathered to rank 0's CPU (torch.distributed.
    checkpoint's full state dict); the other ranks get {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def on_rank0(write: Callable[[], T]) -> T:
    """write() run by rank 0 alone; its result, or its failure, reaches every rank (which raise
    too, rather than wait for a file that will not come)."""
    rank = torch.distributed.get_rank()
    result, failure = None, None
    if rank == 0:
        try:
            result = write()
        except Exception as error:  # told to the other ranks, then raised here
            failure = error
    box = [(result, None if failure is None else f"{type(failure).__name__}: {failure}")]
    torch.distributed.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    result, message = box[0]
    if message:
        raise LowconvError(f"rank 0 failed to write the checkpoint: {message}")
    return result
