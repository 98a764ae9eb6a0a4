"""Streamed conversion: a model converted tensor by tensor from its checkpoint, never held whole.

The model (an hf:DIR one or a model file's, stream_model.py) is built with its parameters on the
meta device (its buffers, small, real, read from the checkpoint where it holds them), then each
parameter is made a stand-in: a zero of its dtype expanded to its shape, which takes no memory.
Tracing, shape propagation and the plan run on the stand-ins as `lowconv convert` runs them on
the loaded model (they read shapes and dtypes, never weight values), so the plan is the
in-memory path's. The converted structure is then built with each
op's `empty` on meta (as lowconv.load does): its state dict gives every output tensor's name,
dtype and shape, so every output shard's header is known before any data. Then the model runs
on its example inputs module by module (stream_pass.py), as the original and as the converted
model, in lockstep with a run per calibration batch where static or delayed scales are
calibrated: each module's parameters are read from their input shard (safetensors, one tensor at
a time) once all runs have reached it, kept tensors written as they are read (cast as
from_pretrained and --dtype cast them), and each converted site's op module built by the op's
`from_site` from the weights its module holds, calibrated on the calibration runs (the converted
model's), written at its offsets in the output shards, and measured as compare.compare measures
it (alone, and in the converted model), with the outputs, for the report. What the runs do not
reach is written after, the same way. Last, the CRC-32 checksums (fixed-width hex, written as zeros
first) and the report's hashes are patched into each header, and the files are installed as
checkpoint.save_checkpoint installs them, in one atomic swap: the in-memory conversion's tensors,
byte for byte.

The shards are written in a staging directory beside the output (`.NAME.stream/`), with a
journal of each tensor written and its checksum; a run started again after an interruption keeps
the tensors whose bytes still have their journalled checksum and converts the rest.

On CUDA, each module's weights are moved to the GPU while it runs, and never-slower times each
timed op first on random weights of its site's shapes (the plan's choices, as in memory).

Limits: linear sites only, with ops that measure nothing when built (fp8, fp16acc; not 2:4);
tensors transformers converts as it loads are refused; the report is not timed. Every run's
activations are held at once: calibrating on many batches takes memory as they do.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import sys
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lowconv import api, build, checkpoint
from lowconv.atomic_files import locked
from lowconv.calibration import calibrated_on
from lowconv.analysis import plan_conversion, plan_for, with_calibration
from lowconv.errors import LowconvError
from lowconv.input_checkpoint import CheckpointReader, check_shapes, named_tensors
from lowconv.model_file import CALIBRATION_BATCHES, CALIBRATION_INPUTS, ModelFile, no_calibration_inputs
from lowconv.model_sources import text_calibration
from lowconv.ops import OPS
from lowconv.ops.registry import Calibrated, NotesThePlan
from lowconv.passes.rewrite import freeze_named, linear_site_params, site_params
from lowconv.plan import Decision, Plan
from lowconv.recipe import Recipe, load_recipe
from lowconv.report import Report
from lowconv.site import Site
from lowconv.site_timing import SiteTiming, slower_sites, time_linear_site
from lowconv.stream_model import StandInLinears, stream_model
from lowconv.stream_pass import Reader, site_module, streamed_pass
from lowconv.stream_writer import Item, Layout, Writer, resume

LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform == "linux" else None
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20  # glibc's mallopt parameter, and its value here


@dataclass(frozen=True)
class Source:
    """Where an output tensor's bytes come from: a parameter or buffer of the original, or the op
    module of a converted site."""
    name: str  # the original tensor's name, or the op module's tensor name
    site: str | None = None  # the converted site's fqn; None: the original tensor passes through


# ---- what the stream can convert ----

def stream_problem(decision: Decision, module: nn.Module) -> str | None:
    """Why the stream cannot carry out a converted decision (None: it can)."""
    if decision.site.kind != "linear":
        return f"its site is of kind {decision.site.kind!r}, and the stream converts linear sites only"
    if isinstance(module, NotesThePlan):
        return f"{decision.op} measures and chooses its kernels as it is built, which the stream does not"
    return None


def check_streamable(plan: Plan, modules: dict[str, nn.Module], recipe: Recipe) -> None:
    for decision in plan.converted():
        problem = stream_problem(decision, modules[decision.fqn])
        if problem:
            raise LowconvError(f"--stream cannot carry out recipe {recipe.name!r}, rule {decision.rule} "
                               f"(op {decision.op}, options {asdict(decision.options)}) on {decision.fqn}: {problem}; "
                               f"convert without --stream (in memory), or leave those sites to a rule with another op")


def site_timings(plan: Plan, sites: dict[str, Site], groups: dict[str, tuple], model: nn.Module,
                 progress: Callable[[str], None]) -> dict[str, SiteTiming | None]:
    """never-slower's timing of each timed site against its original (build.build_op_modules'), on
    CUDA: the op module built from random weights of the site's shapes (a GEMM's time reads no
    values), once per timing_key; none elsewhere."""
    shared_by = Counter(groups.values())
    timings, measured = {}, {}
    for decision in plan.converted():
        op, site = OPS[decision.op], sites[decision.fqn]
        stand_ins = site_params(site, model)
        if not op.timed or decision.forced or not stand_ins["weight"].is_cuda:
            continue
        key = build.timing_key(decision, site, stand_ins, shared_by[groups[site.fqn]])
        if key not in timings:
            progress(f"timing {decision.op} against the original at the shapes of {site.fqn}")
            params = {name: torch.randn(t.shape, dtype=t.dtype, device=t.device) for name, t in stand_ins.items()}
            module = build.op_module(decision, site, params, params["weight"].device)
            timings[key] = time_linear_site(site, module, params, key[-1])
        measured[site.fqn] = timings[key]
    return measured


def calibration_runs(loaded: ModelFile, modules: dict[str, nn.Module], sites: dict[str, Site],
                     text: str | Path | None, count: int | None) -> tuple[list, str | None]:
    """The calibration batches, and what the plan says calibrated the scales: none where no
    converted site calibrates (lowconv.convert draws none then), else up to `count` (None:
    CALIBRATION_BATCHES) batches of the text file or of the model file's calibration_inputs(), or
    the example inputs. The text is read (and its mistakes named) either way."""
    draw, name = text_calibration(loaded, loaded.source, str(text)) if text else \
        (loaded.calibration, CALIBRATION_INPUTS if loaded.calibration else None)
    if not any(isinstance(m, Calibrated) and m.needs_calibration for m in modules.values()):
        return [], None
    unmodular = next((fqn for fqn in modules if site_module(loaded.model, sites[fqn]) is None), None)
    if unmodular:
        raise LowconvError(f"--stream calibrates scales with the converted model run module by module, and the "
                           f"converted site {unmodular} is no module's whole forward; convert without --stream")
    batches = list(draw(count or CALIBRATION_BATCHES)) if draw else [loaded.inputs]
    return batches, calibrated_on(len(batches), name)


# ---- the stream ----

@dataclass
class Streamed:
    """What a streamed conversion found and wrote."""
    plan: Plan
    report: Report  # as compare.compare's, not timed (stream_pass.py)
    path: Path  # the weights' file or index
    skipped: int  # tensors a previous run had written already
    written: int


def stream_convert(spec: str, recipe: str | Path | Recipe, out: str | Path, *, seed: int = 0, dtype: str | None = None,
                   device: str = "cpu", calibration_text: str | Path | None = None,
                   calibration_batches: int | None = None,
                   text_files: Callable[[Plan, Report | None], dict[str, str]] | None = None,
                   max_shard_bytes: int = checkpoint.MAX_SHARD_BYTES, recorded: dict | None = None,
                   progress: Callable[[str], None] = api.no_progress) -> Streamed:
    """Convert the model `spec` (hf:DIR, or a model file with weights_path(): stream_model.py) into
    `out` without holding it (module doc), writing what lowconv.save of the in-memory conversion
    writes. Each module computes on `device` while it runs (on CUDA, never-slower times the ops
    first, as in memory). Static and delayed scales are calibrated on up to `calibration_batches`
    batches (None: CALIBRATION_BATCHES) of `calibration_text` (a text file, as convert
    --calibration-text takes it) or of the model file's calibration_inputs(), else on the example
    inputs. `text_files(plan, report)` gives the
    files written beside the weights (the CLI's plan.json and reports): with report None for the
    layout (their names), then with the streamed report (stream_pass.py); `recorded` is added to
    Plan.model (the CLI records the model's path, seed and dtype)."""
    out, recipe = Path(out), load_recipe(recipe)
    large_blocks_unmapped()
    progress("building the model on the meta device, tracing and planning on stand-ins of its weights")
    device = torch.device(device)
    to_stream = stream_model(spec, seed, dtype, device)
    model, inputs, source, stored_as = to_stream.loaded.model, to_stream.loaded.inputs, to_stream.source, to_stream.stored_as
    if calibration_batches and not calibration_text and to_stream.loaded.calibration is None:
        raise no_calibration_inputs(spec)  # as convert refuses it in memory
    with StandInLinears(set(to_stream.built)):
        analysis, planned = plan_conversion(model, recipe, inputs, share_buffers=True)  # its own model
    sites = {s.fqn: s for s in analysis.sites}
    modules = op_modules(planned, sites)
    check_streamable(planned, modules, recipe)
    groups = build.decision_groups(planned.converted(), sites)
    measured = site_timings(planned, sites, groups, model, progress)
    for fqn in slower_sites(measured, groups):
        del modules[fqn]
    batches, calibrated = calibration_runs(to_stream.loaded, modules, sites, calibration_text, calibration_batches)
    converted, served, fused = build.rewritten(analysis, modules, groups)
    decisions = build.carried_out_all(planned, modules, measured, served, fused)
    plan = with_calibration(plan_for(model, analysis, recipe, decisions, inputs, recorded), calibrated)
    sources = tensor_sources(converted, model, modules)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    read = {s.name for s in sources.values() if s.site is None} | {
        name for site in analysis.sites if site.fqn in modules for name in (site.info.weight, site.info.bias_name) if name}
    missing = sorted(name for name in read if name in parameters and name not in stored_as)
    if missing:
        raise LowconvError(f"model {spec!r}: its checkpoint lacks {', '.join(missing[:5])} (the in-memory path "
                           f"would draw them at random): convert without --stream")
    check_shapes(model, read, stored_as, source, spec, to_stream.built_from)
    unused = sorted(set(source.files) - set(stored_as.values()))
    if unused:
        progress(f"warning: the checkpoint holds {len(unused)} tensors {to_stream.built_from} does not have, "
                 f"not written: {', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}")
    state = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in converted.state_dict(keep_vars=True).items()}
    aliases = tied(converted)
    stored = {name: t for name, t in state.items() if name not in aliases}
    def files(report: Report | None) -> dict[str, bytes]:
        return checkpoint.encoded(api.saved_files(plan, state, text_files(plan, report) if text_files else None))
    layout = Layout(checkpoint.shard_files(stored, max_shard_bytes), aliases, api.checkpoint_metadata(plan), files(None))
    staging = out.parent / f".{out.name}.stream"
    with locked(staging):  # one stream at a time into this staging directory
        if not staging.is_dir():  # a stream this one waited for finished and removed it
            staging.mkdir(parents=True)
        sums, skipped = resume(staging, layout, source.fingerprint(), progress)
        items = work_items(planned, sources, stored, sites)
        try:
            order = [stored_as[name] for name, _ in named_tensors(model) if name in stored_as]  # as the model runs
            with CheckpointReader(source, order) as reader, Writer(items, layout, staging, sums, progress) as writer:
                original = original_reader(reader.read, stored_as, model, to_stream.built, device)
                progress("converting each site, " + (f"its scales calibrated on {calibrated}, " if batches else "") +
                         "and comparing the original and the converted model on the example inputs: the model run "
                         f"module by module, {len(batches) + 2} runs in lockstep")
                report = streamed_pass(model, plan, sites, inputs, original,
                                       *pass_writers(items, sources, writer, model), calibration=batches,
                                       logits=to_stream.loaded.logits)
                for item in items:  # what the run did not reach
                    if writer.wants(item):
                        writer.write(item, item_tensors(item, sources, original))
            if writer.written:
                progress(writer.summary())
        except (KeyboardInterrupt, LowconvError, OSError) as err:
            steps = sum(all(name in sums for name in item.outputs) for item in items)  # as progress counts them
            kept = (f"the {steps} of {len(items)} steps written are kept in {staging}, where the same command "
                    f"resumes (delete it to start over); nothing in {out} was changed")
            if isinstance(err, KeyboardInterrupt):
                progress(f"stopped: {kept}")
                raise
            raise LowconvError(f"{err}; {kept}") from None
        placeholders, layout = layout.blank_headers(), replace(layout, files=files(report))
        progress(f"checksums into the headers; installing {out}")
        for file, (header, _) in layout.headers(sums).items():
            if len(header) != len(placeholders[file][0]):  # fixed-width checksums: the data stays where it is
                raise LowconvError(f"{file}: its header with checksums is not as long as the one written first "
                                   f"(a bug in lowconv); nothing in {out} was changed")
            with open(staging / file, "r+b") as f:
                f.write(header)
        writes = {out / file: moved_from(staging / file) for file in layout.shards}
        path = checkpoint.install(out, writes, layout.files, layout.shards)
    shutil.rmtree(staging)
    return Streamed(plan, report, path, skipped, writer.written)


def pass_writers(items: list[Item], sources: dict[str, Source], writer: Writer, model: nn.Module
                 ) -> tuple[Callable[[Site, Reader], nn.Module], Callable[[Site, nn.Module], None],
                            Callable[[torch.Tensor, torch.Tensor], None]]:
    """streamed_pass's `build`, `keep` and `on_load`: a site's op module built from the weights
    read, its item written once the pass keeps the module, a kept parameter's once read."""
    held = dict(named_tensors(model))
    kept = {id(held[sources[item.outputs[0]].name]): item for item in items if item.decision is None}
    by_site = {item.site.fqn: item for item in items if item.site is not None}

    def build_module(site: Site, read: Reader) -> nn.Module:
        return item_op_module(by_site[site.fqn], read)

    def keep(site: Site, module: nn.Module) -> None:
        item = by_site[site.fqn]
        writer.write(item, module_tensors(item, sources, module))

    def on_load(stand_in: torch.Tensor, tensor: torch.Tensor) -> None:
        if id(stand_in) in kept:
            item = kept[id(stand_in)]
            writer.write(item, {item.outputs[0]: tensor})
    return build_module, keep, on_load


def op_modules(plan: Plan, sites: dict[str, Site]) -> dict[str, nn.Module]:
    """Each converted site's op module, empty on meta: the converted structure without its data."""
    modules = {}
    with torch.device("meta"):
        for decision in plan.converted():
            op, site = OPS[decision.op], sites[decision.fqn]
            modules[site.fqn] = freeze_named(op.empty(site, decision.options), site.frozen)
    return modules


def tensor_sources(converted: nn.Module, model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, Source]:
    """Each output tensor's Source, found by identity: a stand-in is a tensor of the original."""
    original = {}
    for name, t in named_tensors(model):
        original.setdefault(id(t), name)
    in_sites = {id(t): (fqn, name) for fqn, m in modules.items() for name, t in m.state_dict(keep_vars=True).items()}
    sources = {}
    for name, t in converted.state_dict(keep_vars=True).items():
        if id(t) in in_sites:
            fqn, local = in_sites[id(t)]
            sources[name] = Source(local, fqn)
        else:
            sources[name] = Source(original[id(t)])
    return sources


def tied(converted: nn.Module) -> dict[str, str]:
    """{name: the first name of the same tensor}: checkpoint._store_shared_once's aliases, found by
    identity (stand-ins and meta tensors have no storage to compare)."""
    first, aliases = {}, {}
    for name, t in converted.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


def work_items(plan: Plan, sources: dict[str, Source], stored: dict[str, torch.Tensor],
               sites: dict[str, Site]) -> list[Item]:
    """The stream's steps in the model's order: a site with its op module's tensors, or a kept tensor."""
    by_site: dict[str, list[str]] = {}
    items = []
    for name in stored:
        site = sources[name].site
        if site is None:
            items.append(Item(name, [name], checkpoint.nbytes(stored[name])))
        elif site not in by_site:
            by_site[site] = [n for n in stored if sources[n].site == site]
            decision = next(d for d in plan.converted() if d.fqn == site)
            items.append(Item(f"{site} -> {decision.op}", by_site[site],
                              sum(checkpoint.nbytes(stored[n]) for n in by_site[site]), decision, sites[site]))
    return items


def item_tensors(item: Item, sources: dict[str, Source], original: Callable[[str], torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """The item's output tensors, computed from the input checkpoint."""
    if item.decision is None:
        return {item.outputs[0]: original(sources[item.outputs[0]].name)}
    return module_tensors(item, sources, item_op_module(item, original))


def item_op_module(item: Item, original: Callable[[str], torch.Tensor]) -> nn.Module:
    """A converted site's op module, built from the original's weights."""
    params = linear_site_params(item.site, original)
    return build.op_module(item.decision, item.site, params, params["weight"].device)


def module_tensors(item: Item, sources: dict[str, Source], module: nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    return {name: state[sources[name].name] for name in item.outputs}


def original_reader(read: Reader, stored_as: dict[str, str], model: nn.Module, built: dict[int, torch.dtype],
                    device: torch.device) -> Reader:
    """name -> the original's tensor as the in-memory path holds it: read(its name in the
    checkpoint, stored_as), cast to the dtype the model builds it in (as from_pretrained loads
    it), then to its stand-in's (--dtype), on `device`; a buffer the checkpoint lacks is the
    model's own (computed when it was built)."""
    held = dict(named_tensors(model))

    def original(name: str) -> torch.Tensor:
        if name not in stored_as:
            return held[name].detach()
        tensor = read(stored_as[name]).to(built.get(id(held[name]), held[name].dtype))
        return tensor.to(device, held[name].dtype)
    return original


def large_blocks_unmapped() -> None:
    """Make glibc map every block of MMAP_THRESHOLD bytes or more on its own, so that freeing it
    gives it back to the system (elsewhere nothing). By default glibc raises its threshold each time
    such a block is freed (up to 32 MB), and serves later ones from the heap, which keeps them: each
    traced layer's and each converted tensor's freed memory would stay in the process."""
    if LIBC is not None:
        LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def moved_from(staged: Path) -> Callable[[Path], None]:
    """A writer for checkpoint.install: the staged file renamed into the temporary it installs."""
    return lambda temporary: os.replace(staged, temporary)


