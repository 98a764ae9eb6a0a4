"""Comparing a converted model with its original: every output, each converted site in the model
(earlier sites' errors included) and alone (the op on the original's inputs), and on CUDA the time
and memory of both, eager and compiled."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lowconv import report as reports
from lowconv.analysis import copy_of
from lowconv.api import plan_of
from lowconv.replay import refind_sites
from lowconv.errors import LowconvError
from lowconv.inputs import evaluating, fresh_inputs, normalize_inputs, run_eval
from lowconv.passes.mha_expand import expand_mha
from lowconv.perf import measure_compiled_ms, measure_perf
from lowconv.passes.rewrite import tap_sites
from lowconv.passes.trace import release_graphs
from lowconv.ops.registry import ReportsStats
from lowconv.plan import Plan


# A traced copy runs the same ops as the model: bit-identical on the CPU, within the run-to-run
# noise of nondeterministic GPU kernels; anything below this is a real difference.
TRACE_FIDELITY_DB = 80.0



def first_tensor(value):
    leaves = reports.flatten_outputs(value)
    return leaves[0][1] if leaves else None



@dataclass
class SiteCall:
    """What one site saw: the inputs of its first call, and its output on every call."""

    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]



def run_original(original: nn.Module, plan: Plan, inputs) -> tuple[object, dict[str, SiteCall]]:
    """The original's outputs, and the inputs and output of each site the plan converts.

    The sites are seen through a traced copy; that copy must compute what the original does,
    or tracing changed the model (data-dependent code frozen) and no number would mean anything.
    """
    work = expand_mha(copy_of(original), plan.expanded_mha)
    args, kwargs = normalize_inputs(inputs)
    # The traced copy is checked against the copy it was traced from: an expanded MHA computes what
    # nn.MultiheadAttention does, but not in the operations of torch's fused kernel.
    untraced = run_eval(work, args, kwargs) if plan.expanded_mha else None
    trace, sites = refind_sites(work, plan, inputs, "compare")
    calls: dict[str, SiteCall] = {}

    def record(fqn, output, args, kwargs):
        calls.setdefault(fqn, SiteCall(args, kwargs, [])).outputs.append(first_tensor(output).clone())

    tapped = tap_sites(work, trace, list(sites.values()), record)
    reference, traced = run_eval(original, args, kwargs), run_eval(tapped, args, kwargs)
    release_graphs(trace)  # the traced copy is not kept
    checked = reference if untraced is None else untraced
    check_no_nan(checked)
    for name, ref, test in paired_outputs(checked, traced):
        metrics = reports.tensor_metrics(ref, test)
        if not metrics.sqnr_db >= TRACE_FIDELITY_DB:
            raise LowconvError(unfaithful_trace(original, args, kwargs, reference, name, metrics.sqnr_db))
    return reference, calls


def unfaithful_trace(original: nn.Module, args, kwargs, reference, name: str, sqnr_db: float) -> str:
    """Why the traced copy's output `name` differs from the model's: the model itself, where a
    second run of it differs from its first as much (its own kernels are nondeterministic, e.g. a
    library's multithreaded CPU convolutions), else tracing."""
    again = dict(reports.flatten_outputs(run_eval(original, args, kwargs)))
    first = dict(reports.flatten_outputs(reference))
    itself = reports.tensor_metrics(first[name], again[name]).sqnr_db if name in first and name in again else math.inf
    if not itself >= TRACE_FIDELITY_DB:
        return (f"the model does not compute the same {name} twice on these inputs (SQNR {itself:.1f} dB between "
                f"two runs of the unconverted model), so no conversion's accuracy can be measured: its own "
                f"computation is nondeterministic (randomness in eval mode, or kernels whose sums depend on "
                f"threads, as spconv's on the CPU); make it repeat itself (e.g. torch.set_num_threads(1) in "
                f"the model file) and convert again")
    return (f"the traced model does not compute what the model does on these inputs ({name}: "
            f"SQNR {sqnr_db:.1f} dB): code that depends on data, on self.training or on "
            f"arguments was frozen by tracing; the plan lists the traced regions")



def check_no_nan(outputs) -> None:
    """Refuse an original whose outputs hold NaN: no accuracy can be measured against them. (An
    Inf, e.g. a masked logit, is compared as it is: the converted model must match it.)"""
    for name, ref in reports.flatten_outputs(outputs):
        nan = int(torch.isnan(ref).sum())
        if nan:
            raise LowconvError(
                f"the model's own output ({name}) holds {nan} NaN values on these inputs, so no "
                f"accuracy can be measured against it: check its weights and the example inputs")


def run_converted(converted: nn.Module, fqns: list[str], inputs) -> tuple[object, dict[str, list[torch.Tensor]]]:
    """The converted model's outputs, and each op module's output on every call."""
    outputs: dict[str, list[torch.Tensor]] = {}

    def hook(module, args, output, fqn):
        outputs.setdefault(fqn, []).append(first_tensor(output).clone())

    handles = [converted.get_submodule(fqn).register_forward_hook(
        lambda m, a, o, fqn=fqn: hook(m, a, o, fqn)) for fqn in fqns]
    try:
        return run_eval(converted, *normalize_inputs(inputs)), outputs
    finally:
        for h in handles:
            h.remove()



def paired_outputs(original, converted) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, original, converted) for every floating-point output, matched by name."""
    ref, test = reports.flatten_outputs(original), dict(reports.flatten_outputs(converted))
    if [name for name, _ in ref] != list(test):
        raise LowconvError(f"the converted model's outputs ({', '.join(test)}) are not the "
                           f"original's ({', '.join(name for name, _ in ref)})")
    return [(name, value, test[name]) for name, value in ref]



def compare(original: nn.Module, converted: nn.Module, inputs, *, logits: bool | None = None,
            min_sqnr_db: float | None = None) -> reports.Report:
    """Run both models on `inputs`: metrics at every output and per converted site, both in the
    model (errors of earlier sites included) and alone (the op on the original's inputs)."""
    plan = plan_of(converted)
    fqns = [d.fqn for d in plan.converted()]
    ops = {fqn: converted.get_submodule(fqn) for fqn in fqns}
    out_original, calls = run_original(original, plan, inputs)
    counters = {fqn: op.report_stats() for fqn, op in ops.items() if isinstance(op, ReportsStats)}
    out_converted, site_outputs = run_converted(converted, fqns, inputs)
    stats = {fqn: {k: v - before[k] for k, v in ops[fqn].report_stats().items()}  # this run's counts
             for fqn, before in counters.items()}
    in_model, notes = {}, {}
    for fqn in fqns:
        if fqn in calls and fqn in site_outputs:
            in_model[fqn], notes[fqn] = worst_call(calls[fqn].outputs, site_outputs[fqn])
    alone = {fqn: (calls[fqn].outputs[0], first_tensor(run_eval(ops[fqn], calls[fqn].args, calls[fqn].kwargs)))
             for fqn in in_model}
    outputs = paired_outputs(out_original, out_converted)
    perf = None
    device = next((p.device for p in converted.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        args, kwargs = normalize_inputs(inputs)
        # Each model times its own clones (the repeated forwards of one timing share them), with
        # torch's fast paths as the user has them: the original runs as it would without lowconv.
        with evaluating(original, plain_path=False), evaluating(converted, plain_path=False):
            original_ms, original_mb = measure_perf(original, *fresh_inputs(args, kwargs), device)
            converted_ms, converted_mb = measure_perf(converted, *fresh_inputs(args, kwargs), device)
            compiled_ms = [measure_compiled_ms(model, *fresh_inputs(args, kwargs)) for model in (original, converted)]
        perf = reports.Perf(original_ms, converted_ms, original_mb, converted_mb, str(device), *compiled_ms)
    gate = min_sqnr_db if min_sqnr_db is not None else plan.gate_min_sqnr_db
    return reports.build_report(
        in_model, {d.fqn: d.op for d in plan.converted()}, outputs, site_alone=alone,
        gate_min_sqnr_db=gate, gate_min_site_sqnr_db=plan.gate_min_site_sqnr_db, logits=logits, site_stats=stats,
        perf=perf, recipe=plan.recipe, site_notes=notes, calibration=plan.model.get("calibration", ""))



def worst_call(original: list[torch.Tensor], converted: list[torch.Tensor]) -> tuple[tuple, str]:
    """A site's (original, converted) output on the call where they differ most (lowest SQNR; a
    NaN or a change of shape ranks lowest), and a note when the site was called more than once."""
    pairs = list(zip(original, converted))

    def sqnr(pair) -> float:
        value = reports.tensor_metrics(*pair).sqnr_db if pair[0].shape == pair[1].shape else math.nan
        return -math.inf if math.isnan(value) else value

    worst = 0 if len(pairs) == 1 else min(range(len(pairs)), key=lambda i: sqnr(pairs[i]))
    note = "" if len(pairs) == 1 else f"the worst of {len(pairs)} calls (call {worst + 1})"
    if len(original) != len(converted):
        note = f"called {len(original)} times in the original, {len(converted)} in the converted model; {note}"
    return pairs[worst], note
