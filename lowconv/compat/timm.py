"""timm's code as lowconv's tracer needs it."""
from lowconv.compat.trace_hooks import TraceHook

# timm's (1.0.x) non-fused attention adds its mask through these: `scores if mask is None else
# scores + mask`, with a mask resolved from flags. Plain Python: they trace.
TRACE_HOOK = TraceHook(traced_into=frozenset({"timm.layers.attention.maybe_add_mask",
                                              "timm.layers.attention.resolve_self_attn_mask"}))
