"""The benchmarks' reports as the documented commands write them (no fit or measurement runs here)."""

import logging
import shutil
import sys
import warnings
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _logging_and_warnings_kept():
    """The benchmarks quiet Lightning's loggers and every warning for their workers (``setup_worker``); run here,
    they silenced the RESULT lines and summaries that the CLI tests after this file read (6 failures in CI)."""
    loggers = [logging.root, *(logger for logger in logging.root.manager.loggerDict.values()
                               if isinstance(logger, logging.Logger))]
    levels = [(logger, logger.level) for logger in loggers]
    with warnings.catch_warnings():
        yield
    for logger, level in levels:
        logger.setLevel(level)


def _import(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop(name, None)
    return __import__(name)


def test_a_quick_audit_reports_the_fits_it_ran_not_the_fit_steps_default(tmp_path, monkeypatch):
    """``--quick`` takes 200 scores, so every fit is 200 steps: the header and each row's epsilon are of a 200-step
    fit (review 37: the header said "as fits of 400 steps" and "epsilon: of one 400-step fit" beside the ledger's
    epsilon of 200 steps)."""
    audit_privacy = _import("audit_privacy", monkeypatch)

    asked = []

    def full_batch_row(label, algorithm, overrides, steps, fit_steps, sigma):
        asked.append(fit_steps)
        return {"label": label, "steps": steps, "sigma": sigma, "mu_accounted": 1.0, "mu_measured": (1.0, 0.9, 1.1),
                "mu_within": True, "fit_steps": min(fit_steps, steps), "spread_accounted": 1.0,
                "spread_measured": (1.0, 0.9, 1.1), "epsilon_ledger": 1.0, "epsilon_from_measured_mu": (1.0, 0.9, 1.1),
                "one_step_epsilon_accounted": 1.0, "one_step_epsilon_lower_bound": 0.0, "seconds": 0.0,
                "scores_in": [], "scores_out": []}

    def sampling_row(steps, sigma, sample_rate):
        return {"steps": steps, "sigma": sigma, "sample_rate_accounted": sample_rate,
                "inclusion_rate": (0.25, 0.2, 0.3), "rate_within": True, "false_inclusions_without_canary": 0,
                "lag1_correlation": 0.0, "seconds": 0.0}

    monkeypatch.setattr(audit_privacy, "full_batch_row", full_batch_row)
    monkeypatch.setattr(audit_privacy, "sampling_row", sampling_row)
    stem = tmp_path / "audit"
    assert audit_privacy.main(["--quick", "--out", str(stem)]) in (0, None)
    text = stem.with_suffix(".md").read_text()
    assert set(asked) == {200}
    assert "200 steps in each, as fits of 200 steps" in text
    assert "epsilon: of one 200-step fit" in text
    asked.clear()  # an explicit --steps wins over --quick's 200, in either spelling
    assert audit_privacy.main(["--quick", "--steps=300", "--out", str(stem)]) in (0, None)
    assert set(asked) == {300} and "300 steps in each, as fits of 300 steps" in stem.with_suffix(".md").read_text()
    asked.clear()  # --modules audits those modules only, and the Poisson part only beside DPZero
    assert audit_privacy.main(["--quick", "--modules", "DPGRAPE", "--out", str(stem)]) in (0, None)
    text = stem.with_suffix(".md").read_text()
    assert len(asked) == 1 and "| DPGRAPE, rank 2 |" in text and "Poisson sampling" not in text
    with pytest.raises(SystemExit):
        audit_privacy.main(["--quick", "--modules", "DPGRAPEE", "--out", str(stem)])


def test_re_rendering_a_finished_accuracy_run_keeps_its_notes_written_by_hand(tmp_path, monkeypatch):
    """benchmarks/README.md's ``--render benchmarks/results/bench_mezo_bcd_accuracy.json  # re-summarize a run``
    rewrote the committed .md without its "Reading (written by hand after the run)" section (review 37); the probe's
    "Notes (written by hand after the run)" went the same way."""
    accuracy = _import("bench_mezo_bcd_accuracy", monkeypatch)
    for stem in ("bench_mezo_bcd_accuracy", "bench_mezo_bcd_accuracy_probe"):
        for suffix in (".json", ".md"):
            shutil.copy(BENCHMARKS / "results" / f"{stem}{suffix}", tmp_path / f"{stem}{suffix}")
        before = (tmp_path / f"{stem}.md").read_text()
        notes = before[before.index("(written by hand"):]
        notes = notes[notes.index("\n"):]  # the notes' text below their heading line
        accuracy.rerender(tmp_path / f"{stem}.json")
        after = (tmp_path / f"{stem}.md").read_text()
        assert after.count("(written by hand") == 1 and after.endswith(notes)
        if stem == "bench_mezo_bcd_accuracy":  # the rendered part is the current renderer's (its loss tables)
            assert "## Training time to reach each new best test loss of MeZO" in after
        accuracy.rerender(tmp_path / f"{stem}.json")  # idempotent: the notes are not doubled
        assert (tmp_path / f"{stem}.md").read_text() == after


def test_a_results_file_without_notes_is_re_rendered_whole(monkeypatch):
    accuracy = _import("bench_mezo_bcd_accuracy", monkeypatch)
    assert accuracy.hand_written_part("# title\n\n| a |\n") == ""
    assert accuracy.hand_written_part("# t\n\nNotes (written by hand after the run):\n\n* x\n") == (
        "\nNotes (written by hand after the run):\n\n* x\n")


def test_a_tiny_cpu_smoke_run_of_the_gpu_benchmark_leaves_the_committed_gpu_results_alone(monkeypatch):
    """benchmarks/README's CPU smoke test of ``--bcd`` (``--tiny --device cpu ... --bcd --no-opacus``, no ``--out``)
    wrote its tiny-model rows over ``benchmarks/results/bench_zo_gpu.{md,json}``, the H100 table the README links
    (review 37). A ``--tiny`` run without ``--out`` now writes under ``results/quick/``, as ``--quick`` runs do."""
    zo_gpu = _import("bench_zo_gpu", monkeypatch)
    written = []
    monkeypatch.setattr(zo_gpu, "spawn", lambda args, model, dtype, batches: {"rows": []})
    monkeypatch.setattr(zo_gpu, "write", lambda stem, meta, rows, raw: written.append(stem))
    monkeypatch.setattr(zo_gpu, "render", lambda rows: "table\n\nrows")
    monkeypatch.setattr(zo_gpu, "header", lambda meta: "")
    monkeypatch.setattr(zo_gpu, "announce_written", lambda stem: None)
    zo_gpu.main(["--tiny", "--device", "cpu", "--repeats", "1", "--models", "minilm", "--dtypes", "fp32"])
    assert written == [BENCHMARKS / "results" / "quick" / "bench_zo_gpu"]
    written.clear()
    zo_gpu.main(["--tiny", "--device", "cpu", "--models", "minilm", "--dtypes", "fp32", "--out", "/tmp/somewhere"])
    assert written == [Path("/tmp/somewhere")]


def test_a_tiny_dp_grape_run_reports_projected_per_example_storage_beside_dp_adams(tmp_path, monkeypatch):
    """``bench_dp_grape.py --tiny`` (the paper's Sec. 5 memory/throughput comparison on a 1-block, width-64 ViT-Base):
    a real CPU run of DP-GRAPE and DP-Adam in hooks mode writes its table and JSON under ``--out``, and the measured
    per-example storage is the paper's formula (``4 B (r sum n_l + unprojected)`` vs ``4 B d``), DP-GRAPE's smaller."""
    import torch

    bench = _import("bench_dp_grape", monkeypatch)
    threads = torch.get_num_threads()
    stem = tmp_path / "grape"
    try:
        assert bench.main(["--tiny", "--methods", "dpgrape,dpadam", "--grad-modes", "hooks", "--out", str(stem)]) == 0
    finally:
        torch.set_num_threads(threads)
    import json

    text = stem.with_suffix(".md").read_text()
    assert "| dpgrape_hooks |" in text and "| dpadam_hooks |" in text and "--tiny" in text
    data = json.loads(stem.with_suffix(".json").read_text())
    lines = {line["method"]: line for line in data["summary"][0]["lines"]}
    grape, adam = lines["dpgrape_hooks"], lines["dpadam_hooks"]
    assert grape["per_example_bytes"] == grape["per_example_predicted"] < adam["per_example_bytes"]
    assert adam["per_example_bytes"] == adam["per_example_predicted"] == 4 * 4 * data["rows"][0]["d"]
    assert grape["moments_bytes"] == 2 * 4 * data["rows"][0]["released"] < adam["moments_bytes"]
    assert grape["step_s"] > 0 and grape["vs_dpadam"] > 0 and not data["rows"][0]["errors"]
