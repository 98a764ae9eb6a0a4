import pytest

from lowconv.errors import LowconvError
from lowconv.passes.trace import Trace
from lowconv.recipe import builtin_recipes, decide_sites, load_recipe, make_plan, parse_recipe, plan_warnings
from lowconv.site import AttentionInfo, Site
from tests.sites import linear_site


def linear(fqn, k=64, n=64, classes=("Linear", "Module")):
    return linear_site(k, n, fqn=fqn, classes=classes, dtype="float32")


def attention(fqn):
    return Site("attention", fqn, "", ["Attention", "Module"], AttentionInfo("sdpa", 4, 4, 16))


def plan_for(text, sites):
    recipe, trace = parse_recipe(text, "r.toml"), Trace([], [])
    decisions = decide_sites(sites, recipe)
    return make_plan(decisions, trace, recipe, warnings=plan_warnings(decisions, sites, trace, recipe))


def test_first_matching_rule_wins_and_unmatched_sites_are_kept():
    text = """
[[rules]]
modules = ["head"]
op = "keep"
[[rules]]
modules = ["re:blocks\\\\.\\\\d+\\\\.mlp\\\\..*"]
op = "semi_sparse"
[[rules]]
op = "fp8"
options = { granularity = "row" }
"""
    sites = [linear("blocks.0.mlp.fc1"), linear("blocks.0.attn.qkv"), linear("head"), attention("blocks.0.attn.attention")]
    plan = plan_for(text, sites)
    got = {d.fqn: (d.op, d.rule) for d in plan.decisions}
    assert got == {"blocks.0.mlp.fc1": ("semi_sparse", 2), "blocks.0.attn.qkv": ("fp8", 3),
                   "head": ("keep", 1), "blocks.0.attn.attention": ("keep", None)}
    assert plan.decisions[1].options.granularity == "row"
    assert plan.decisions[3].reason == "no rule matched"
    assert plan.warnings == []


def test_class_names_ignore_and_fullmatch():
    text = """
[[rules]]
modules = ["Conv1D", "re:mlp"]
ignore = ["b"]
op = "fp8"
"""
    sites = [linear("a", classes=["Conv1D", "Module"]), linear("b", classes=["Conv1D", "Module"]), linear("mlp.fc")]
    ops = {d.fqn: d.op for d in plan_for(text, sites).decisions}
    assert ops == {"a": "fp8", "b": "keep", "mlp.fc": "keep"}  # re: is a full match, not a search


def test_op_check_keeps_site_with_reason_and_rule_without_match_warns():
    text = """
[[rules]]
op = "fp8"
[[rules]]
modules = ["nothing.here"]
op = "semi_sparse"
"""
    plan = plan_for(text, [linear("odd", k=24, n=40)])
    assert plan.decisions[0].op == "keep" and "divisible by 16" in plan.decisions[0].reason
    assert plan.decisions[0].reason.startswith("rule 1 chose fp8, but")
    assert plan.warnings[0] == "rule 2 (op semi_sparse) matched no site"
    assert plan.warnings[1].startswith("no site is converted: the recipe's rules chose an op for 1 site and it did "
                                       "not take it (e.g. odd: rule 1 chose fp8, but")
    assert len(plan.warnings) == 2
    assert plan_for(text + "optional = true\n", [linear("odd", k=24, n=40)]).warnings == plan.warnings[1:]


def test_unsupported_site_is_kept_with_its_reason():
    site = linear("tied")
    site.unsupported = "weight is tied to wte.weight; converting would untie it"
    decision = plan_for('[[rules]]\nop = "fp8"\n', [site]).decisions[0]
    assert decision.op == "keep" and "tied" in decision.reason


