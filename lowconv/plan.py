"""The plan: one decision per site, readable by a person (`lowconv inspect`) and stored in checkpoints.
Frozen: made whole once (analysis.plan_for), a changed plan is a new one (dataclasses.replace)."""
from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field

from lowconv.errors import LowconvError
from lowconv.model_file import checked_cast
from lowconv.inputs import is_constant
from lowconv.ops import OPS
from lowconv.options import parse_options
from lowconv.site import SiteRecord, description_problem, fits, type_name

PLAN_ATTR = "lowconv_plan"  # where a converted model keeps its plan


@dataclass(frozen=True)
class Decision:
    site: SiteRecord
    op: str  # the op that converts the site; "keep" when it stays as written
    options: typing.Any  # the op's Options dataclass (OPS[op].options)
    rule: int | None  # 1-based index of the recipe rule that decided, None when none matched
    reason: str  # why, in words
    note: str = ""  # what the op module measured or chose when it was built (e.g. a 2:4 layer's backend)
    forced: bool = False  # the rule says convert even where the op measures slower than the original

    @property
    def fqn(self) -> str:
        return self.site.fqn

    @property
    def converted(self) -> bool:
        return self.op != "keep"


@dataclass(frozen=True)
class Plan:
    recipe: str  # recipe name
    recipe_text: str  # the recipe file as written
    decisions: list[Decision]
    regions: list[str]  # FQNs of the traced regions
    none_args: dict[str, list[str]]  # region FQN -> forward arguments traced as the constant None
    untraced: list[dict]  # {"fqn": ..., "error": ...} for each module whose own code did not trace
    warnings: list[str] = field(default_factory=list)
    constant_args: dict[str, dict] = field(default_factory=dict)  # region FQN -> {argument: the bool/int/float/str traced}
    decided: dict[str, list[str]] = field(default_factory=dict)  # region FQN -> branches its example inputs decided
    gate_min_sqnr_db: float | None = None
    gate_min_site_sqnr_db: float | None = None
    model: dict = field(default_factory=dict)  # how the original was made: signature, seed, dtype, ...
    # nn.MultiheadAttention modules replaced before tracing, so that their projections convert (passes/mha_expand.py)
    expanded_mha: list[str] = field(default_factory=list)
    # the example inputs' shapes, dtypes and constants (lowconv/inputs.py), for load to trace with where none are given
    example_inputs: dict | None = None

    def converted(self) -> list[Decision]:
        return [d for d in self.decisions if d.converted]

    def to_json(self) -> str:
        data = asdict(self)
        data["decisions"] = [{**asdict(d), "site": d.site.to_json()} for d in self.decisions]
        return json.dumps(data, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        """The plan of to_json's text; ValueError naming the first field that is not as written
        (PlanError where the message names what is wrong in the user's words)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the plan is not a JSON object")
        for key, hint in typing.get_type_hints(Plan).items():  # the schema is the dataclass's
            if key in data and not fits(data[key], hint):
                raise ValueError(f"{key} is not a {type_name(hint)}")
        for index, decision in enumerate(data.get("decisions", [])):
            problem = decision_problem(decision)
            if problem:
                raise ValueError(f"decision {index + 1}: {problem}")
        problem = traced_args_problem(data) or model_problem(data.get("model", {}))
        if problem:
            raise ValueError(problem)
        unknown = sorted({d["op"] for d in data.get("decisions", [])} - set(OPS))
        if unknown:
            raise PlanError(f"the plan uses ops this lowconv does not have: {', '.join(unknown)} "
                            f"(known: {', '.join(OPS)})")
        data["decisions"] = [decision_from_json(d) for d in data.get("decisions", [])]
        return Plan(**data)


class PlanError(ValueError):
    """A plan's JSON that is not as lowconv writes it, said in words complete in themselves."""


def decision_from_json(data: dict) -> Decision:
    """A Decision from its JSON object (decision_problem found nothing wrong with it): its site's
    record and its op's Options, each checked."""
    fqn = data["site"]["fqn"]
    problem = description_problem(data["site"])
    if problem:
        raise PlanError(f"the plan is not valid: the site {fqn}: {problem}")
    try:
        options = parse_options(OPS[data["op"]].options, data["options"], fqn)
    except LowconvError as err:
        raise PlanError(str(err)) from None
    return Decision(**{**data, "site": SiteRecord.from_json(data["site"]), "options": options})


def decision_problem(decision) -> str | None:
    """What is wrong with a decision as read from JSON (None: nothing found)."""
    site = decision.get("site") if isinstance(decision, dict) else None
    if not isinstance(site, dict) or not isinstance(site.get("fqn"), str):
        return "no site with an fqn"
    if "info" in site and not (isinstance(site["info"], dict) and isinstance(site["info"].get("type"), str)):
        return "its site's info has no type"
    if not isinstance(decision.get("op"), str) or not isinstance(decision.get("options"), dict):
        return "no op, or options that are not an object"
    return None


def traced_args_problem(data: dict) -> str | None:
    """What is wrong with the arguments a plan traces as constants (None: nothing found); tracing
    again takes them as they are, where a wrong kind fails deep inside torch.fx."""
    for fqn, values in data.get("constant_args", {}).items():
        if not isinstance(values, dict) or not all(map(is_constant, values.values())):
            return f"constant_args of {fqn or '(whole model)'} is not an object of bools, numbers and strings"
    return None


def model_problem(model: dict) -> str | None:
    """What is wrong with the seed and dtype the plan says the original was built with (None:
    nothing found); compare builds the model again with them."""
    try:
        checked_cast(model.get("dtype"), model.get("seed", 0))
    except LowconvError as err:
        return f"model: {err}"
    return None


