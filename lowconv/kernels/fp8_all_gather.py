"""FP8 all-gather of a training fp8 layer's weight under FSDP2 (torchao's enable_fsdp_float8_all_gather).

Numerics: the layer computes with the e4m3 W and scales it would quantize unsharded, bit for bit.
FSDP2 shards W (out, in) along its rows, so each rank holds whole rows and quantizes them before
the all-gather:
    row     a scale per row, from the rank's own rows: what the whole W's quantization gives them.
    tensor  the ranks' amaxes all-reduced (MAX) over the shard's group, one small collective: the
            whole W's amax, so every rank casts with the unsharded layer's one scale.
The all-gather moves the e4m3 bytes (1 per weight element, half of bf16's) and the row scales
((rows, 1) float32); the forward's GEMM takes the gathered e4m3 W as it came, the backward's dX GEMM
its transpose (a view: FSDP2 gathers W again for the backward into the same memory), and W is
quantized once per all-gather, never in the layer. W is quantized from the master weight, also
under a MixedPrecisionPolicy (whose param_dtype copy of W, all-gathered without FP8 all-gather, would
round W once more). W's gradient is computed in its master dtype (or FSDP2's param_dtype) and
reduce-scattered as without FP8 all-gather. The scale all-reduce runs in
each all-gather (forward, and the backward's again where FSDP2 resharded after the forward), not
once after the optimizer step as torchao's precompute_float8_dynamic_scale_for_fsdp can: that saves
collectives but a model whose step skips it would compute with stale scales.

Uneven shards: FSDP2 pads W's rows to ceil(out / world) on every rank and takes all-gather inputs of
that padded shape only, so the e4m3 shard is padded with zero rows (cut off after the gather), and
row scales, whose shape cannot be the padded shard's, are gathered by a small all-gather of their own.

Two tensor subclasses carry it:
    Fp8MasterWeight    the parameter: the master weight, computed with as the plain tensor it wraps
                       by every op; the ops FSDP2 shards, pads, moves and loads it with (SHARDING_OPS:
                       slices, views, copies, casts, detach) give Fp8MasterWeights, so that the shard
                       has the all-gather hooks, every other op plain tensors.
    GatheredFp8Weight  the unsharded weight FSDP2 gives the layer between all-gather and reshard:
                       the e4m3 W and its scales, a tensor of W's dtype to autograd (its gradient's).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format

from lowconv.kernels.fp8 import E4M3, abs_max, amax_to_scale, quantize_rowwise, quantize_with_scale

# torch.distributed's all-gather into one tensor: all_gather_single where this torch has it (it
# deprecates all_gather_into_tensor), else all_gather_into_tensor.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# What FSDP2 does to a parameter to shard and pad it, to move it and to load a state dict into it:
# their outputs stay Fp8MasterWeight (so the shard keeps the hooks); every other op's are plain.
SHARDING_OPS = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.detach.default,
}


def wrapper_like(cls, tensor: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
    """A wrapper subclass instance with tensor's shape, strides and device, reporting `dtype`."""
    return torch.Tensor._make_wrapper_subclass(
        cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
        memory_format=suggest_memory_format(tensor), dtype=dtype, layout=tensor.layout, device=tensor.device,
        requires_grad=requires_grad)


