"""The stored calibrations are what `python -m bench.plan.calibrate` fits on the curated records today: a refit
of the curated examples each fit names as its source against the stored offsets, per framework and measurement
setting: the bf16 pool at glibc's own mmap threshold (the GPT-2-shaped glm-base sweep and the Llama-shaped
llama-base rung, seed 1) and the fp32 llama-base rung at 128 KiB."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adapters import registry
from bench.plan import calibration
from bench.plan.accuracy import comparisons
from bench.plan.calibrate import _records, refit

REPO = Path(__file__).resolve().parents[1]
GPT2_LADDER = "results/examples/glm-base"
FP32_RUNG = "results/examples/llama-base-fp32"
REFERENCE_RUNG = "results/examples/llama-base-fp32-torch"
FRAMEWORKS = ("dschat", "colossalai", "trlx", "torch")
# every stored fit: (framework, the setting's mmap threshold, a root it must name); the plain-PyTorch reference
# has its own fp32 rung only
FITS = tuple((f, t, root) for t, root in ((None, GPT2_LADDER), (131072, FP32_RUNG))
             for f in ("dschat", "colossalai", "trlx")) + (("torch", 131072, REFERENCE_RUNG),)


def _sources(stored: calibration.Calibration) -> list[str]:
    return stored.fitted_on["source"].split(" + ")


@pytest.fixture(scope="module")
def stored() -> dict[tuple[str, int | None], calibration.Calibration]:
    out = {}
    for framework in FRAMEWORKS:
        fits = calibration.load_all(registry.package(framework))
        thresholds = [cal.setting.mmap_threshold for cal in fits]
        expected = [t for f, t, _ in FITS if f == framework]
        assert sorted(thresholds, key=str) == sorted(expected, key=str), f"{framework}: {thresholds}"
        out.update({(framework, cal.setting.mmap_threshold): cal for cal in fits})
    return out


@pytest.mark.parametrize("framework, threshold, root", FITS)
def test_the_stored_calibration_equals_a_refit_of_the_curated_records(stored, framework, threshold, root):
    """A staleness check, not an oracle: the shipped file still equals what bench.plan.calibrate refits from the
    records git keeps with the current code (a change to the physics that moves a fit fails here until refitted)."""
    cal = stored[(framework, threshold)]
    roots = _sources(cal)
    assert root in roots and all((REPO / r).is_dir() for r in roots), roots
    records = _records([str(REPO / r) for r in roots])
    fit = refit(records, comparisons(records), cal.fitted_on["selection"], cal.fitted_on["source"], framework)
    assert fit is not None
    fitted = fit[0]
    assert fitted.fitted_on == cal.fitted_on
    assert fitted.setting == cal.setting
    assert sorted(fitted.offsets_bytes) == sorted(cal.offsets_bytes)
    drifted = {k: (cal.offsets_bytes[k], v) for k, v in fitted.offsets_bytes.items()
               if v != pytest.approx(cal.offsets_bytes[k], rel=1e-9, abs=1.0)}
    assert drifted == {}, f"{framework}: stored -> refit offsets differ (bytes): {json.dumps(drifted)}; " \
                          "run python -m bench.plan.calibrate " + " ".join(
                              roots + [f"--select {k}={v}" for k, v in cal.fitted_on["selection"].items()])
    # each fitted model's factor per stage and phase, refit from the same runs
    assert fitted.model_factors == pytest.approx(cal.model_factors, rel=1e-9), f"{framework}: stored factors are stale"
    assert fitted.batch_shares == pytest.approx(cal.batch_shares, rel=1e-9), f"{framework}: stored shares are stale"
    assert fitted.reference_tokens == cal.reference_tokens


def test_each_fit_s_setting_is_what_its_records_ran_under(stored):
    """Read a second way: the precision and memory_mmap_threshold of every curated, successful record.json that a
    fit's selection names under its sources (a forced failure measures nothing)."""
    for (framework, threshold), cal in stored.items():
        seen = set()
        for root in _sources(cal):
            for path in (REPO / root).rglob("record.json"):
                record = json.loads(path.read_text())
                config = record["config"]
                if config["framework"]["name"] == framework and _selected(config, cal.fitted_on["selection"]) \
                        and record["status"] == "ok" and "forced-failure" not in config.get("tags", []):
                    seen.add((config.get("memory_mmap_threshold"), config["precision"]))
        assert {t for t, _ in seen} == {threshold}, (framework, seen)
        assert set(cal.setting.precisions) == {p for _, p in seen}, (framework, seen)


