"""experiments/benchmark/scaling.py: fits, report, and the driver's skip rules (no real sweep).

A real smoke run spawns a process per point (~5 s of imports each), so it is not run here;
the driver is exercised with a stand-in for ``run_point`` instead, plus one real child that
times out and one that fails.
"""

import argparse
import importlib
import shutil
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "benchmark"


@pytest.fixture(scope="module")
def scaling():
    """The benchmark module, imported with its folder on ``sys.path`` (it imports siblings)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("scaling")
    finally:
        sys.path.remove(str(BENCH))


def make_run(scaling, tmp_path, **overrides):
    opts = argparse.Namespace(
        methods="graddot,ekfac",
        kronfluence_python=None,
        timeout=10.0,
        budget_min=20.0,
        out=str(tmp_path),
        size_hidden=32,
        width_n_train=16,
        argv=["--smoke"],
    )
    for key, value in overrides.items():
        setattr(opts, key, value)
    return scaling.Run(opts)


def test_log_log_slope_and_affine_fit_recover_known_laws(scaling):
    xs = [16.0, 32.0, 64.0, 128.0]
    assert scaling.log_log_slope(xs, [3 * x**1.5 for x in xs]) == pytest.approx(1.5)
    a, b = scaling.affine_fit(xs, [2 + 0.5 * x for x in xs])
    assert (a, b) == (pytest.approx(2.0), pytest.approx(0.5))
    assert scaling.growth_verdict(1.1) == "~linear"
    assert scaling.growth_verdict(0.6) == "sub-linear"
    assert scaling.growth_verdict(1.4) == "super-linear"


def point(sweep, method, n_train, hidden, seconds, plan=None):
    return {
        "sweep": sweep,
        "method": method,
        "n_train": n_train,
        "hidden": hidden,
        "seconds": seconds,
        "peak_mib": 10.0,
        "checksum": 1.0,
        "plan": plan,
        "version": "test",
    }


def test_report_states_slopes_ratios_plan_changes_and_skips(scaling, tmp_path):
    run = make_run(scaling, tmp_path)
    kept = {"passes": 3, "source_passes": 1}
    rerun = {"passes": 3, "source_passes": 3}
    run.points = [
        point("size", "graddot", 16, 32, 0.16),  # 10 ms per sample: slope 1
        point("size", "graddot", 32, 32, 0.32),
        point("size", "ekfac", 16, 32, 2.0, kept),
        point("size", "ekfac", 32, 32, 8.0, rerun),  # slope 2, plan changed at 32
        point("size", "kronfluence-ekfac", 16, 32, 4.0),
        {"sweep": "size", "method": "kronfluence-ekfac", "n_train": 32, "hidden": 32}
        | {"status": "timed out (> 10 s)"},
    ]
    text = scaling.render(run)
    assert "* Grad-Dot: slope 1.00 — ~linear in n_train" in text
    assert "* EK-FAC: slope 2.00 — super-linear in n_train" in text
    assert "the pass plan went from 1 of 3 to 3 of 3 model runs at n_train 32" in text
    # EK-FAC at 16 against kronfluence's 4.0 s: 2.0 / 4.0; no peer time at 32
    assert "| EK-FAC | 16 | 2.00 | 8.0 | 10 | 1 of 3 | 0.50 | 1 |" in text
    assert "| EK-FAC | 32 | 8.00 | 4.0 | 10 | 3 of 3 | - | 1 |" in text
    assert "| kronfluence EK-FAC | 32 | timed out (> 10 s) |" in text


def test_sweep_skips_larger_points_after_a_timeout_and_width_after_the_budget(
    scaling, tmp_path, monkeypatch
):
    calls = []

    def fake_run_point(python, method, n_train, hidden, timeout):
        calls.append((method, n_train))
        if method == "ekfac":
            return {"status": f"timed out (> {timeout:g} s)"}
        return {"seconds": 0.01 * n_train, "peak_mib": 1.0, "checksum": 1.0, "version": "test"}

    monkeypatch.setattr(scaling, "run_point", fake_run_point)
    run = make_run(scaling, tmp_path)
    run.kronfluence_reason = "not run (no `--kronfluence-python`)"
    scaling.run_sweep(run, "size", [(16, 32), (32, 32), (64, 32)], budgeted=False)
    # ekfac spawned once, then skipped; graddot ran at every size; kronfluence never spawned
    assert calls == [("graddot", 16), ("ekfac", 16), ("graddot", 32), ("graddot", 64)]
    ekfac = [p["status"] for p in run.points if p["method"] == "ekfac"]
    assert ekfac[0] == "timed out (> 10 s)"
    assert ekfac[1:] == ["skipped (timed out at a smaller point)"] * 2
    assert (tmp_path / "scaling.md").exists()  # written after each point

    run.start = time.monotonic() - 60 * run.opts.budget_min - 1  # budget spent
    scaling.run_sweep(run, "width", [(16, 32), (16, 64)], budgeted=True)
    assert len(calls) == 4  # no width point was spawned
    width = [p for p in run.points if p["sweep"] == "width" and p["method"] in ("graddot", "ekfac")]
    assert [p["status"] for p in width] == ["skipped (budget of 20 min spent)"] * 4
    assert (
        "| Grad-Dot | 32 | skipped (budget of 20 min spent) |"
        in (tmp_path / "scaling.md").read_text()
    )

    scaling.write_plots(run)  # size curves exist; the width plot has nothing to draw
    assert (tmp_path / "scaling_size.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "scaling_width.png").exists()


def test_a_point_that_runs_too_long_or_fails_is_recorded_not_raised(scaling):
    # the child's imports alone take longer than the timeout
    timed_out = scaling.run_point(sys.executable, "graddot", 16, 32, timeout=0.2)
    assert timed_out == {"status": "timed out (> 0.2 s)"}
    failed = scaling.run_point(sys.executable, "no-such-method", 16, 32, timeout=60)
    assert failed["status"].startswith("failed (exit 2)")
    assert "no-such-method" in failed["status"]


def test_smoke_refuses_to_write_over_the_committed_results(scaling):
    with pytest.raises(SystemExit):
        scaling.parse_args(["--smoke", "--out", str(BENCH / "results")])
    opts = scaling.parse_args(["--smoke"])
    shutil.rmtree(opts.out)  # the temporary folder it made
    assert Path(opts.out).resolve() != (BENCH / "results").resolve()
    assert opts.methods == "graddot,ekfac"
