"""Recipes: a TOML file of ordered rules, validated with errors that name file, rule and key,
and the planner that gives every site the op of the first rule that matches it.

    name = "vit-fp8"
    description = "FP8 on every linear but the head"

    [[rules]]
    kind = "linear"                      # optional: the op's kind
    modules = ["re:blocks\\.\\d+\\..*"]  # exact FQN | "re:" fullmatch | class name; empty: all
    ignore = ["head"]                    # same grammar
    op = "fp8"
    options = { granularity = "row" }
    force = false                        # true: convert even where the op measures slower (CUDA)
    optional = false                     # true: no warning where it matches no site

    [report]
    min_sqnr_db = 20
"""
from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from re import _constants as re_constants, _parser as re_parser  # the regex's parse tree

from lowconv.errors import LowconvError
from lowconv.ops import OPS
from lowconv.options import expect, parse_options, unknown_keys
from lowconv.passes.rewrite import replaces_region
from lowconv.passes.trace import Trace, hooked_inside
from lowconv.plan import Decision, Plan
from lowconv.site import Site

BUILTIN_DIR = Path(__file__).parent / "recipes"
SITE_KINDS = ("linear", "attention")
TOP_KEYS = {"name", "description", "rules", "report"}
RULE_KEYS = {"name", "kind", "modules", "ignore", "op", "options", "force", "optional"}
REPORT_KEYS = {"min_sqnr_db", "min_site_sqnr_db"}


@dataclass
class Rule:
    index: int  # 1-based, as people count rules in a file
    op: str
    options: object  # the op's Options dataclass instance
    kind: str | None = None
    modules: list[str] = dataclasses.field(default_factory=list)
    ignore: list[str] = dataclasses.field(default_factory=list)
    name: str = ""
    force: bool = False  # convert even where conversion measures the op slower than the original
    optional: bool = False  # for modules a model may lack (an LM's lm_head): matching none is no warning

    def label(self) -> str:
        return f"rule {self.index}" + (f" ({self.name})" if self.name else "")


@dataclass
class Recipe:
    name: str
    description: str
    rules: list[Rule]
    text: str
    source: str  # the file it came from, for messages
    min_sqnr_db: float | None = None  # the gate at every output of the model
    min_site_sqnr_db: float | None = None  # the gate at every converted site, run alone on the original's inputs


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BUILTIN_DIR.glob("*.toml"))}


def load_recipe(spec: str | Path | Recipe) -> Recipe:
    """A Recipe from a file path or the name of a built-in recipe."""
    if isinstance(spec, Recipe):
        return spec
    if not isinstance(spec, (str, Path)):
        raise LowconvError(f"recipe must be a file path, a built-in recipe's name or a Recipe, got "
                           f"{type(spec).__name__}")
    path = Path(spec)
    try:
        is_file = path.is_file()
    except OSError:  # a name longer than a path may be (TOML text passed as the recipe, say)
        is_file = False
    if not is_file:
        builtins = builtin_recipes()
        if str(spec) not in builtins:
            text = " (it reads as TOML text: pass lowconv.recipe.parse_recipe(text))" if "\n" in str(spec) else ""
            raise LowconvError(
                f"recipe {str(spec)[:200]!r} is neither a file nor a built-in recipe{text} "
                f"(built-in: {', '.join(builtins)})")
        path = builtins[str(spec)]
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: editors on Windows start files with a BOM
    except UnicodeDecodeError as err:
        raise LowconvError(f"{path}: not a TOML recipe (not UTF-8 text: {err.reason} at byte {err.start})") from None
    return parse_recipe(text, str(path))


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise LowconvError(f"{source}: not valid TOML: {err}") from None
    except RecursionError:
        raise LowconvError(f"{source}: nested too deep to read (a recipe is a few tables of rules)") from None
    unknown_keys(data, TOP_KEYS, source)
    name = expect(data.get("name", Path(source).stem), str, f"{source}: name")
    description = expect(data.get("description", ""), str, f"{source}: description")
    rules_data = expect(data.get("rules", []), list, f"{source}: rules")
    rules = [parse_rule(r, i + 1, source) for i, r in enumerate(rules_data)]
    report = expect(data.get("report", {}), dict, f"{source}: [report]")
    unknown_keys(report, REPORT_KEYS, f"{source}: [report]")
    gates = [gate_value(report, key, source) for key in ("min_sqnr_db", "min_site_sqnr_db")]
    if not rules:  # it would convert nothing and pass: a file left empty, or [[rule]] for [[rules]]
        raise LowconvError(f'{source}: no rules: a recipe needs at least one [[rules]] table with an op (e.g. '
                           f'op = "fp8"; op = "keep" to convert nothing on purpose)')
    return Recipe(name, description, rules, text, source, *gates)


