"""The memory model's calibration: medians per regime at 16-bit width, scaled by a run's width, fallbacks.

Values worked by hand in each test."""

from __future__ import annotations

import math

import pytest

from bench.plan import calibration
from bench.plan.accuracy import LEAVE_ONE_OUT
from bench.plan.calibration import Calibration, Residual

MiB = 2**20


def test_regimes_split_zero0_only_where_the_framework_runs_it_on_another_engine() -> None:
    assert calibration.regime(0, 0) == "full"
    assert calibration.regime(0, 0, zero0_own_engine=True) == "zero0"
    assert calibration.regime(0, 64, zero0_own_engine=True) == "zero0"  # the engine decides before LoRA
    assert calibration.regime(2, 64, zero0_own_engine=True) == "lora"
    assert calibration.regime(3, 64) == "zero3"


def test_fit_takes_the_median_per_16_bit_width() -> None:
    # bf16 residuals 300 and 400 MiB; fp32 residual 700 MiB is 350 per 16 bits: median of 300, 350, 400 = 350
    key = calibration.key("rm", "training", "full")
    residuals = [Residual(key, 1300 * MiB, 1000 * MiB, 2), Residual(key, 1400 * MiB, 1000 * MiB, 2),
                 Residual(key, 2700 * MiB, 2000 * MiB, 4)]
    cal = calibration.fit("trlx", "cpu", residuals, {})
    assert cal.offsets_bytes == {key: 350 * MiB}
    assert cal.offset(key, "cpu", 2) == 350 * MiB
    assert cal.offset(key, "cpu", 4) == 700 * MiB  # twice as wide, twice the slack


def test_a_fitted_model_s_factor_scales_the_pooled_offsets_of_its_stage_and_phase() -> None:
    full, zero3, init = (calibration.key("rm", "evaluation", "full"), calibration.key("rm", "evaluation", "zero3"),
                         calibration.key("rm", "init", "full"))
    # evaluation residuals, MiB: glm 400 (full) and 600 (zero3), llama 200 and 300; the pooled offsets are the
    # medians, 300 and 450; llama's ratios 200/300 and 300/450 are both 2/3, glm's both 4/3. init: 40 and 20 MiB,
    # pooled 30, under FACTOR_MIN_BYTES: no ratio is taken of it
    residuals = [Residual(full, 1400 * MiB, 1000 * MiB, 2, "glm"), Residual(full, 1200 * MiB, 1000 * MiB, 2, "llama"),
                 Residual(zero3, 1600 * MiB, 1000 * MiB, 2, "glm"), Residual(zero3, 1300 * MiB, 1000 * MiB, 2, "llama"),
                 Residual(init, 540 * MiB, 500 * MiB, 2, "glm"), Residual(init, 520 * MiB, 500 * MiB, 2, "llama")]
    cal = calibration.fit("trlx", "cpu", residuals, {})
    assert cal.offsets_bytes == {full: 300 * MiB, zero3: 450 * MiB, init: 30 * MiB}
    assert cal.model_factors == pytest.approx({"glm/rm/evaluation": 4 / 3, "llama/rm/evaluation": 2 / 3})
    assert cal.offset(zero3, "cpu", 2, "llama") == pytest.approx(300 * MiB)
    assert cal.offset(full, "cpu", 4, "glm") == pytest.approx(800 * MiB)  # 400 per 16 bits, fp32 twice that
    assert cal.offset(zero3, "cpu", 2, "glm-large") == 450 * MiB  # a model the fit never saw: the pooled offset
    assert cal.offset(zero3, "cpu") == 450 * MiB
    assert cal.offset(init, "cpu", 2, "llama") == 30 * MiB  # too small to scale


def test_a_batch_share_is_how_a_pair_s_residuals_grow_with_the_tokens() -> None:
    key = calibration.key("rm", "training", "full")

    def at(residual_mib: float, tokens: int) -> Residual:
        return Residual(key, (1000 + residual_mib) * MiB, 1000 * MiB, 2, "", tokens, "pair")

    # 200 MiB at the reference (512 tokens), 300 at twice it: half the slack grows with the tokens
    assert calibration.batch_share(at(200, 512), at(300, 1024)) == pytest.approx(0.5)
    # 350 at three times the reference: 1 + 2s = 350 / 200, s = 0.375
    assert calibration.batch_share(at(200, 512), at(350, 1536)) == pytest.approx(0.375)
    # neither at the reference: 300 at x = 2 and 400 at x = 4; (1 + 3s) / (1 + s) = 4/3 gives s = 0.2
    assert calibration.batch_share(at(300, 1024), at(400, 2048)) == pytest.approx(0.2)


