"""What one library's code needs from lowconv's tracer (passes/tracer.py), declared in the file of
that library: the tracer asks each hook of TRACE_HOOKS and knows no library by name."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable


@dataclass(frozen=True)
class TraceHook:
    # Functions fx records as one call (fx's autowrap_functions): each call's target in the graph is
    # recorded_as(function), or the function itself where that gives None.
    autowrap_functions: Callable[[], tuple] = tuple
    # Modules whose namespaces fx patches those functions in, beside the traced forwards' globals
    # (fx's private _autowrap_search): where a library calls them by name from its own code.
    autowrap_modules: Callable[[], list[ModuleType]] = list
    recorded_as: Callable[[Callable], object | None] = lambda function: None
    # Qualified names of functions the library made opaque with torch.fx.wrap that the tracer
    # traces into instead (they hide what a pass must see, e.g. an attention's mask).
    traced_into: frozenset[str] = field(default_factory=frozenset)
    # Classes whose objects the traced code builds (and returns) that the graph builds on each call
    # (passes/built_in_graph.py): a KV cache that a forward creates.
    built_in_graph: Callable[[], tuple[type, ...]] = tuple