@pytest.mark.parametrize("text, message", [
    ("name = ", "r.toml: not valid TOML"),
    ("colour = 1", "r.toml: unknown key 'colour' (valid keys: description, name, report, rules)"),
    ('[[rules]]\nop = "fp9"', "r.toml: rule 1: op: unknown op 'fp9' (one of: dense, fp8, fp8_semi_sparse, fp16acc, keep, semi_sparse, sparse_attention)"),
    ("[[rules]]\nkind = 'linear'", "r.toml: rule 1: missing key 'op'"),
    ('[[rules]]\nop = "fp8"\nmodule = ["a"]', "r.toml: rule 1: unknown key 'module' (valid keys: force, ignore, kind, modules, name, op, optional, options)"),
    ('[[rules]]\nop = "fp8"\nkind = "attention"', "r.toml: rule 1: op 'fp8' converts linear sites, not attention sites"),
    ('[[rules]]\nop = "fp8"\nkind = "conv"', "r.toml: rule 1: kind: 'conv' is not one of: linear, attention"),
    ('[[rules]]\nop = "fp8"\nmodules = ["re:(["]', "r.toml: rule 1: modules: 're:([' is not a valid regex"),
    ('[[rules]]\nop = "fp8"\nmodules = "a"', "r.toml: rule 1: modules: expected array, got 'a'"),
    ('[[rules]]\nop = "fp8"\noptions = { scaling = "lazy" }',
     "r.toml: rule 1: options.scaling: got 'lazy'; expected one of 'dynamic', 'static', 'delayed'"),
    ('[[rules]]\nop = "fp8"\noptions = { fast_accum = 1 }', "r.toml: rule 1: options.fast_accum: got 1; expected a boolean"),
    ('[[rules]]\nop = "fp8"\noptions = { speed = 1 }', "r.toml: rule 1: options: unknown key 'speed' (valid keys: "),
    ('[[rules]]\nop = "fp16acc"\noptions = { splits = "many" }',
     "r.toml: rule 1: options.splits: got 'many'; expected one of an integer, 'auto'"),
    ('[[rules]]\nop = "fp16acc"\noptions = { splits = 0 }', "r.toml: rule 1: options.splits: must be at least 1 (got 0)"),
    ('[[rules]]\nop = "fp8"\noptions = { amax_history_len = -2 }',
     "r.toml: rule 1: options.amax_history_len: must be in [1, 1024] (got -2)"),
    ('[[rules]]\nop = "fp8"\noptions = { amax_history_len = 5000 }',
     "r.toml: rule 1: options.amax_history_len: must be in [1, 1024] (got 5000)"),
    ('[[rules]]\nop = "fp8"\noptions = { amax_reduction = "mean" }',
     "r.toml: rule 1: options.amax_reduction: got 'mean'; expected one of 'max', 'most_recent'"),
    ('[[rules]]\nop = "fp8"\noptions = { fp8_all_gather = true }',
     "r.toml: rule 1: options.fp8_all_gather: is for training (an inference layer's weight is an e4m3 buffer, "
     "which FSDP2 does not all-gather): set training = true or leave fp8_all_gather out"),
    ("[report]\nmin_sqnr_db = 'high'", "r.toml: [report].min_sqnr_db: expected integer or float, got 'high'"),
    ("[report]\nmin_sqnr_db = nan", "r.toml: [report].min_sqnr_db must be a finite number of dB, got nan"),
    ("[report]\nmin_sqnr_db = -inf", "r.toml: [report].min_sqnr_db must be a finite number of dB, got -inf"),
    ("[report]\nmin_site_sqnr_db = \"5\"", "r.toml: [report].min_site_sqnr_db"),
    ("[report]\nmax_kl = 1", "r.toml: [report]: unknown key 'max_kl' (valid keys: min_site_sqnr_db, min_sqnr_db)"),
    ("", "r.toml: no rules: a recipe needs at least one [[rules]] table"),
    ("a = " + "[" * 500 + "]" * 500, "r.toml: nested too deep to read"),
    ('[[rules]]\nop = "fp8"\nmodules = ["re:(a+)+$"]', "r.toml: rule 1: modules: 're:(a+)+$' repeats a part that itself"),
    ('[[rules]]\nop = "fp8"\nignore = ["re:x(a|aa)*"]', "r.toml: rule 1: ignore: 're:x(a|aa)*' repeats a part"),
    ('name = "x"\n[[rule]]\nop = "fp8"', "r.toml: unknown key 'rule'"),
    ('name = "x"\n[report]\nmin_sqnr_db = 20', "r.toml: no rules"),
    ('[[rules]]\nop = "keep"\noptions = { a = 1 }', "r.toml: rule 1: options: unknown key 'a' (it takes none)"),
    ('[[rules]]\nop = "sparse_attention"\noptions = { window = 2.5 }',
     "r.toml: rule 1: options.window: got 2.5; expected an integer (or leave the key out)"),
])
def test_recipe_mistakes_name_file_rule_key_and_choices(text, message):
    with pytest.raises(LowconvError) as err:
        parse_recipe(text, "r.toml")
    assert str(err.value).startswith(message), str(err.value)


def test_unknown_recipe_name_lists_the_builtins():
    with pytest.raises(LowconvError, match="neither a file nor a built-in recipe .*fp8-dynamic"):
        load_recipe("no-such-recipe")


@pytest.mark.parametrize("comments", [0, 10], ids=["short", "longer than a path"])
def test_toml_text_given_as_the_recipe_says_how_to_pass_it(comments):
    text = "# my recipe\n" * comments + '[[rules]]\nkind = "linear"\nop = "fp8"\n'
    with pytest.raises(LowconvError, match=r"neither a file nor a built-in recipe \(it reads as TOML text: pass "
                                           r"lowconv.recipe.parse_recipe\(text\)\)"):
        load_recipe(text)


def test_every_builtin_recipe_parses_and_has_a_description():
    recipes = builtin_recipes()
    assert {"keep-all", "fp8-dynamic", "semi-sparse", "fp16acc", "sparse-attention-bf16", "mixed"} <= set(recipes)
    for name in recipes:
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.description and recipe.rules