def test_offsets_are_stated_at_the_reference_micro_batch_and_a_share_grows_with_the_tokens() -> None:
    full, lora, init = (calibration.key("rm", "training", "full"), calibration.key("rm", "training", "lora"),
                        calibration.key("rm", "init", "full"))

    def run(key: str, residual_mib: float, tokens: int, pair: str) -> Residual:
        return Residual(key, (1000 + residual_mib) * MiB, 1000 * MiB, 2, "", tokens, pair)

    residuals = [
        run(full, 200, 512, "a"), run(full, 300, 1024, "a"),  # share 0.5
        run(lora, 400, 512, "b"), run(lora, 500, 1024, "b"),  # share 0.25
        run(lora, 100, 512, "c"), run(lora, 250, 1024, "c"),  # share 1.5
        run(full, 50, 512, "d"), run(full, 500, 1024, "d"),  # under FACTOR_MIN_BYTES at the smaller: no share
        run(full, 200, 512, "e"), run(full, 300, 1024, "f"),  # two configurations: no pair
        run(init, 300, 512, "a"), run(init, 300, 1024, "a"),  # another phase: its own share, none
    ]
    cal = calibration.fit("dschat", "cpu", residuals, {})
    # rm/training's shares 0.5, 0.25 and 1.5: median 0.5; at 1024 tokens a residual is 1.5x its reference value
    assert cal.batch_shares == {"rm/init": 0.0, "rm/training": 0.5}
    # full at the reference: 200, 300 / 1.5, 50, 500 / 1.5, 200, 300 / 1.5 -> 50, 200 x 4, 333.3: median 200
    # lora: 400, 500 / 1.5, 100, 250 / 1.5 -> 100, 166.7, 333.3, 400: median 250
    assert cal.offsets_bytes[full] == pytest.approx(200 * MiB)
    assert cal.offsets_bytes[lora] == pytest.approx(250 * MiB)
    assert cal.offsets_bytes[init] == pytest.approx(300 * MiB)
    assert cal.offset(full, "cpu", 2, None, 1024) == pytest.approx(300 * MiB)
    assert cal.offset(lora, "cpu", 2, None, 768) == pytest.approx(250 * 1.25 * MiB)
    assert cal.offset(lora, "cpu", 4, None, 256) == pytest.approx(2 * 250 * 0.75 * MiB)  # fp32, half the tokens
    assert cal.offset(lora, "cpu") == pytest.approx(250 * MiB)  # no tokens named: the reference
    assert cal.offset(init, "cpu", 2, None, 2048) == pytest.approx(300 * MiB)


def test_batch_shares_are_clamped_between_none_and_all_of_the_slack() -> None:
    key = calibration.key("ppo", "training", "full")

    def pair(low_mib: float, high_mib: float) -> list[Residual]:
        return [Residual(key, (1000 + v) * MiB, 1000 * MiB, 2, "", t, "p") for v, t in ((low_mib, 512),
                                                                                          (high_mib, 1024))]

    assert calibration.batch_shares(pair(200, 150)) == {"ppo/training": 0.0}  # share -0.25: slack never shrinks
    assert calibration.batch_shares(pair(200, 700)) == {"ppo/training": 1.0}  # share 2.5: none grows faster

    # 200 MiB at half the reference, -400 at twice it: (1 - 0.5 s) / (1 + s) = -0.5 has no solution (1 = -0.5);
    # the denominator 200 x 1 - (-400) x (-0.5) is 0, and the pair gives no share
    odd = [Residual(key, (1000 + v) * MiB, 1000 * MiB, 2, "", t, "q") for v, t in ((200, 256), (-400, 1024))]
    assert math.isnan(calibration.batch_share(*odd))
    assert calibration.batch_shares(odd + pair(200, 250)) == {"ppo/training": 0.25}


