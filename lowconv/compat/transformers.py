"""Hugging Face transformers' code as lowconv's tracer needs it."""
import sys

from lowconv.compat.trace_hooks import TraceHook


def cache_classes() -> tuple[type, ...]:
    """transformers' KV cache base class, where transformers is imported (a model using it is)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return (cache_utils.Cache,) if cache_utils is not None else ()


# A causal LM called with use_cache (transformers' default) builds a DynamicCache in its forward
# and returns it: the graph builds it on every call (passes/built_in_graph.py).
TRACE_HOOK = TraceHook(built_in_graph=cache_classes)