def gate_value(report: dict, key: str, source: str) -> float | None:
    """[report].key as a finite number of dB (None where it is not given)."""
    gate = report.get(key)
    if gate is None:
        return None
    gate = float(expect(gate, (int, float), f"{source}: [report].{key}"))
    if not math.isfinite(gate):
        raise LowconvError(f"{source}: [report].{key} must be a finite number of dB, got {gate}")
    return gate


def parse_rule(data, index: int, source: str) -> Rule:
    where = f"{source}: rule {index}"
    data = expect(data, dict, where)
    unknown_keys(data, RULE_KEYS, where)
    if "op" not in data:
        raise LowconvError(f"{where}: missing key 'op' (one of: {', '.join(OPS)})")
    op_name = expect(data["op"], str, f"{where}: op")
    if op_name not in OPS:
        raise LowconvError(f"{where}: op: unknown op {op_name!r} (one of: {', '.join(OPS)})")
    op = OPS[op_name]
    kind = data.get("kind", op.kind)
    if kind is not None and kind not in SITE_KINDS:
        raise LowconvError(f"{where}: kind: {kind!r} is not one of: {', '.join(SITE_KINDS)}")
    if op.kind is not None and kind != op.kind:
        raise LowconvError(f"{where}: op {op_name!r} converts {op.kind} sites, not {kind} sites")
    patterns = {}
    for key in ("modules", "ignore"):
        value = data.get(key, [])
        patterns[key] = [expect(p, str, f"{where}: {key}") for p in expect(value, list, f"{where}: {key}")]
        for p in patterns[key]:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as err:
                    raise LowconvError(f"{where}: {key}: {p!r} is not a valid regex: {err}") from None
                if nested_repeat(re_parser.parse(p[3:])):
                    raise LowconvError(f"{where}: {key}: {p!r} repeats a part that itself repeats or has "
                                       f"alternatives (as (a+)+ or (a|b)*), which can take exponential time "
                                       f"on a module name: write it without the nesting (e.g. .* for (\\w+\\.)*)")
    options = parse_options(op.options, data.get("options", {}), f"{where}: options")
    return Rule(index, op_name, options, kind, patterns["modules"], patterns["ignore"],
                expect(data.get("name", ""), str, f"{where}: name"), expect(data.get("force", False), bool, f"{where}: force"),
                expect(data.get("optional", False), bool, f"{where}: optional"))


LOOPS = (re_constants.MAX_REPEAT, re_constants.MIN_REPEAT, re_constants.POSSESSIVE_REPEAT)


def nested_repeat(parsed, in_loop: bool = False) -> bool:
    """Whether a parsed regex repeats (more than once) a part that repeats or branches: Python's
    backtracking engine can take exponential time there. Strict: some such patterns are linear."""
    for op, arg in parsed:
        if op in LOOPS:
            _, high, body = arg
            loops = high > 1
            if (loops and in_loop) or nested_repeat(body, in_loop or loops):
                return True
        elif op is re_constants.BRANCH:
            if in_loop or any(nested_repeat(alternative, in_loop) for alternative in arg[1]):
                return True
        elif op in (re_constants.SUBPATTERN, re_constants.ATOMIC_GROUP, re_constants.ASSERT,
                    re_constants.ASSERT_NOT):
            if nested_repeat(arg if op is re_constants.ATOMIC_GROUP else arg[-1], in_loop):
                return True
    return False


def pattern_matches(pattern: str, site: Site) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], site.fqn) is not None
    return pattern == site.fqn or pattern in site.classes


def rule_matches(rule: Rule, site: Site) -> bool:
    if rule.kind is not None and rule.kind != site.kind:
        return False
    if rule.modules and not any(pattern_matches(p, site) for p in rule.modules):
        return False
    return not any(pattern_matches(p, site) for p in rule.ignore)


def would_convert(site: Site, rules: list[Rule]) -> bool:
    """Whether the first rule that matches `site` converts it (before the op's own checks)."""
    rule = next((r for r in rules if rule_matches(r, site)), None)
    return rule is not None and rule.op != "keep"


