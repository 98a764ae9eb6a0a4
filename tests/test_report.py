import json
import math
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from lowconv.perf import measure_compiled_ms, measure_perf
from lowconv.report import (
    LogitMetrics,
    OutputRow,
    Perf,
    Report,
    SiteRow,
    build_report,
    flatten_outputs,
    gate_failures,
    logit_metrics,
    report_from_dict,
    report_to_dict,
    report_to_markdown,
    report_to_table,
    tensor_metrics,
)


def numpy_metrics(ref: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """The numeric suite's definitions, written independently in numpy float64."""
    x = ref.double().numpy().ravel()
    y = test.double().numpy().ravel()
    noise = np.linalg.norm(x - y)
    return {
        "sqnr_db": 20 * np.log10(np.linalg.norm(x) / noise),
        "cosine": x @ y / (np.linalg.norm(x) * np.linalg.norm(y)),
        "rel_l2": noise / np.linalg.norm(x),
        "max_abs": np.abs(x - y).max(),
    }


def test_tensor_metrics_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 33, generator=g)
    test = ref + 0.01 * torch.randn(64, 33, generator=g)
    m = tensor_metrics(ref, test)
    expected = numpy_metrics(ref, test)
    for name, value in expected.items():
        assert getattr(m, name) == pytest.approx(value, rel=1e-12), name
    assert 35 < m.sqnr_db < 45  # 1% noise is about 40 dB
    assert (m.nan, m.inf, m.numel, m.new_nonfinite) == (0, 0, 64 * 33, 0)


def test_tensor_metrics_do_not_overflow_in_half_precision():
    # ||ref||^2 = 300^2 * 1000 overflows float16 (max 65504); float64 gives the exact 20 log10(300).
    ref = torch.full((1000,), 300.0, dtype=torch.float16)
    test = ref + 1
    m = tensor_metrics(ref, test)
    assert m.sqnr_db == pytest.approx(20 * math.log10(300), rel=1e-12)
    assert m.rel_l2 == pytest.approx(1 / 300, rel=1e-12)
    assert m.max_abs == 1.0


def test_identical_and_zero_tensors():
    x = torch.randn(10)
    m = tensor_metrics(x, x.clone())
    assert (m.sqnr_db, m.cosine, m.rel_l2, m.max_abs) == (math.inf, 1.0, 0.0, 0.0)
    zeros = torch.zeros(5)
    assert tensor_metrics(zeros, zeros).sqnr_db == math.inf
    m = tensor_metrics(zeros, torch.ones(5))
    assert (m.sqnr_db, m.rel_l2, m.cosine, m.max_abs) == (-math.inf, math.inf, 0.0, 1.0)
    empty = torch.empty(0, 3)
    assert tensor_metrics(empty, empty).sqnr_db == math.inf


def test_nan_and_inf_are_counted_and_poison_the_metrics():
    ref = torch.randn(10)
    test = ref.clone()
    test[0], test[1], test[2] = math.nan, math.nan, math.inf
    m = tensor_metrics(ref, test)
    assert (m.nan, m.inf, m.new_nonfinite) == (2, 1, 3)
    assert math.isnan(m.sqnr_db)
    # NaN where the original already had NaN is not new.
    ref[0] = math.nan
    assert tensor_metrics(ref, test).new_nonfinite == 2


def test_inf_in_the_original_must_be_matched_and_the_rest_is_measured():
    ref = torch.tensor([1.0, 2.0, -math.inf, math.inf])
    m = tensor_metrics(ref, torch.tensor([1.0, 2.5, -math.inf, math.inf]))
    assert m.changed_inf == 0 and m.new_nonfinite == 0 and m.max_abs == 0.5 and m.numel == 4
    assert m.sqnr_db == pytest.approx(20 * math.log10(math.sqrt(5) / 0.5))
    m = tensor_metrics(ref, torch.tensor([1.0, 2.0, 3.0, -math.inf]))
    assert m.changed_inf == 2 and m.sqnr_db == math.inf
    report = Report(sites=[], outputs=[OutputRow("output", m)])
    assert gate_failures(report) == ["output: 2 values differ where the original output is +-Inf"]


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        tensor_metrics(torch.zeros(2, 3), torch.zeros(3, 2))


