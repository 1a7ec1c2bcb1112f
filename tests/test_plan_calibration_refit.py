"""The stored calibrations are what `python -m bench.plan.calibrate` fits on the curated records today: a refit
of results/examples/glm-base (glm-base, seed 1, the selection each file names) against the stored offsets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters import registry
from bench.plan import calibration
from bench.plan.accuracy import comparisons
from bench.plan.calibrate import refit
from bench.results.collect import collect

REPO = Path(__file__).resolve().parents[1]
CURATED = REPO / "results" / "examples" / "glm-base"


@pytest.fixture(scope="module")
def curated():
    records = collect(str(CURATED)).records
    return records, comparisons(records)


@pytest.mark.parametrize("framework", ["dschat", "colossalai", "trlx"])
def test_the_stored_calibration_equals_a_refit_of_the_curated_records(curated, framework):
    stored = calibration.load(registry.package(framework))
    assert stored is not None and stored.fitted_on["source"] == "results/examples/glm-base"
    records, rows = curated
    fit = refit(records, rows, stored.fitted_on["selection"], "results/examples/glm-base", framework)
    assert fit is not None
    fitted = fit[0]
    assert fitted.fitted_on == stored.fitted_on
    assert sorted(fitted.offsets_bytes) == sorted(stored.offsets_bytes)
    drifted = {k: (stored.offsets_bytes[k], v) for k, v in fitted.offsets_bytes.items()
               if v != pytest.approx(stored.offsets_bytes[k], rel=1e-9, abs=1.0)}
    assert drifted == {}, f"{framework}: stored -> refit offsets differ (bytes): {json.dumps(drifted)}; " \
                          "run python -m bench.plan.calibrate " + " ".join(
                              ["results/examples/glm-base"] + [f"--select {k}={v}" for k, v in
                                                               stored.fitted_on["selection"].items()])


@pytest.mark.parametrize("framework", ["dschat", "colossalai", "trlx"])
def test_preflight_s_runtime_is_the_median_baseline_of_the_fitted_records(framework):
    """Read a second way: every curated record.json of the framework at glm-base seed 1, rank 0's post-import
    baseline of each stage, their median; on a device with no records the runtime is not counted."""
    import statistics

    from bench.plan.preflight import runtime_bytes

    baselines = []
    for path in CURATED.rglob("record.json"):
        record = json.loads(path.read_text())
        config = record["config"]
        if (config["framework"]["name"], config["model"]["name"], config["seed"]) != (framework, "glm-base", 1):
            continue
        for stage in record["stages"].values():
            if stage["status"] == "ok":
                baselines.append(stage["memory"]["baseline_bytes_per_rank"][0])
    assert len(baselines) >= 10
    runtime, source = runtime_bytes(framework, "cpu")
    assert runtime == statistics.median(baselines)
    assert 300 * 2**20 < runtime < 500 * 2**20 and "median post-import baseline" in source
    assert runtime_bytes(framework, "cuda") == (0.0, f"not counted: no {framework} records on cuda to measure it from")
