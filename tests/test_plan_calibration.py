"""The memory model's calibration: medians per regime at 16-bit width, scaled by a run's width, fallbacks.

Values worked by hand in each test."""

from __future__ import annotations

import pytest

from bench.plan import calibration
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