def test_logit_metrics_match_float64_reference():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 6, 50, generator=g)
    test = ref + 0.3 * torch.randn(4, 6, 50, generator=g)
    m = logit_metrics(ref, test)
    x = ref.double().numpy().reshape(-1, 50)
    y = test.double().numpy().reshape(-1, 50)
    log_p = x - np.log(np.exp(x).sum(-1, keepdims=True))
    log_q = y - np.log(np.exp(y).sum(-1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1).mean()
    assert m.kl == pytest.approx(kl, rel=1e-10)
    assert m.kl > 0
    assert m.top1 == pytest.approx((x.argmax(-1) == y.argmax(-1)).mean())
    assert m.rows == 24


def test_logit_metrics_top1_and_masked_classes():
    ref = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, -math.inf]])
    test = torch.tensor([[0.0, 4.0, 1.0], [0.0, 3.0, 1.0], [0.0, 0.0, 8.0], [1.0, 2.0, -math.inf]])
    m = logit_metrics(ref, test)
    assert m.top1 == 0.75
    assert math.isfinite(m.kl)  # a class with zero probability in both adds nothing
    assert logit_metrics(ref, ref).kl == 0.0


def test_flatten_outputs():
    Pair = namedtuple("Pair", ["hidden", "ids"])

    @dataclass
    class Out:
        loss: torch.Tensor | None
        scores: torch.Tensor

    class HFLike(OrderedDict):  # transformers' ModelOutput is an OrderedDict of its non-None fields
        def to_tuple(self):
            return tuple(self.values())

    class TupleOnly:
        def to_tuple(self):
            return (torch.ones(1), torch.ones(2))

    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    assert flatten_outputs(a) == [("output", a)]
    assert flatten_outputs(torch.arange(3)) == []
    assert [n for n, _ in flatten_outputs((a, [b, torch.arange(2)], None, "text"))] == ["output[0]", "output[1][0]"]
    named = flatten_outputs({"logits": a, "extra": {"h": b}, 3: c})
    assert [n for n, _ in named] == ["output.logits", "output.extra.h", "output[3]"]
    assert named[0][1] is a
    assert [n for n, _ in flatten_outputs(Pair(a, torch.arange(2)))] == ["output.hidden"]
    assert [n for n, _ in flatten_outputs(Out(None, b), "y")] == ["y.scores"]
    assert [n for n, _ in flatten_outputs(HFLike(logits=a, hidden_states=(b, c)))] == [
        "output.logits", "output.hidden_states[0]", "output.hidden_states[1]"]
    assert [n for n, _ in flatten_outputs(TupleOnly())] == ["output[0]", "output[1]"]


def small_report(**kwargs) -> Report:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 16, generator=g)
    site_pairs = {"fc1": (x, x + 0.01 * torch.randn(8, 16, generator=g)), "fc2": (x, x.clone())}
    site_ops = {"fc1": "fp8", "fc2": "semi_sparse", "head": "fp8"}
    logits = torch.randn(2, 5, 10, generator=g)
    outputs = [("output.logits", logits, logits + 0.05 * torch.randn(2, 5, 10, generator=g))]
    return build_report(site_pairs, site_ops, outputs, site_stats={"fc2": {"density": 0.5}}, title="toy", **kwargs)


def test_build_report_rows():
    report = small_report(gate_min_sqnr_db=20.0)
    assert [(s.fqn, s.op) for s in report.sites] == [("fc1", "fp8"), ("fc2", "semi_sparse"), ("head", "fp8")]
    assert report.sites[1].metrics.sqnr_db == math.inf
    assert report.sites[1].stats == {"density": 0.5}
    assert report.sites[2].metrics is None and report.sites[2].note == "not reached by the inputs"
    assert report.outputs[0].logits is not None  # auto: the name ends with "logits"
    assert report.passed


def test_build_report_logit_modes():
    x = torch.randn(3, 4)
    pairs = [("output[0]", x, x), ("output.logits", x, x), ("output[1]", x[0], x[0])]
    auto = build_report({}, {}, pairs)
    assert [o.logits is not None for o in auto.outputs] == [False, True, False]
    always = build_report({}, {}, pairs, logits=True)
    assert [o.logits is not None for o in always.outputs] == [True, True, False]  # 1-d has no rows
    never = build_report({}, {}, pairs, logits=False)
    assert [o.logits is not None for o in never.outputs] == [False, False, False]


def test_build_report_rejects_sites_without_an_op():
    x = torch.randn(2)
    with pytest.raises(ValueError, match="ghost"):
        build_report({"ghost": (x, x)}, {}, [])


