"""A real SpTr install (package `sptr`, CUDA ops) seen from lowconv: the callables of it that
lowconv.compat.sptr reimplements, found among the modules already imported, so that a trace keeps
them single calls (passes/tracer.py) and the passes read each as its compat equivalent.

Real SpTr, as read (dvlab-research/SparseTransformer; the stored copies read are
tokuda99/SparseTransformer sptr/{__init__,functional,utils,modules}.py at 3f33e4d, a fork of it,
and dvlab-research/SphereFormer third_party/SparseTransformer/sptr/modules.py, sptr_backup/utils.py
and model/spherical_transformer.py at 43ec041; lh9171338/SparseTransformer sptr/modules.py at
1d170c2, whose sparse_self_attention adds `dtype=` and a fifth split_func argument, which compat takes):
- sptr/functional.py imports `sptr_cuda` (the extension) and defines each op as a
  torch.autograd.Function exposed as `name = Class.apply`: attention_step1 (AttentionStep1),
  attention_step2, dot_prod_with_idx_all, attention_step2_with_rel_pos_value, precompute_all,
  and dot_prod_with_idx (not called by sptr's modules; compat's has its numerics). Their argument
  orders are the compat ones, and sptr calls them positionally; their keyword names differ
  (index0, index_q, table): a call by keywords is read by position in the real signature.
- sptr/utils.py has plain functions: to_3d_numpy (sizes as numpy arrays), grid_sample
  (torch_geometric's voxel_grid), get_indices_params (grid_sample, .item() and precompute_all:
  does not trace; its windows and sort order need not be compat's, so a conversion keeps it:
  ops/window_rows.py), scatter_softmax_csr (torch_scatter's segment_csr and gather_csr).
- sptr/__init__.py star-imports functional and utils (no __all__), so `sptr.attention_step1` is
  the same object, and defines SparseTrTensor; sptr/modules.py has sparse_self_attention and
  VarLengthMultiheadSA, which import the ops by name and call scatter_softmax_csr with keywords
  (src=, indptr=index_0_offsets.long(), dim=0).
- rel_idx has no function: sparse_self_attention computes it inline with torch ops,
  xyz_quant = torch.div((xyz - xyz.min(0)[0] + shift) % window_size, quant_size, rounding_mode="floor"),
  then xyz_quant[index_0.long()] - xyz_quant[index_1.long()] + quant_grid_length - 1, optionally
  rewritten by split_func and clamped to [0, 2G-1], then `.int()`; passes/window_attention.py reads
  that form without split_func, the clamp taken as harmless: it is while a window's coordinates
  spread over at most G-1 (rel_idx in [0, 2G-2]); where float rounding puts a point G cells from
  its window's least, the original clamps rel_idx and the conversion clamps the point's coordinate
  (coordinates_in_window), and the two differ for that point's pairs.
- SphereFormer imports the package vendored, as `third_party.SparseTransformer.sptr`.
"""
from __future__ import annotations

import inspect
import sys
from types import ModuleType

import torch

from lowconv.compat import sptr
from lowconv.compat.trace_hooks import TraceHook

# The real callables that stand for compat functions: compat name -> the package's submodule
# defining it (under the same name).
REAL_NAMES = {
    "attention_step1": "functional",
    "attention_step2": "functional",
    "dot_prod_with_idx": "functional",
    "dot_prod_with_idx_all": "functional",
    "attention_step2_with_rel_pos_value": "functional",
    "precompute_all": "functional",
    "scatter_softmax_csr": "utils",
    "get_indices_params": "utils",
}


class RealOp:
    """A real SpTr callable as an fx call target, standing for the compat function `compat`.

    Not the callable itself: fx writes a bound `Function.apply` into generated code as
    `torch.autograd.function.apply`, which does not exist; this object is a global there instead.
    """

    def __init__(self, name: str, real):
        self.__name__ = name  # names the node and the global in generated code
        self.real = real
        self.compat = getattr(sptr, name)
        self.parameter_names = parameter_names(real)

    def __call__(self, *args, **kwargs):
        return self.real(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<real sptr {self.__name__}>"


def parameter_names(real) -> tuple[str, ...] | None:
    """The names a real callable's arguments have, in order (None where inspect cannot read them):
    an autograd Function's `apply` takes its forward's, less the ctx an old-style forward has."""
    function = getattr(real, "__self__", None)
    is_function_apply = isinstance(function, type) and issubclass(function, torch.autograd.Function)
    try:
        signature = inspect.signature(function.forward if is_function_apply else real)
    except (TypeError, ValueError):
        return None
    names = [p.name for p in signature.parameters.values()
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    new_style = is_function_apply and function.setup_context != torch.autograd.Function.setup_context
    return tuple(names[1:] if is_function_apply and not new_style else names)


def as_compat(target):
    """The compat function that a call_function target stands for (itself if none)."""
    return target.compat if isinstance(target, RealOp) else target


def loaded_packages() -> list[str]:
    """The real SpTr packages already imported, `sptr` or vendored (`...sptr`), told by their
    `functional` submodule. Never imports: sptr loads its CUDA extension, and a model that calls
    it has imported it already."""
    suffix = ".functional"
    return [name.removesuffix(suffix) for name in list(sys.modules)
            if name == "sptr" + suffix or name.endswith(".sptr" + suffix)]


def loaded_modules() -> list[ModuleType]:
    """The loaded modules of the real SpTr packages: those whose code calls the ops by name."""
    packages = loaded_packages()
    return [module for name, module in list(sys.modules.items())
            if isinstance(module, ModuleType) and any(name == p or name.startswith(p + ".") for p in packages)]


def real_ops() -> list[RealOp]:
    """The known callables of each loaded real SpTr package."""
    ops = []
    for package in loaded_packages():
        for name, submodule in REAL_NAMES.items():
            real = getattr(sys.modules.get(f"{package}.{submodule}"), name, None)
            if callable(real):
                ops.append(RealOp(name, real))
    return ops



def real_op_of(function) -> RealOp | None:
    """The RealOp a real SpTr callable is recorded as in a traced graph, or None."""
    return next((op for op in real_ops() if op.real is function), None)


# SpTr's ops stay single calls when traced, even where a model imported them by name
# (torch.fx.wrap only patches calls through the module's namespace), and so do a real SpTr
# install's, whose autograd Functions and CUDA extension cannot take a Proxy (recorded as their
# RealOp). fx patches them in the traced forwards' globals and in the real packages' modules too,
# which catches `sptr.functional.attention_step1(...)`, `F.attention_step1(...)` and the calls in
# sptr's own sparse_self_attention. (fx's public autowrap_modules would also wrap every other
# callable there, SparseTrTensor included.)
TRACE_HOOK = TraceHook(autowrap_functions=lambda: sptr.SPTR_OPS + sptr.SPTR_HELPERS + tuple(op.real for op in real_ops()),
                       autowrap_modules=loaded_modules, recorded_as=real_op_of)
