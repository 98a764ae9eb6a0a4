"""`keep`: leave the site as the model wrote it."""
from dataclasses import dataclass

from lowconv.ops.registry import register_op


@dataclass
class KeepOptions:
    pass


@register_op(KeepOptions, name="keep", kind=None, description="leave the site unchanged")
class Keep:
    """The op's builder: no module, the site stays."""
    from_site = empty = None

    @staticmethod
    def site_problem(site, options: KeepOptions) -> None:
        return None