def test_offsets_apply_on_their_device_and_zero0_falls_back_to_full() -> None:
    cal = Calibration("trlx", "cpu", {"ppo/training/full": 100.0, "ppo/training/zero0": 40.0,
                                      "sft/training/full": 10.0})
    assert cal.offset("ppo/training/zero0", "cpu") == 40.0
    assert cal.offset("sft/training/zero0", "cpu") == 10.0  # never fitted: full's offset
    assert cal.offset("sft/training/zero0", "cpu", 4) == 20.0
    assert cal.offset("rm/training/full", "cpu") == 0.0  # nothing fitted for the stage
    assert cal.offset("ppo/training/full", "cuda") == 0.0  # fitted on the CPU: not a GPU's slack


def test_calibrate_reads_several_roots_naming_each_run_under_its_folder(tmp_path):
    from report_records import config, record, write

    from bench.plan.calibrate import _records

    for root, model in (("glm-base", "glm-base"), ("llama-base", "llama-base")):
        write(str(tmp_path / root), "run-a", record(config(**{"model.name": model}), run_id=f"{model}-a"))
    both = _records([str(tmp_path / "glm-base"), str(tmp_path / "llama-base")])
    # the same run folder under two roots stays two runs, each named by its root
    assert sorted(both) == ["glm-base/run-a", "llama-base/run-a"]
    assert both["llama-base/run-a"]["run_id"] == "llama-base-a"
    assert sorted(_records([str(tmp_path / "glm-base")])) == ["run-a"]


def test_a_selection_s_list_matches_any_of_its_items():
    from bench.plan.accuracy import in_selection

    glm = {"model": {"name": "glm-base"}, "seed": 1}
    both = {"model.name": ["glm-base", "llama-base"], "seed": 1}
    assert in_selection(glm, both)
    assert in_selection({"model": {"name": "llama-base"}, "seed": 1}, both)
    assert not in_selection({"model": {"name": "glm-large"}, "seed": 1}, both)  # the model the fit never sees
    assert not in_selection({"model": {"name": "glm-base"}, "seed": 2}, both)
    assert not in_selection({"seed": 1}, both)  # no model named: matches no list
    assert in_selection(glm, {"model.name": "glm-base"}) and not in_selection(glm, {"model.name": "llama-base"})