def _selected(config: dict[str, Any], selection: dict[str, Any]) -> bool:
    """The selection read by hand: each dotted key's value equals the wanted one, or is one of a wanted list."""
    for dotted, wanted in selection.items():
        value: Any = config
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value not in (wanted if isinstance(wanted, list) else [wanted]):
            return False
    return True


@pytest.mark.parametrize("framework, threshold, root", FITS)
def test_preflight_s_runtime_is_the_median_baseline_of_the_fitted_records(stored, framework, threshold, root):
    """Read a second way: every curated record.json of the framework under the fit's sources that its selection
    names, rank 0's post-import baseline of each successful stage, their median; a run of a setting no fit was
    measured under takes the first fit's, said so; on a device with no records the runtime is not counted."""
    import statistics

    from bench.plan.preflight import runtime_bytes
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    cal = stored[(framework, threshold)]
    baselines = []
    for root in _sources(cal):
        for path in (REPO / root).rglob("record.json"):
            record = json.loads(path.read_text())
            config = record["config"]
            if record["status"] != "ok" or config["framework"]["name"] != framework \
                    or not _selected(config, cal.fitted_on["selection"]):
                continue
            for stage in record["stages"].values():
                if stage["status"] == "ok":
                    baselines.append(stage["memory"]["baseline_bytes_per_rank"][0])
    assert len(baselines) >= 10
    overrides = [f"framework={framework}", f"precision={'bf16' if threshold is None else 'fp32'}"]
    fixed = "null" if threshold is None else threshold
    spec = spec_from_config(compose([*overrides, f"memory_mmap_threshold={fixed}"]))
    runtime, source = runtime_bytes(spec, "cpu")
    assert runtime == statistics.median(baselines)
    assert 300 * 2**20 < runtime < 500 * 2**20 and "median post-import baseline" in source
    assert "measured under" not in source
    elsewhere = spec_from_config(compose([*overrides, "memory_mmap_threshold=4194304"]))
    pooled = stored[next((f, t) for f, t, _ in FITS if f == framework)]  # the framework's first fit
    assert runtime_bytes(elsewhere, "cpu")[0] == pooled.runtime_bytes
    assert f"measured under {pooled.setting.describe()}" in runtime_bytes(elsewhere, "cpu")[1]
    assert runtime_bytes(spec, "cuda") == (0.0, f"not counted: no {framework} records on cuda to measure it from")


def test_the_llama_rung_pairs_each_regime_s_batch_2_and_batch_4_runs():
    """The rung's design (scripts/cpu_rung.sh llama-base): full fine-tuning and LoRA 64 at ZeRO-2 and full
    fine-tuning at ZeRO-3, each with batch 2 and 4, for DS-Chat, ColossalChat (no ZeRO-3: Gemini needs CUDA,
    `unsupported`) and trlx, 128 + 128 tokens; so the batch shares are fitted on 3 x 3 x 2 + 2 x 3 = 24 pairs at
    2 x 256 and 4 x 256 tokens, and no stage is left without its pair. glm-base ran every configuration at batch
    2: no pairs."""
    from collections import defaultdict

    records = _records([str(REPO / "results/examples/llama-base"), str(REPO / GPT2_LADDER)])
    tokens: dict[tuple[str, str, str, str], set[int]] = defaultdict(set)
    for row in comparisons(records):
        if row.seed == 1:
            tokens[(row.model, row.framework, row.stage, row.batch_pair)].add(row.tokens)
    llama = [t for (model, *_), t in tokens.items() if model == "llama-base"]
    assert len(llama) == 24 and all(t == {512, 1024} for t in llama)
    assert {frozenset(t) for (model, *_), t in tokens.items() if model == "glm-base"} == {frozenset({512})}


