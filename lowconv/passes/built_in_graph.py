"""Objects the traced code builds that the graph builds again on every call, instead of one object
built once while tracing: a transformers DynamicCache, which a causal LM's forward creates
(`DynamicCache(config=self.config)`), fills layer by layer and returns.

While a trace runs, such a class's construction in the traced code is recorded as a call node
(its target a BuiltInGraph) whose value is a proxy: the code's calls on it (`cache.update(k, v, i)`)
are recorded as calls too, and the graph returns the object it built. The arguments that fx cannot
hold (the model's config) stay in the target. `isinstance(x, cls)` in that code answers for the
class the graph builds, and for an object given to the traced code (a cache passed in) by the
example's type, a decision the graph guards. A compat/ hook names the classes
(TraceHook.built_in_graph). The names are patched process-wide while the trace runs, as fx patches
what it wraps.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.fx as fx
from torch import nn

from lowconv.inputs import is_constant
from lowconv.passes.example_values import MISSING


class BuiltInGraph:
    """A call target that builds `cls` with the call's arguments and the ones kept here."""

    def __init__(self, cls: type, kept: dict):
        self.__name__ = f"build_{cls.__name__}"  # names the node and the global in generated code
        self.cls, self.kept = cls, kept

    def __call__(self, *args, **kwargs):
        return self.cls(*args, **kwargs, **self.kept)

    def __repr__(self) -> str:
        return f"<build {self.cls.__qualname__}>"


@contextmanager
def built_in_graph(tracer: fx.Tracer, root: nn.Module, classes: tuple[type, ...]):
    """Meanwhile, in the code of the modules of `root` (their classes' Python modules), a name bound
    to one of `classes` (or a subclass) builds a proxy of a BuiltInGraph call instead: `cls(...)`
    there is recorded, unless its positional arguments are ones fx cannot hold (then it builds
    the real object, as before)."""
    namespaces = {id(vars(sys.modules[type(m).__module__])): vars(sys.modules[type(m).__module__])
                  for m in root.modules() if type(m).__module__ in sys.modules}
    patched = [(namespace, name, value) for namespace in namespaces.values() for name, value in list(namespace.items())
               if isinstance(value, type) and issubclass(value, classes)] if classes else []
    for namespace, name, cls in patched:
        namespace[name] = recorded_construction(tracer, cls)
    try:
        yield
    finally:
        for namespace, name, cls in patched:
            namespace[name] = cls


class RecordedClass(type):
    """The type of a class's stand-in in the traced code's namespace: calling it records the
    construction; isinstance and issubclass answer for the class it stands for, and a proxy of an
    object the graph builds is an instance of the class it builds."""

    def __call__(cls, *args, **kwargs):
        if not all(holds(value) for value in args):
            return cls.real(*args, **kwargs)
        kept = {name: value for name, value in kwargs.items() if not holds(value)}
        graph_kwargs = {name: value for name, value in kwargs.items() if name not in kept}
        return cls.tracer.create_proxy("call_function", BuiltInGraph(cls.real, kept), args, graph_kwargs)

    def __instancecheck__(cls, obj):
        if isinstance(obj, fx.Proxy) and isinstance(obj.node.target, BuiltInGraph):
            return issubclass(obj.node.target.cls, cls.real)
        if isinstance(obj, fx.Proxy) and obj.tracer.decidable(obj) is not MISSING:
            # an object given to the traced code (a cache passed in): the example's type decides,
            # a branch that the graph guards as any other the example decided
            return bool(cls.tracer.create_proxy("call_function", InstanceCheck(cls.real), (obj,), {}))
        return isinstance(obj, cls.real)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls.real)


class InstanceCheck:
    """A call target: isinstance(obj, cls)."""

    def __init__(self, cls: type):
        self.__name__ = f"is_{cls.__name__}"  # names the node and the global in generated code
        self.cls = cls

    def __call__(self, obj) -> bool:
        return isinstance(obj, self.cls)


def recorded_construction(tracer: fx.Tracer, cls: type) -> type:
    return RecordedClass(cls.__name__, (), {"real": cls, "tracer": tracer})


def holds(value) -> bool:
    """Whether the graph holds `value` as a node argument as it is: a proxy, None, a constant, a
    dtype or device, or a tuple, list or dict of them (not an object fx would rebuild, a config)."""
    if isinstance(value, (tuple, list)):
        return all(holds(item) for item in value)
    if isinstance(value, dict):
        return all(holds(item) for item in value.values())
    return value is None or isinstance(value, (fx.Proxy, torch.dtype, torch.device)) or is_constant(value)