@pytest.mark.parametrize("pair, named", [("model.name=[glm-base", "'[glm-base'"), ("seed", "'seed'")])
def test_a_select_that_is_not_key_equals_value_exits_2_naming_it(tmp_path, capsys, pair, named):
    from bench.plan.calibrate import main

    assert main([str(tmp_path), "--select", pair, "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert named in out and "model.name=[glm-base,llama-base]" in out


def test_each_setting_keeps_its_own_fit_and_a_run_takes_only_its_own(tmp_path, monkeypatch) -> None:
    """One file, one fit per measurement setting: storing a fit replaces the stored fit of its setting and keeps
    the others; a run takes the fit of its own precision and mmap threshold (the narrowest where two hold it),
    and none where no fit was measured under them."""
    from bench.plan.calibration import MeasurementSetting

    monkeypatch.setattr(calibration, "path_for", lambda package: str(tmp_path / f"{package}.json"))
    pooled = Calibration("trlx", "cpu", {"sft/training/full": 100.0}, MeasurementSetting(None, ("bf16", "fp32")))
    fp32 = Calibration("trlx", "cpu", {"sft/training/full": 30.0}, MeasurementSetting(131072, ("fp32",)))
    calibration.save(fp32, "trlx")
    calibration.save(pooled, "trlx")
    assert calibration.load_all("trlx") == [pooled, fp32]  # glibc's own threshold first
    assert calibration.for_run("trlx", "cpu", "fp32", 131072) == fp32
    assert calibration.for_run("trlx", "cpu", "fp32", None) == pooled
    assert calibration.for_run("trlx", "cpu", "bf16", 131072) is None  # no bf16 fit at 128 KiB
    assert calibration.for_run("trlx", "cpu", "fp16", None) is None
    assert calibration.for_run("trlx", "cuda", "fp32", 131072) is None
    refit = Calibration("trlx", "cpu", {"sft/training/full": 40.0}, MeasurementSetting(131072, ("fp32",)))
    calibration.save(refit, "trlx")  # the same setting: replaced, the pool kept
    assert calibration.load_all("trlx") == [pooled, refit]
    narrow = Calibration("trlx", "cpu", {"sft/training/full": 70.0}, MeasurementSetting(None, ("fp32",)))
    calibration.save(narrow, "trlx")
    assert calibration.for_run("trlx", "cpu", "fp32", None) == narrow
    assert calibration.for_run("trlx", "cpu", "bf16", None) == pooled
    with pytest.raises(ValueError, match="setting"):
        calibration.save(Calibration("trlx", "cpu", {}), "trlx")


def test_a_prediction_takes_the_fit_of_its_run_s_setting_and_says_which(tmp_path, monkeypatch) -> None:
    """A run's recorded prediction: 200 MiB of DS-Chat's SFT training offset at 128 KiB in fp32 (100 per 16 bits,
    doubled), none in bf16 at 128 KiB, and the calibration named in words either way."""
    from bench.plan.calibration import MeasurementSetting
    from bench.plan.predict import record_entry
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    monkeypatch.setattr(calibration, "path_for", lambda package: str(tmp_path / f"{package}.json"))
    calibration.save(Calibration("dschat", "cpu", {"sft/training/full": 100 * MiB, "sft/init/full": 10 * MiB},
                                 MeasurementSetting(131072, ("fp32",)), fitted_on={"runs": 7, "source": "rung",
                                                                                   "selection": {"seed": 1}}),
                     "dschat")
    base = ["framework=dschat", "stage=sft", "zero=2", "memory_mmap_threshold=131072"]
    memory = {"phases": {"training": {"growth_over_baseline_bytes": 10**9}}}
    fp32 = record_entry(spec_from_config(compose([*base, "precision=fp32"])), "sft", "cpu", memory)
    assert fp32["phases"]["training"]["calibration_bytes"] == 200 * MiB
    assert fp32["calibration"] == ("the fit for fp32 at memory_mmap_threshold=131072 on cpu: 7 runs of rung "
                                   "where {'seed': 1}")
    bf16 = record_entry(spec_from_config(compose([*base, "precision=bf16"])), "sft", "cpu", memory)
    assert bf16["phases"]["training"]["calibration_bytes"] == 0
    assert bf16["calibration"] == ("none: no dschat calibration on cpu for bf16 at memory_mmap_threshold=131072 "
                                   "(physics alone)")


def test_the_report_splits_a_framework_s_runs_by_the_fit_of_their_setting(tmp_path, monkeypatch) -> None:
    """Three DS-Chat runs of three settings, two of them fitted: the accuracy table names each fit's rows by
    its setting, and the run of the third setting stands under "no calibration" with its physics alone."""
    from report_records import record

    from bench.plan.calibration import MeasurementSetting
    from bench.report.prediction import prediction_table
    from bench.run.config import compose

    monkeypatch.setattr(calibration, "path_for", lambda package: str(tmp_path / f"{package}.json"))
    for setting in (MeasurementSetting(None, ("bf16",)), MeasurementSetting(131072, ("fp32",))):
        calibration.save(Calibration("dschat", "cpu", {"sft/training/full": 1.0}, setting,
                                     fitted_on={"runs": 1, "source": "s", "selection": {}}), "dschat")
    runs = {name: record(compose(["framework=dschat", "stage=sft", f"precision={precision}",
                                  f"memory_mmap_threshold={threshold}"]), run_id=name)
            for name, precision, threshold in (("a", "bf16", "null"), ("b", "fp32", 131072), ("c", "bf16", 131072))}
    accuracy = prediction_table(runs)[0]
    labels = {(row[0], row[1], row[2]) for row in accuracy.rows}
    fitted = ("dschat (bf16 at glibc's own mmap threshold)", "dschat (fp32 at memory_mmap_threshold=131072)")
    assert labels == {(name, split, "2") for name in fitted for split in ("fitted", LEAVE_ONE_OUT)} \
        | {("dschat (no fit)", "no calibration", "2")}  # init and training of each run
    unfitted = next(row for row in accuracy.rows if row[0] == "dschat (no fit)")
    assert unfitted[3] == unfitted[4]  # MAE calibrated is the physics' own
    assert "dschat, fp32 at memory_mmap_threshold=131072: s" in accuracy.caption