def test_gate():
    x = torch.randn(1000)
    noisy = x + 0.1 * x.norm() / math.sqrt(1000) * torch.randn(1000)  # about 20 dB
    sqnr = tensor_metrics(x, noisy).sqnr_db
    assert build_report({}, {}, [("output", x, noisy)], gate_min_sqnr_db=sqnr - 0.01).passed
    failing = build_report({}, {}, [("output", x, noisy)], gate_min_sqnr_db=sqnr + 0.01)
    assert not failing.passed
    assert gate_failures(failing) == [f"output: SQNR {sqnr:.1f} dB is below the gate of {sqnr + 0.01:.1f} dB"]


def test_site_gate_holds_each_converted_site_alone():
    x = torch.randn(1000)
    good, bad = x + 0.1 * x.std() * torch.randn(1000), x.flip(0)  # about 20 dB; about 0 dB
    sites = {"fc1": (x, bad), "fc2": (x, bad)}  # in the model: the outputs of earlier errors too
    alone = {"fc1": (x, good), "fc2": (x, bad)}
    report = build_report(sites, {"fc1": "semi_sparse", "fc2": "semi_sparse"}, [("output", x, bad)],
                          site_alone=alone, gate_min_site_sqnr_db=5.0)
    failures = gate_failures(report)
    assert len(failures) == 1 and failures[0].startswith("fc2 (semi_sparse) alone: SQNR ")
    assert failures[0].endswith("dB is below the site gate of 5.0 dB")
    assert "FAIL (gate: SQNR >= 5.0 dB at every converted site alone, no new NaN/Inf)" in report_to_table(report)
    alone["fc2"] = (x, good)
    passing = build_report(sites, {"fc1": "semi_sparse", "fc2": "semi_sparse"}, [("output", x, bad)],
                           site_alone=alone, gate_min_site_sqnr_db=5.0, gate_min_sqnr_db=-10.0)
    assert passing.passed
    assert ("PASS (gate: SQNR >= -10.0 dB at every output and SQNR >= 5.0 dB at every converted site alone"
            in report_to_table(passing))
    assert report_from_dict(json.loads(json.dumps(report_to_dict(report)))).gate_min_site_sqnr_db == 5.0
    # A site a report could not measure fails the site gate (one not reached by the inputs does not).
    unmeasured = build_report({}, {"fc1": "fp8", "fc2": "fp8"}, [], site_alone={"fc1": (x, good)},
                              gate_min_site_sqnr_db=5.0, site_notes={"fc2": "not measured: its module never ran"},
                              scope="streamed")
    assert gate_failures(unmeasured) == ["fc2 (fp8): the site gate of 5.0 dB cannot be checked, it was not measured: "
                                         "its module never ran"]
    assert build_report({}, {"fc1": "fp8"}, [], gate_min_site_sqnr_db=5.0).passed  # not reached


def test_new_nan_fails_even_without_a_gate():
    x = torch.randn(10)
    y = x.clone()
    y[3] = math.inf
    report = build_report({}, {}, [("output", x, y)])
    assert not report.passed
    assert "1 NaN/Inf values where the original output is finite" in gate_failures(report)[0]
    x[3] = math.inf  # the original overflows there too: not the conversion's doing
    assert build_report({}, {}, [("output", x, y)]).passed


def test_gate_with_no_outputs_fails():
    assert not build_report({}, {}, [], gate_min_sqnr_db=20).passed
    assert build_report({}, {}, []).passed


def test_table_formatting():
    report = small_report(gate_min_sqnr_db=20.0, perf=Perf(2.0, 1.0, 100.0, 60.0, "NVIDIA H100"))
    text = report_to_table(report)
    fc1 = report.sites[0].metrics
    assert f"{fc1.sqnr_db:.1f}" in text
    assert f"{fc1.rel_l2:.3g}" in text
    assert "inf" in text  # fc2 is identical
    assert "not reached by the inputs" in text
    assert "density=0.5" in text
    logits = report.outputs[0].logits
    assert logits.rows == 10 and f"{round(logits.top1 * 10)}/10" in text  # top-1 as a count of rows
    assert "0.50x" in text and "0.60x" in text and "NVIDIA H100" in text
    assert "PASS" in text and "nothing was converted" not in text


def test_a_conversion_that_converted_nothing_says_so_in_its_verdict():
    x = torch.randn(10)
    text = report_to_table(build_report({}, {}, [("output", x, x.clone())]))
    assert "PASS (no SQNR gate, no new NaN/Inf; nothing was converted (the plan says why for each site))" in text


