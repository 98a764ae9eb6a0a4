"""How far the converted model is from the original: metrics, the gate, and their renderings.

Metrics follow torch.ao's numeric suite (SQNR, relative L2, cosine, max abs error), plus
KL(p_orig || p_conv) and top-1 agreement for outputs that are logits. Everything is computed
in float64, so the report measures the conversion and not the measuring.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Mapping

import torch
from tabulate import tabulate


@dataclass
class TensorMetrics:
    sqnr_db: float  # 20 log10(||ref|| / ||ref - test||); +inf when identical
    cosine: float
    rel_l2: float  # ||ref - test|| / ||ref||
    max_abs: float
    nan: int  # NaNs in test
    inf: int  # Infs in test
    numel: int
    new_nonfinite: int  # elements that are finite in ref but NaN/Inf in test
    changed_inf: int = 0  # elements that are +-Inf in ref (masked logits) and not the same in test


@dataclass
class LogitMetrics:
    kl: float  # mean over rows of KL(p_ref || p_test)
    top1: float  # fraction of rows whose argmax agrees
    rows: int


NOT_MEASURED = "not measured"  # how a site note begins where a report could not measure the site
METRIC_CHUNK = 1 << 20  # float64 values per step of the metrics: 8 MiB a temporary


@dataclass
class SiteRow:
    fqn: str
    op: str
    metrics: TensorMetrics | None  # in the model: earlier sites' errors included; None: not reached
    alone: TensorMetrics | None = None  # the op on the original's inputs: this site's own error
    stats: dict[str, float] = field(default_factory=dict)  # the op module's report_stats()
    note: str = ""


@dataclass
class OutputRow:
    name: str
    metrics: TensorMetrics
    logits: LogitMetrics | None = None


@dataclass
class Perf:
    original_ms: float
    converted_ms: float
    original_peak_mb: float
    converted_peak_mb: float
    device: str = ""  # timings mean something only next to the device they were taken on
    # The same forwards under torch.compile (None: not measured, or the model did not compile)
    original_compiled_ms: float | None = None
    converted_compiled_ms: float | None = None


@dataclass
class Report:
    sites: list[SiteRow]
    outputs: list[OutputRow]
    gate_min_sqnr_db: float | None = None
    perf: Perf | None = None
    title: str = ""
    recipe: str = ""  # the recipe's name
    calibration: str = ""  # what calibrated static and delayed FP8 scales, where some were
    gate_min_site_sqnr_db: float | None = None  # every converted site alone (on the original's inputs)
    scope: str = ""  # what was compared, where not everything was (a streamed conversion's report)

    @property
    def passed(self) -> bool:
        return not gate_failures(self)


def tensor_metrics(ref: torch.Tensor, test: torch.Tensor) -> TensorMetrics:
    """Computed in float64, METRIC_CHUNK values at a time (an LLM's logits in float64 would be
    several times the model's activations)."""
    if ref.shape != test.shape:
        raise ValueError(
            f"cannot compare an original tensor of shape {tuple(ref.shape)} with a converted one of shape {tuple(test.shape)}"
        )
    # On the tensors' device, read once at the end: sums of ref², test², (ref - test)² and ref * test,
    # the largest |ref - test|, and counts of NaN, Inf, new non-finite and changed Inf values in test.
    # Positions where ref is +-Inf are measured as zeros (the converted must match the Inf itself).
    device = _metric_device(ref)
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    max_abs = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    ref_values, test_values = ref.reshape(-1), test.reshape(-1)
    for start in range(0, ref.numel(), METRIC_CHUNK):
        x, y = _float64_pair(ref_values[start:start + METRIC_CHUNK], test_values[start:start + METRIC_CHUNK])
        infinite = torch.isinf(x)
        counts += torch.stack([torch.isnan(y).sum(), torch.isinf(y).sum(),
                               (torch.isfinite(x) & ~torch.isfinite(y)).sum(), (infinite & (y != x)).sum()])
        x, y = torch.where(infinite, 0.0, x), torch.where(infinite, 0.0, y)
        diff = x - y
        sums += torch.stack([x.dot(x), y.dot(y), diff.dot(diff), x.dot(y)])
        max_abs = torch.maximum(max_abs, diff.abs().max())
    sums, max_abs = sums.cpu(), max_abs.cpu()
    nan, inf, new_nonfinite, changed_inf = (int(c) for c in counts.tolist())
    ref_norm, test_norm, noise = sums[:3].sqrt()
    if bool(noise == 0):
        sqnr, rel_l2, cosine = math.inf, 0.0, 1.0
    else:
        # Tensor arithmetic, so that a zero ref gives -inf/inf and NaN propagates instead of raising.
        sqnr = float(20 * torch.log10(ref_norm / noise))
        rel_l2 = float(noise / ref_norm)
        norms = ref_norm * test_norm
        cosine = 0.0 if bool(norms == 0) else float(torch.clamp(sums[3] / norms, -1, 1))
    return TensorMetrics(sqnr_db=sqnr, cosine=cosine, rel_l2=rel_l2, max_abs=float(max_abs), nan=nan, inf=inf,
                         numel=ref.numel(), new_nonfinite=new_nonfinite, changed_inf=changed_inf)


def logit_metrics(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> LogitMetrics:
    """Rows are all leading dimensions; the last dimension holds the classes. In float64, rows of
    METRIC_CHUNK values at a time."""
    if ref_logits.shape != test_logits.shape:
        raise ValueError(
            f"cannot compare original logits of shape {tuple(ref_logits.shape)} with converted ones of shape {tuple(test_logits.shape)}"
        )
    if ref_logits.ndim == 0 or ref_logits.numel() == 0:
        raise ValueError(f"logits need a class dimension and at least one row, got shape {tuple(ref_logits.shape)}")
    classes = ref_logits.shape[-1]
    ref_rows, test_rows = ref_logits.reshape(-1, classes), test_logits.reshape(-1, classes)
    step = max(1, METRIC_CHUNK // max(classes, 1))
    kl, agree = 0, 0  # tensors on the logits' device, read once at the end
    for start in range(0, ref_rows.shape[0], step):
        x, y = _float64_pair(ref_rows[start:start + step], test_rows[start:start + step])
        log_p, log_q = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
        p = log_p.exp()
        # Classes the original gives no probability add nothing, even where the converted gives -inf.
        kl = kl + torch.where(p > 0, p * (log_p - log_q), 0.0).sum()
        agree = agree + (x.argmax(-1) == y.argmax(-1)).sum()
    rows = ref_rows.shape[0]
    return LogitMetrics(kl=float(kl) / rows, top1=int(agree) / rows, rows=rows)


def flatten_outputs(obj: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Name every floating-point tensor in a model's output: "output", "output[0]", "output.logits"."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)] if obj.is_floating_point() else []
    if isinstance(obj, Mapping):  # dicts and HF ModelOutput (an OrderedDict of its non-None fields)
        items = obj.items()
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        items = zip(obj._fields, obj)
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name)) for f in fields(obj))
    elif callable(getattr(obj, "to_tuple", None)):
        items = enumerate(obj.to_tuple())
    else:
        return []
    named = []
    for key, value in items:
        name = f"{prefix}.{key}" if isinstance(key, str) else f"{prefix}[{key!r}]"
        named += flatten_outputs(value, name)
    return named


def build_report(
    site_pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    site_ops: dict[str, str],
    output_pairs: list[tuple[str, torch.Tensor, torch.Tensor]],
    *,
    gate_min_sqnr_db: float | None = None,
    gate_min_site_sqnr_db: float | None = None,
    logits: bool | None = None,
    site_alone: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    site_stats: dict[str, dict[str, float]] | None = None,
    perf: Perf | None = None,
    title: str = "",
    recipe: str = "",
    site_notes: dict[str, str] | None = None,
    calibration: str = "",
    scope: str = "",
) -> Report:
    """site_pairs: fqn -> (original, converted) output of each site in the model; site_alone: the
    same with the op run on the original's inputs; site_ops: fqn -> op name, in plan order;
    site_notes: fqn -> what to say of the measurement (e.g. which of several calls it is).

    logits: None -> logit metrics for outputs named "...logits"; True -> for every output with
    ndim >= 2 (last dim = classes); False -> never.
    """
    unplanned = [fqn for fqn in site_pairs if fqn not in site_ops]
    if unplanned:
        raise ValueError(f"captured sites that have no op: {unplanned}")
    site_stats, site_alone, site_notes = site_stats or {}, site_alone or {}, site_notes or {}
    sites = []
    for fqn, op in site_ops.items():
        stats = {name: float(value) for name, value in site_stats.get(fqn, {}).items()}
        alone = tensor_metrics(*site_alone[fqn]) if fqn in site_alone else None
        if fqn not in site_pairs:
            note = site_notes.get(fqn) or ("" if alone else "not reached by the inputs")
            sites.append(SiteRow(fqn, op, None, alone, stats, note=note))
        elif site_pairs[fqn][0].shape != site_pairs[fqn][1].shape:  # data-dependent shapes (routing)
            ref, test = site_pairs[fqn]
            note = f"output shapes differ: original {tuple(ref.shape)}, converted {tuple(test.shape)}"
            note = "; ".join(filter(None, (site_notes.get(fqn), note)))
            sites.append(SiteRow(fqn, op, None, alone, stats, note=note))
        else:
            sites.append(SiteRow(fqn, op, tensor_metrics(*site_pairs[fqn]), alone, stats, note=site_notes.get(fqn, "")))
    outputs = []
    for name, ref, test in output_pairs:
        logit_row = logit_metrics(ref, test) if _wants_logit_metrics(name, ref, logits) else None
        outputs.append(OutputRow(name, tensor_metrics(ref, test), logit_row))
    return Report(sites, outputs, gate_min_sqnr_db, perf, title, recipe, calibration, gate_min_site_sqnr_db, scope)


def _wants_logit_metrics(name: str, ref: torch.Tensor, logits: bool | None) -> bool:
    if logits is None:
        return name.endswith("logits") and ref.ndim >= 1
    return logits and ref.ndim >= 2


def gate_failures(report: Report) -> list[str]:
    """Why the report fails its gate; empty when it passes."""
    failures = []
    gate = report.gate_min_sqnr_db
    if gate is not None and not report.outputs:
        failures.append("the model has no floating-point output to hold to the SQNR gate")
    site_gate = report.gate_min_site_sqnr_db
    for row in report.sites:
        if site_gate is not None and row.alone is not None and not row.alone.sqnr_db >= site_gate:
            failures.append(f"{row.fqn} ({row.op}) alone: SQNR {_db(row.alone.sqnr_db)} dB is below the site gate "
                            f"of {_db(site_gate)} dB")
        elif site_gate is not None and row.alone is None and row.note.startswith(NOT_MEASURED):
            failures.append(f"{row.fqn} ({row.op}): the site gate of {_db(site_gate)} dB cannot be checked, it was "
                            f"{row.note}")
    for row in report.outputs:
        m = row.metrics
        if m.new_nonfinite:
            failures.append(f"{row.name}: {m.new_nonfinite} NaN/Inf values where the original output is finite")
        if m.changed_inf:
            failures.append(f"{row.name}: {m.changed_inf} values differ where the original output is +-Inf")
        # `not >=` so that a NaN SQNR fails too.
        if gate is not None and not m.sqnr_db >= gate:
            failures.append(f"{row.name}: SQNR {_db(m.sqnr_db)} dB is below the gate of {_db(gate)} dB")
    return failures


def report_to_table(report: Report) -> str:
    """The terminal rendering."""
    parts = [" ".join(filter(None, [report.title or "lowconv report", f"(recipe {report.recipe})" if report.recipe else ""]))]
    if report.scope:
        parts.append(f"compared: {report.scope}")
    for heading, headers, rows in _tables(report):
        parts.append(f"\n{heading}\n" + tabulate(rows, headers, tablefmt="simple", disable_numparse=True))
    parts.append("\n" + _verdict(report))
    return "\n".join(parts)


def report_to_markdown(report: Report) -> str:
    """report.md"""
    parts = [f"# {report.title or 'lowconv report'}"]
    if report.recipe:
        parts.append(f"Recipe: `{report.recipe}`")
    if report.calibration:
        parts.append(f"Scales calibrated on {report.calibration}.")
    if report.scope:
        parts.append(f"Compared: {report.scope}.")
    parts.append(_verdict(report))
    for heading, headers, rows in _tables(report):
        parts.append(f"## {heading}\n\n" + tabulate(rows, headers, tablefmt="github", disable_numparse=True))
    parts.append(
        "SQNR = 20 log10(‖original‖ / ‖original − converted‖), higher is better; rel L2 = "
        "‖original − converted‖ / ‖original‖; KL = KL(p_original ‖ p_converted), mean over rows. "
        "NaN/Inf counts are in the converted tensors. Computed in float64."
    )
    return "\n\n".join(parts) + "\n"


def report_to_dict(report: Report) -> dict:
    """report.json; non-finite numbers become the strings "inf", "-inf", "nan"."""
    d = _json_safe(asdict(report))
    d["passed"] = report.passed
    d["failures"] = gate_failures(report)
    return d


def report_from_dict(d: dict) -> Report:
    """The inverse of report_to_dict (the derived "passed" and "failures" are recomputed)."""
    perf = d["perf"]
    return Report(
        sites=[
            SiteRow(
                fqn=s["fqn"],
                op=s["op"],
                metrics=_tensor_metrics_from_dict(s["metrics"]),
                alone=_tensor_metrics_from_dict(s.get("alone")),
                stats={name: _number(value) for name, value in s["stats"].items()},
                note=s["note"],
            )
            for s in d["sites"]
        ],
        outputs=[
            OutputRow(
                name=o["name"],
                metrics=_tensor_metrics_from_dict(o["metrics"]),
                logits=None if o["logits"] is None else LogitMetrics(**{k: _number(v) for k, v in o["logits"].items()}),
            )
            for o in d["outputs"]
        ],
        gate_min_sqnr_db=None if d["gate_min_sqnr_db"] is None else _number(d["gate_min_sqnr_db"]),
        gate_min_site_sqnr_db=_number(d.get("gate_min_site_sqnr_db")),
        perf=None if perf is None else Perf(
            original_ms=_number(perf["original_ms"]),
            converted_ms=_number(perf["converted_ms"]),
            original_peak_mb=_number(perf["original_peak_mb"]),
            converted_peak_mb=_number(perf["converted_peak_mb"]),
            device=perf["device"],
            original_compiled_ms=_number(perf.get("original_compiled_ms")),
            converted_compiled_ms=_number(perf.get("converted_compiled_ms")),
        ),
        title=d["title"],
        recipe=d["recipe"],
        calibration=d.get("calibration", ""),
        scope=d.get("scope", ""),
    )


def _metric_device(ref: torch.Tensor) -> torch.device:
    """Where the metrics compute in float64: the ref's device where it has float64 (CPU, CUDA);
    elsewhere (MPS) the CPU."""
    return ref.device if ref.device.type in ("cpu", "cuda") else torch.device("cpu")


def _float64_pair(ref: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = _metric_device(ref)
    return ref.detach().to(device, torch.float64), test.detach().to(device, torch.float64)


def _tables(report: Report) -> list[tuple[str, list[str], list[list[str]]]]:
    """(heading, headers, rows) of every table, shared by the terminal and markdown renderings."""
    metric_headers = ["SQNR dB", "cosine", "rel L2", "max abs", "NaN/Inf"]
    tables = [] if report.scope and not report.outputs else [(
        "Model outputs",
        ["output", *metric_headers, "KL", "top-1"],
        [[row.name, *_metric_cells(row.metrics), *_logit_cells(row.logits)] for row in report.outputs],
    )]
    if report.sites and report.scope and all(row.metrics is None for row in report.sites):  # measured alone only
        tables.append((
            "Converted sites (alone: the op on the original's inputs)",
            ["site", "op", "alone SQNR dB", "cosine", "rel L2", "max abs", "NaN/Inf", "notes"],
            [[row.fqn, row.op, *_metric_cells(row.alone), _notes(row)] for row in report.sites],
        ))
    elif report.sites:
        tables.append((
            "Converted sites (in the model: earlier sites' errors included; alone: the op on the original's inputs)",
            ["site", "op", "alone SQNR dB", *metric_headers, "notes"],
            [[row.fqn, row.op, _db(row.alone.sqnr_db) if row.alone else "-", *_metric_cells(row.metrics), _notes(row)]
             for row in report.sites],
        ))
    if report.perf:
        p = report.perf
        tables.append((
            f"Time and memory{f' ({p.device})' if p.device else ''}",
            ["", "original", "converted", "converted / original"],
            [
                ["median ms", _sig3(p.original_ms), _sig3(p.converted_ms), _ratio(p.converted_ms, p.original_ms)],
                ["median ms, torch.compile", _sig3(p.original_compiled_ms), _sig3(p.converted_compiled_ms),
                 _ratio(p.converted_compiled_ms, p.original_compiled_ms)],
                ["peak MB", _sig3(p.original_peak_mb), _sig3(p.converted_peak_mb), _ratio(p.converted_peak_mb, p.original_peak_mb)],
            ],
        ))
    return tables


def _verdict(report: Report) -> str:
    gates = [f"SQNR >= {_db(gate)} dB at every {where}"
             for gate, where in ((report.gate_min_sqnr_db, "output"),
                                 (report.gate_min_site_sqnr_db, "converted site alone")) if gate is not None]
    gate = f"gate: {' and '.join(gates)}" if gates else "no SQNR gate checked" if report.scope else "no SQNR gate"
    failures = gate_failures(report)
    if not failures:
        nothing = "; nothing was converted (the plan says why for each site)" if not report.sites else ""
        return f"PASS ({gate}, no new NaN/Inf{nothing})"
    return "\n".join([f"FAIL ({gate}, no new NaN/Inf):", *(f"  - {failure}" for failure in failures)])


def _metric_cells(m: TensorMetrics | None) -> list[str]:
    if m is None:
        return ["-"] * 5
    # Cosine keeps 5 decimals: at 3 significant digits every usable conversion would read "1".
    return [_db(m.sqnr_db), f"{m.cosine:.5f}", _sig3(m.rel_l2), _sig3(m.max_abs), f"{m.nan}/{m.inf}"]


def _logit_cells(logits: LogitMetrics | None) -> list[str]:
    if logits is None:
        return ["-", "-"]
    # A count, not a rounded fraction: 999 of 1000 rows must not read as 100%.
    return [_sig3(logits.kl), f"{round(logits.top1 * logits.rows)}/{logits.rows}"]


def _notes(row: SiteRow) -> str:
    stats = ", ".join(f"{name}={_sig3(value)}" for name, value in row.stats.items())
    return "; ".join(filter(None, [row.note, stats]))


def _db(x: float) -> str:
    return f"{x:.1f}"  # Python prints inf, -inf and nan as such


def _sig3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _ratio(converted: float | None, original: float | None) -> str:
    return f"{converted / original:.2f}x" if original and converted is not None else "-"


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf", "-inf", "nan"
    if isinstance(obj, dict):
        return {key: _json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(value) for value in obj]
    return obj


def _number(value: float | int | str | None) -> float | int | None:
    return float(value) if isinstance(value, str) else value


def _tensor_metrics_from_dict(d: dict | None) -> TensorMetrics | None:
    return None if d is None else TensorMetrics(**{name: _number(value) for name, value in d.items()})
