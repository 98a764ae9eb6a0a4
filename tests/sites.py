"""Sites built by hand, for testing ops and the planner without tracing a model."""
from lowconv.site import LinearInfo, Site, TensorMeta


def linear_site(in_features, out_features, bias=True, dtype="float16", fqn="fc", classes=("Linear", "Module")):
    info = LinearInfo("module", in_features, out_features, bias, f"{fqn}.weight", f"{fqn}.bias" if bias else None,
                      "out_in", dtype)
    return Site("linear", fqn, "", list(classes), info,
                input=TensorMeta((8, in_features), dtype), output=TensorMeta((8, out_features), dtype))