def test_table_shows_failures():
    x = torch.randn(10)
    text = report_to_table(build_report({}, {}, [("output", x, torch.zeros(10))], gate_min_sqnr_db=20))
    assert "FAIL" in text and "output: SQNR 0.0 dB is below the gate of 20.0 dB" in text


def test_markdown():
    md = report_to_markdown(small_report(gate_min_sqnr_db=20.0))
    assert md.startswith("# toy\n")
    assert "## Model outputs" in md and "## Converted sites" in md
    assert "| fc1 " in md and "|---" in md


def test_dict_roundtrip_is_json_safe():
    report = small_report(gate_min_sqnr_db=25.0, perf=Perf(2.0, 1.5, 100.0, 60.0, "NVIDIA H100"))
    report.sites[2].metrics = tensor_metrics(torch.zeros(3), torch.ones(3))  # -inf SQNR, inf rel L2
    text = json.dumps(report_to_dict(report), allow_nan=False)
    d = json.loads(text)
    assert d["sites"][1]["metrics"]["sqnr_db"] == "inf"
    assert d["sites"][2]["metrics"]["sqnr_db"] == "-inf"
    assert d["passed"] is report.passed
    assert report_from_dict(d) == report


def test_dict_roundtrip_keeps_nan():
    x = torch.randn(4)
    y = x.clone()
    y[0] = math.nan
    report = build_report({}, {}, [("output", x, y)])
    d = json.loads(json.dumps(report_to_dict(report), allow_nan=False))
    assert d["outputs"][0]["metrics"]["sqnr_db"] == "nan"
    assert math.isnan(report_from_dict(d).outputs[0].metrics.sqnr_db)
    assert d["passed"] is False


def test_report_rows_are_plain_data():
    row = OutputRow("output", tensor_metrics(torch.ones(2), torch.ones(2)), LogitMetrics(0.0, 1.0, 1))
    report = Report(sites=[SiteRow("fc", "keep", None)], outputs=[row])
    assert report_from_dict(report_to_dict(report)) == report


def test_measure_perf_refuses_the_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        measure_perf(torch.nn.Linear(2, 2), (torch.randn(1, 2),), {}, "cpu")


@pytest.mark.gpu
def test_measure_perf_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    small = torch.nn.Linear(256, 256).cuda()
    large = torch.nn.Linear(4096, 4096).cuda()
    x_small, x_large = torch.randn(64, 256, device="cuda"), torch.randn(64, 4096, device="cuda")
    ms_small, mb_small = measure_perf(small, (x_small,), {}, "cuda")
    ms_large, mb_large = measure_perf(large, (x_large,), {}, "cuda")
    assert 0 < ms_small and 0 < ms_large
    # The weights dominate: 4096 x 4096 float32 is 64 MiB, and the small model must not count them.
    assert 64 <= mb_large < 70
    assert mb_small < 2


def test_compiled_times_are_shown_and_kept():
    perf = Perf(2.0, 1.5, 100.0, 60.0, "NVIDIA H100", original_compiled_ms=1.6, converted_compiled_ms=0.8)
    report = small_report(gate_min_sqnr_db=25.0, perf=perf)
    text = report_to_table(report)
    assert "median ms, torch.compile" in text and "1.6" in text and "0.50x" in text
    assert report_from_dict(json.loads(json.dumps(report_to_dict(report)))) == report
    older = report_to_dict(small_report(perf=Perf(2.0, 1.5, 100.0, 60.0, "NVIDIA H100")))
    for key in ("original_compiled_ms", "converted_compiled_ms"):  # a report.json written before they existed
        del older["perf"][key]
    assert report_from_dict(older).perf.converted_compiled_ms is None


@pytest.mark.gpu
def test_compiled_time_of_a_model_on_the_gpu():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()).cuda()
    assert measure_compiled_ms(model, (torch.randn(64, 256, device="cuda"),), {}) > 0


def test_a_model_that_does_not_compile_has_no_compiled_time_and_says_why(monkeypatch):
    def fails_to_compile(model):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor refused\nmore detail")
        return compiled

    monkeypatch.setattr(torch, "compile", fails_to_compile)
    with pytest.warns(UserWarning, match="torch.compile of Linear failed.*RuntimeError: inductor refused$"):
        assert measure_compiled_ms(torch.nn.Linear(2, 2), (torch.randn(2),), {}) is None