def test_a_fit_pooling_host_peaks_of_two_floor_rules_is_refused(tmp_path, capsys):
    """The curated rung measured under floor rule 1 (no stamp); one trlx PPO record re-stamped as rule 2 (a run
    measured after the tracker stopped counting another phase's freed heap as a floor) makes it two rules: the
    fit is refused with both counts of PPO runs (the rung's six), exit 2, and nothing is written."""
    import shutil

    from bench.plan.calibrate import floor_rule, main

    rung = tmp_path / "llama-base"
    shutil.copytree(REPO / "results/examples/llama-base", rung, ignore=shutil.ignore_patterns("report"))
    records = _records([str(rung)])
    assert {floor_rule(r, stage) for r in records.values() for stage in r.get("stages") or {}} == {1}
    ppo = sorted(run for run, r in records.items()
                 if r["config"]["framework"]["name"] == "trlx" and "ppo" in (r.get("stages") or {}))
    restamped = rung / ppo[0] / "record.json"
    record = json.loads(restamped.read_text())
    # an SFT record re-stamped changes nothing: both rules choose the same runs of SFT's phases
    sft = sorted(run for run, r in records.items()
                 if r["config"]["framework"]["name"] == "trlx" and "sft" in (r.get("stages") or {}))
    sft_path = rung / sft[0] / "record.json"
    sft_record = json.loads(sft_path.read_text())
    sft_record["stages"]["sft"]["memory"]["floor_rule"] = 2
    sft_path.write_text(json.dumps(sft_record))
    records = _records([str(rung)])
    assert refit(records, comparisons(records), {"seed": 1}, str(rung), "trlx") is not None
    record["stages"]["ppo"]["memory"]["floor_rule"] = 2
    restamped.write_text(json.dumps(record))
    records = _records([str(rung)])
    with pytest.raises(ValueError, match=r"trlx: .* different floor rules .* rule 1: 5 run\(s\).* rule 2: 1 run\(s\)"):
        refit(records, comparisons(records), {"seed": 1}, str(rung), "trlx")
    assert refit(records, comparisons(records), {"seed": 1}, str(rung), "dschat") is not None  # one rule: fitted
    before = {p: p.read_bytes() for p in (REPO / "adapters").glob("*/memory_calibration.json")}
    assert main([str(rung), "--select", "seed=1"]) == 2
    assert "different floor rules" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in (REPO / "adapters").glob("*/memory_calibration.json")} == before


def test_a_fit_pooling_host_peaks_of_two_allocator_settings_is_refused(tmp_path):
    """The curated rung ran under glibc's own mmap threshold; one DS-Chat SFT record re-configured as run with it
    fixed (memory_mmap_threshold) makes two settings, refused in every stage (the threshold sets what each freed
    tensor leaves behind, SFT's too), with each setting's run count; selecting one setting fits."""
    import shutil

    rung = tmp_path / "llama-base"
    shutil.copytree(REPO / "results/examples/llama-base", rung, ignore=shutil.ignore_patterns("report"))
    records = _records([str(rung)])
    assert all("memory_mmap_threshold" not in r["config"] for r in records.values())  # before the key
    sft = sorted(run for run, r in records.items()
                 if r["config"]["framework"]["name"] == "dschat" and "sft" in (r.get("stages") or {}))
    path = rung / sft[0] / "record.json"
    record = json.loads(path.read_text())
    record["config"]["memory_mmap_threshold"] = 4194304
    path.write_text(json.dumps(record))
    records = _records([str(rung)])
    with pytest.raises(ValueError, match=r"dschat: .* different allocator settings -- memory_mmap_threshold=4194304: "
                                         r"1 run\(s\).*memory_mmap_threshold=None: 17 run\(s\)"):
        refit(records, comparisons(records), {"seed": 1}, str(rung), "dschat")
    fit = refit(records, comparisons(records), {"seed": 1, "memory_mmap_threshold": None}, str(rung), "dschat")
    assert fit is not None and fit[0].fitted_on["runs"] == 17


def test_a_run_whose_configuration_no_longer_reads_is_counted_not_dropped_silently():
    """A curated record counts its phases; the same record with a configuration that no longer reads as a run
    (its `model` gone) counts none, is named with why, and the accuracy table says how many were left out."""
    from bench.report.prediction import left_out

    record = json.loads(sorted((REPO / "results" / "examples" / "claims").rglob("record.json"))[0].read_text())
    assert comparisons({"current": record})
    config = {k: v for k, v in record["config"].items() if k != "model"}
    unreadable: dict[str, str] = {}
    assert comparisons({"stale": {**record, "config": config}}, unreadable) == []
    assert unreadable == {"stale": "KeyError: 'model'"}
    assert "Left out: 1 successful run(s)" in left_out(unreadable) and left_out({}) == ""