class Fp8MasterWeight(torch.Tensor):
    """A training fp8 layer's master weight that FSDP2 all-gathers in e4m3 (see the module doc);
    `granularity`: how W is scaled ("tensor" or "row")."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, granularity: str):
        return wrapper_like(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, granularity: str):
        self.master = tensor
        self.granularity = granularity

    def __repr__(self):
        return f"Fp8MasterWeight({self.master}, granularity={self.granularity})"

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor):
        """`weight.data = t` (vector_to_parameters, user code) makes t the master weight: the base
        setter alone would swap the wrapper and leave `master`, which every op computes with, as it
        was. The wrapper is swapped only where t's shape, dtype or device differ (a wrapper so set
        cannot be deep-copied)."""
        master = value.master if isinstance(value, Fp8MasterWeight) else value
        if (master.shape, master.dtype, master.device) != (self.shape, self.dtype, self.device):
            torch.Tensor.data.__set__(self, Fp8MasterWeight(master, self.granularity))
        self.master = master

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t.master, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if isinstance(args[0], cls) and out is plain_args[0]:  # an in-place op returns its input
            return args[0]
        # Inference mode makes inference tensors, which a wrapper cannot hold (its detach fails); FSDP2
        # never shards there.
        if func not in SHARDING_OPS or torch.is_inference_mode_enabled():
            return out
        granularity = next(a.granularity for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, granularity), out)

    def __tensor_flatten__(self):
        return ["master"], self.granularity

    @staticmethod
    def __tensor_unflatten__(inner_tensors, granularity, outer_size, outer_stride):
        return Fp8MasterWeight(inner_tensors["master"], granularity)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The all-gather inputs: this rank's rows in e4m3 (as uint8, which every backend gathers),
        padded to FSDP2's padded shard, and their row scales where they fit the same all-gather."""
        rows = -(-outer_size[0] // mesh.size())  # FSDP2's padded shard
        group = mesh.get_group()
        w_fp8, scale = quantize_shard(self.master, self.granularity, group)
        inputs = (padded_rows(w_fp8.view(torch.uint8), rows),)
        if self.granularity == "row":
            if outer_size[0] % mesh.size():
                return inputs, GatherMetadata(gathered_row_scales(padded_rows(scale, rows), group))
            return inputs + (padded_rows(scale, rows),), GatherMetadata(None)
        return inputs, GatherMetadata(scale)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The unsharded weight from the all-gather's outputs (`out`: the one made at the first
        all-gather, whose e4m3 data FSDP2 has gathered again in place)."""
        scale = outputs[1] if metadata.scale is None else metadata.scale
        if scale.is_cuda:
            # A scale from the metadata was made on FSDP2's all-gather copy-in stream and is read on this
            # one: the caching allocator must not give its memory back to that stream while this one may.
            scale.record_stream(torch.cuda.current_stream(scale.device))
        if out is not None:
            out.scale = rows_of(scale, out.shape[0])
            return None
        return GatheredFp8Weight(outputs[0].view(E4M3), scale, param_dtype), (outputs[0],)


@dataclass
class GatherMetadata:
    """What fsdp_pre_all_gather tells fsdp_post_all_gather: W's scales where they are not gathered
    with its data (a tensor scale, every rank's the same; row scales of uneven shards), else None."""
    scale: torch.Tensor | None


def quantize_shard(shard: torch.Tensor, granularity: str, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale) of this rank's rows of W: per row, or with the whole W's scale (its amax
    all-reduced over `group`)."""
    if granularity == "row":
        return quantize_rowwise(shard, E4M3)
    amax = abs_max(shard.reshape(-1)).float().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return quantize_with_scale(shard, amax_to_scale(amax, E4M3), E4M3)


def padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (FSDP2's padded shard)."""
    if t.shape[0] == rows:
        return t
    padded = t.new_zeros(rows, *t.shape[1:])
    padded[:t.shape[0]] = t
    return padded


def gathered_row_scales(scale: torch.Tensor, group) -> torch.Tensor:
    """Every rank's padded row scales, in rank order (as FSDP2 gathers the e4m3 rows)."""
    gathered = scale.new_empty(scale.shape[0] * dist.get_world_size(group), *scale.shape[1:])
    all_gather_into(gathered, scale.contiguous(), group=group)
    return gathered


class GatheredFp8Weight(torch.Tensor):
    """The weight FSDP2 all-gathered in e4m3: `fp8` (out, in) e4m3 and `scale` ((1,) or (out, 1)
    float32 dequant scales), seen as a tensor of `dtype` (W's gradient's). FSDP2 makes the unsharded
    parameter of it (as_strided to W's shape, which cuts off the padding rows, and detach); any other
    op computes on the dequantized W."""

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return wrapper_like(cls, fp8, dtype)

    def __init__(self, fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.fp8, self.scale = fp8, scale

    def __repr__(self):
        return f"GatheredFp8Weight(fp8={self.fp8}, scale={self.scale}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            (w,) = args
            return cls(w.fp8, w.scale, w.dtype)
        if func is torch.ops.aten.as_strided.default:  # FSDP2's view of the gather as W's shape
            w, size, stride = args[:3]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
            return cls(w.fp8.as_strided(size, stride, offset), rows_of(w.scale, size[0]), w.dtype)
        args, kwargs = pytree.tree_map_only(cls, GatheredFp8Weight.dequantized, (args, kwargs))
        return func(*args, **kwargs)

    def dequantized(self) -> torch.Tensor:
        return (self.fp8.float() * self.scale.float()).to(self.dtype)

    def __tensor_flatten__(self):
        return ["fp8", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return GatheredFp8Weight(inner_tensors["fp8"], inner_tensors["scale"], dtype)


def gathered_fp8(weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(W in e4m3, its scales) where FSDP2 all-gathered W so, else (None, None): the layer quantizes W."""
    if isinstance(weight, GatheredFp8Weight):
        return weight.fp8, weight.scale
    return None, None


def rows_of(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` row scales, or the one tensor scale."""
    return scale if scale.numel() == 1 else scale[:rows]


def master_tensor(weight: torch.Tensor) -> torch.Tensor:
    """The plain tensor an Fp8MasterWeight wraps (FSDP2's shard of it too), or weight as it is."""
    if isinstance(weight, Fp8MasterWeight):
        return weight.master
    if dist.is_available():
        from torch.distributed.tensor import DTensor  # not importable where torch.distributed is not built
        if isinstance(weight, DTensor) and isinstance(weight._local_tensor, Fp8MasterWeight):
            return DTensor.from_local(weight._local_tensor.master, weight.device_mesh, weight.placements,
                                      run_check=False, shape=weight.shape, stride=weight.stride())
    return weight


def as_fp8_master_weight(weight: torch.nn.Parameter, granularity: str) -> torch.nn.Parameter:
    """weight as an Fp8MasterWeight parameter (FSDP2's shard of one: a DTensor of it), as it is where it
    is one already. load_state_dict(assign=True), as torch.distributed.checkpoint loads a model made on
    the meta device, puts the state dict's plain tensors in its place."""
    if master_tensor(weight) is not weight:  # an Fp8MasterWeight, or FSDP2's shard of one
        return weight
    if dist.is_available():
        from torch.distributed.tensor import DTensor
        if isinstance(weight, DTensor):
            local = Fp8MasterWeight(weight._local_tensor, granularity)
            sharded = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                         shape=weight.shape, stride=weight.stride())
            return torch.nn.Parameter(sharded, requires_grad=weight.requires_grad)
    return torch.nn.Parameter(Fp8MasterWeight(weight.detach(), granularity), requires_grad=weight.requires_grad)


def plain_weight_in_state_dict(module, state_dict, prefix, local_metadata):
    """A state dict post-hook: the weight as the plain tensor it wraps, so that checkpoints and
    whatever else reads state dicts see the tensor they would without FP8 all-gather."""
    state_dict[prefix + "weight"] = master_tensor(state_dict[prefix + "weight"])
