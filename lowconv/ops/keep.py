"""`keep`: leave the site as the model wrote it."""
from dataclasses import dataclass

from lowconv.ops.registry import Op, register


@dataclass
class KeepOptions:
    pass


KEEP = register(Op(
    name="keep",
    kind=None,
    description="leave the site unchanged",
    options=KeepOptions,
    site_problem=lambda site, options: None,
    from_site=None,
    empty=None,
))