def decide(site: Site, rules: list[Rule]) -> Decision:
    keep_options = OPS["keep"].options()
    if site.unsupported:
        return Decision(site.describe(), "keep", keep_options, None, f"unsupported: {site.unsupported}")
    for rule in rules:
        if not rule_matches(rule, site):
            continue
        if rule.op == "keep":
            return Decision(site.describe(), "keep", rule.options, rule.index, f"{rule.label()} says keep")
        why_not = OPS[rule.op].site_problem(site, rule.options)
        if why_not:
            return Decision(site.describe(), "keep", keep_options, rule.index,
                            f"{rule.label()} chose {rule.op}, but {why_not}")
        return Decision(site.describe(), rule.op, rule.options, rule.index, f"{rule.label()} matched", forced=rule.force)
    return Decision(site.describe(), "keep", keep_options, None, "no rule matched")


def decide_sites(sites: list[Site], recipe: Recipe) -> list[Decision]:
    """The recipe's decision for each site."""
    return [decide(site, recipe.rules) for site in sites]


def make_plan(decisions: list[Decision], trace: Trace, recipe: Recipe, *, warnings: list[str],
              model: dict | None = None, expanded_mha: list[str] | None = None,
              example_inputs: dict | None = None) -> Plan:
    """The plan, complete: the plan is not written after it is made (analysis.plan_for makes it)."""
    return Plan(
        recipe=recipe.name,
        recipe_text=recipe.text,
        decisions=decisions,
        regions=[r.fqn for r in trace.regions],
        none_args={r.fqn: r.none_args for r in trace.regions if r.none_args},
        constant_args={r.fqn: r.constant_args for r in trace.regions if r.constant_args},
        decided={r.fqn: r.decided for r in trace.regions if r.decided},
        untraced=[dataclasses.asdict(u) for u in trace.untraced],
        warnings=warnings,
        gate_min_sqnr_db=recipe.min_sqnr_db,
        gate_min_site_sqnr_db=recipe.min_site_sqnr_db,
        model=model or {},
        expanded_mha=expanded_mha or [],
        example_inputs=example_inputs,
    )


def fixed_numbers(constant_args: dict) -> dict:
    """The numbers among a region's constant forward arguments; bools are left out: they are the flags
    (use_cache, return_dict) that callers keep."""
    return {k: v for k, v in constant_args.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def plan_warnings(decisions: list[Decision], sites: list[Site], trace: Trace, recipe: Recipe) -> list[str]:
    """What the plan warns of, given its decisions: rules that matched nothing, and what changes in
    the regions that the converted sites make the rewrite replace."""
    warnings = [
        f"{rule.label()} (op {rule.op}) matched no site"
        for rule in recipe.rules
        if not rule.optional and not any(rule_matches(rule, s) for s in sites)
    ]
    chosen = [d for d in decisions if d.rule is not None and recipe.rules[d.rule - 1].op != "keep"]
    if chosen and not any(d.converted for d in decisions):
        none_took = f"{len(chosen)} sites and none took it" if len(chosen) > 1 else "1 site and it did not take it"
        warnings.append(f"no site is converted: the recipe's rules chose an op for {none_took} "
                        f"(e.g. {chosen[0].fqn or '(whole model)'}: {chosen[0].reason})")
    converted = {d.fqn for d in decisions if d.converted}
    rewritten = {r.fqn for r in trace.regions
                 if replaces_region(r, [s for s in sites if s.region == r.fqn and s.fqn in converted])}
    warnings += [
        f"region {r.fqn or '(whole model)'} branches on self.training: it was traced in eval mode and "
        f"keeps eval behaviour (e.g. no functional dropout) when the converted model trains"
        for r in trace.regions if r.fqn in rewritten and r.reads_training
    ]
    warnings += [
        f"region {r.fqn or '(whole model)'} was traced with {len(r.decided)} branches decided by the example "
        f"inputs' shapes, dtypes and flags (at {', '.join(dict.fromkeys(d.rpartition(': ')[0] for d in r.decided))}): "
        f"the converted region checks them on every call and raises on inputs that branch otherwise"
        for r in trace.regions if r.decided and r.fqn in rewritten
    ]
    warnings += [
        f"region {r.fqn or '(whole model)'} was traced with {', '.join(f'{k}={v!r}' for k, v in fixed.items())} "
        f"(the example call's {'value' if len(fixed) == 1 else 'values'}): the converted region refuses calls with "
        f"other values (compute such a number inside the model, or pass it as a tensor)"
        for r in trace.regions if r.fqn in rewritten and (fixed := fixed_numbers(r.constant_args))
    ]
    warnings += [
        f"region {r.fqn or '(whole model)'} was traced through {', '.join(hooked)}, which "
        f"{'has' if len(hooked) == 1 else 'have'} hooks: tracing ran them once, on symbolic values, so what they "
        f"compute is now part of the converted region and what they do besides (recording, printing) will not happen"
        for r in trace.regions if r.fqn in rewritten and (hooked := hooked_inside(r))
    ]
    return warnings
