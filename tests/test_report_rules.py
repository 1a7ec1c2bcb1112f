"""The report's strictness rules, each on hand-made records whose numbers are chosen to trip it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.report import claims, decision, differences, plots, tables, yardstick
from bench.report.claims import CONTRADICTED, NOT_MEASURED, PARTLY, SUPPORTED, TIE
from bench.report.decision import Leaf
from bench.results.collect import collect
from tests.report_records import MIB, config, record, write

ROOT = Path(__file__).resolve().parents[1]


def _collect(tmp_path, runs: dict[str, dict]) -> object:
    for name, data in runs.items():
        write(str(tmp_path), name, data)
    return collect(str(tmp_path))


def _verdict(collection, claim_id: str) -> tuple[str, str]:
    verdicts = {v.claim_id: v for v in claims.check_all(collection.rows, collection.records, collection.cells)}
    return verdicts[claim_id].verdict, verdicts[claim_id].evidence


def _leaves(collection, **kwargs) -> dict[tuple, Leaf]:
    return {path: found for path, found in decision.questions(decision.build(collection.rows, **kwargs))}


# --- pooling: a cell is the whole configuration minus seed and bookkeeping -------------------------------------

def test_runs_that_differ_in_a_non_column_key_are_separate_cells_and_the_table_names_the_key(tmp_path):
    c = _collect(tmp_path, {
        "a": record(config(seed=1), run_id="a", growth_mib=1000),
        "b": record(config(seed=2, sweep_name="other", run_name="x"), run_id="b", growth_mib=1010),
        "c": record(config(lr=1e-3), run_id="c", growth_mib=3000),
        "d": record(config(**{"framework.optimizer": "torch_adamw"}), run_id="d", growth_mib=2000),
    })
    cells = {r["run"]: r["cell"] for r in c.rows}
    assert cells["a"] == cells["b"]  # seed and bookkeeping only: repeats
    assert len({cells["a"], cells["c"], cells["d"]}) == 3
    table = tables.memory_table(c.rows, c.cells)
    assert table.header[:2] == ["configuration", "peak MiB"]  # the label, then the measured figures
    label = table.header.index("configuration")
    shown = sorted(row[label] for row in table.rows)
    # the keys every row shares are in the caption; a key unset in a row is left out of its label
    assert shown == ["framework.optimizer=fused_adam", "framework.optimizer=fused_adam lr=0.001",
                     "framework.optimizer=torch_adamw"]
    assert table.caption.startswith("Every row: framework=dschat, stage=ppo, model=glm-base, precision=bf16, zero=2")
    runs = {row[label]: row[table.header.index("runs")] for row in table.rows}
    assert runs["framework.optimizer=fused_adam"] == "2"


def test_lengths_steps_and_device_split_cells(tmp_path):
    gpu = record(config(), run_id="g")
    gpu["environment"]["device"] = "cuda"
    c = _collect(tmp_path, {"a": record(config(), run_id="a"), "l": record(config(prompt_len=64), run_id="l"),
                            "s": record(config(steps=12), run_id="s"), "g": gpu})
    assert len({r["cell"] for r in c.rows}) == 4


def test_a_record_from_before_a_knob_existed_pools_with_runs_at_the_knobs_default(tmp_path):
    def knobs(leak: float) -> dict:
        return {"soak": False, "memory_budget_gb": None, "debug": {"leak_mib_per_step": leak, "leak_phase": "training"}}

    newer, leaking = config(seed=2, **knobs(0)), config(seed=3, **knobs(1))
    c = _collect(tmp_path, {"old": record(config(seed=1), run_id="old"), "new": record(newer, run_id="new"),
                            "leak": record(leaking, run_id="leak")})
    cells = {r["run"]: r["cell"] for r in c.rows}
    assert cells["old"] == cells["new"] != cells["leak"]


def test_a_record_from_before_the_release_schedule_counts_as_released_every_run(tmp_path):
    every, scheduled = config(seed=2, memory_release_every=1), config(seed=3, memory_release_every=None)
    c = _collect(tmp_path, {"old": record(config(seed=1), run_id="old"), "every": record(every, run_id="every"),
                            "scheduled": record(scheduled, run_id="scheduled")})
    cells = {r["run"]: r["cell"] for r in c.rows}
    assert cells["old"] == cells["every"] != cells["scheduled"]


# --- forced failures are never evidence -------------------------------------------------------------------------

def test_a_forced_divergence_is_no_evidence_for_a_claim_but_shows_in_the_stability_table(tmp_path):
    forced = config(**{"framework.name": "trlx", "precision": "fp16", "lr": 1000.0, "tags": ["forced-failure"]})
    c = _collect(tmp_path, {"f": record(forced, run_id="f", status="nan", stability="diverged")})
    assert _verdict(c, "A10")[0] == NOT_MEASURED  # old behaviour: "supported" from a run broken on purpose
    table = tables.stability_table(c.rows, c.cells)
    assert table.rows[0][table.header.index("evidence")] == "no (forced failure)"
    assert "tags=forced-failure" in table.caption  # the one row's tag, shared by every row, is stated once


def test_stability_is_grouped_by_stage_and_configuration(tmp_path):
    c = _collect(tmp_path, {
        "a": record(config(precision="fp16"), run_id="a", stability="stable"),
        "b": record(config(precision="fp16", lr=1.0), run_id="b", stability="diverged"),
        "s": record(config(precision="fp16", **{"stage.name": "sft", "stage.stages": ["sft"]}), run_id="s"),
    })
    table = tables.stability_table(c.rows, c.cells)
    assert len(table.rows) == 3  # old behaviour: one row for (fp16, dschat)


def test_loss_curves_leave_out_forced_failures(tmp_path):
    sft = {"stage.name": "sft", "stage.stages": ["sft"]}
    c = _collect(tmp_path, {"f": record(config(tags=["forced-failure"], **sft), run_id="f"),
                            "a": record(config(**sft), run_id="a"), "b": record(config(seed=2, **sft), run_id="b")})
    panels = plots._curves(c.rows, c.records, c.cells, ("sft", "rm"), "loss_curve", "loss")
    # one panel, one cell (the forced failure's tag makes it a cell of its own, left out), two runs' curves
    assert list(panels) == ["dschat sft loss"] and [len(v) for v in panels["dschat sft loss"].values()] == [2]


# --- claims compare matched pairs only; a tie supports nothing ----------------------------------------------------

def test_memory_order_uses_only_cells_that_differ_in_the_framework(tmp_path):
    c = _collect(tmp_path, {
        "d": record(config(batch=2), run_id="d", growth_mib=1000),
        "t": record(config(batch=8, **{"framework.name": "trlx"}), run_id="t", growth_mib=3000),
    })
    verdict, evidence = _verdict(c, "A3")
    assert verdict == NOT_MEASURED, evidence  # old behaviour: compared batch 2 with batch 8


def _three_seeds(growths: dict[str, float]) -> dict[str, dict]:
    """PPO runs of each framework at seeds 1-3 growing its MiB + 10 x the seed."""
    return {f"{framework}{seed}": record(config(seed=seed, **{"framework.name": framework}),
                                         run_id=f"{framework}{seed}", growth_mib=growth + 10 * seed)
            for framework, growth in growths.items() for seed in (1, 2, 3)}


def test_memory_order_verdict_shows_its_pairs(tmp_path):
    runs = _three_seeds({"trlx": 3000, "colossalai": 2000, "dschat": 1000})
    verdict, evidence = _verdict(_collect(tmp_path, runs), "A3")
    assert verdict == SUPPORTED
    assert "[stage=ppo model=glm-base precision=bf16 zero=2 lora=0 batch=2 nproc=2]" in evidence
    assert "trlx > colossalai > dschat" in evidence


def test_overlapping_memory_is_a_tie_not_an_order(tmp_path):
    runs = {}
    for framework, growths in (("trlx", (1000, 1100, 1200)), ("dschat", (1050, 1150, 1250))):
        for seed, growth in enumerate(growths):
            runs[f"{framework}{seed}"] = record(config(seed=seed, **{"framework.name": framework}),
                                                run_id=f"{framework}{seed}", growth_mib=growth)
    verdict, evidence = _verdict(_collect(tmp_path, runs), "A3")
    assert verdict == TIE and "dschat=trlx" in evidence


def test_equal_stability_never_makes_trlx_best(tmp_path):
    runs = {f"{f}{seed}": record(config(seed=seed, **{"framework.name": f}), run_id=f"{f}{seed}")
            for f in ("trlx", "dschat") for seed in range(3)}
    verdict, evidence = _verdict(_collect(tmp_path, runs), "A5")
    assert "trlx bf16 (best)" in evidence and "-> not supported (tie)" in evidence
    assert verdict != SUPPORTED  # old behaviour: 0 % <= 0 % counted as "trlx best"


def test_a_stability_share_of_one_run_decides_nothing(tmp_path):
    c = _collect(tmp_path, {"t": record(config(**{"framework.name": "trlx"}), run_id="t"),
                            "d": record(config(), run_id="d", stability="diverged")})
    verdict, evidence = _verdict(c, "A5")
    assert "trlx bf16 (best)" in evidence and f"-> {claims.UNDECIDED}" in evidence
    assert verdict == claims.UNDECIDED  # old behaviour: 0 % against 100 % of one run read "supported"


def test_a_memory_order_with_one_pair_held_and_one_reversed_is_partly_supported(tmp_path):
    """Claimed trlx > colossalai > dschat; measured trlx = dschat (overlapping) > colossalai: trlx above
    colossalai holds, trlx against dschat is a tie, colossalai above dschat is reversed."""
    runs = _three_seeds({"trlx": 3000, "dschat": 3005, "colossalai": 1000})
    verdict, evidence = _verdict(_collect(tmp_path, runs), "A3")
    assert verdict == PARTLY, evidence
    assert ("trlx > colossalai holds, trlx > dschat tied, colossalai > dschat reversed" in evidence), evidence


def test_zero3_claim_compares_one_configuration(tmp_path):
    runs = {}
    for seed in range(3):
        runs[f"2-{seed}"] = record(config(zero=2, seed=seed), run_id=f"2-{seed}", growth_mib=1000 + seed)
        runs[f"3-{seed}"] = record(config(zero=3, seed=seed), run_id=f"3-{seed}", growth_mib=500 + seed)
    verdict, evidence = _verdict(_collect(tmp_path, runs), "A7")
    # medians (400+501) / (400+1001) MiB: ZeRO-3 below beyond the spread
    assert verdict == CONTRADICTED and "ZeRO-3 / ZeRO-2 peak = 0.643" in evidence, evidence


@pytest.mark.parametrize("zero3_growth, verdict, said", [
    # ZeRO-2 peaks 1,400-1,420 MiB (baseline 400): ZeRO-3 at 1,640-1,650 gives 1.155-1.179 at the extremes
    ((1240, 1245, 1250), SUPPORTED, "(seed extremes 1.155-1.179) against the claimed 1.15-1.20 (direction and size "
                                    "supported"),
    # ZeRO-3 at 1,620-1,690: the median ratio 1.172 is inside, the extremes 1.141-1.207 straddle both bounds
    ((1220, 1252, 1290), PARTLY, "direction supported, size not decided"),
    # ZeRO-3 at 1,800-1,810: above the claim at every extreme
    ((1400, 1405, 1410), PARTLY, "direction supported, size outside the claim"),
])
def test_zero3_s_size_is_judged_at_the_seeds_extremes(tmp_path, zero3_growth, verdict, said):
    runs = {}
    for seed in range(3):
        runs[f"2-{seed}"] = record(config(zero=2, seed=seed), run_id=f"2-{seed}", growth_mib=1000 + 10 * seed)
        runs[f"3-{seed}"] = record(config(zero=3, seed=seed), run_id=f"3-{seed}", growth_mib=zero3_growth[seed])
    found, evidence = _verdict(_collect(tmp_path, runs), "A7")
    assert found == verdict and said in evidence, evidence


def test_a_single_run_a_side_decides_no_claim(tmp_path):
    c = _collect(tmp_path, {"2": record(config(zero=2), run_id="2", growth_mib=1000),
                            "3": record(config(zero=3), run_id="3", growth_mib=500)})
    verdict, evidence = _verdict(c, "A7")
    assert verdict == claims.UNDECIDED and "(n=1)" in evidence


# --- the decision tree: repeats, intervals, per GPU, partial freezing -------------------------------------------

def _two_frameworks(tmp_path, dschat_times: list[float], colossalai_times: list[float],
                    step_spread: float | None = None):
    runs = {}
    for framework, times in (("dschat", dschat_times), ("colossalai", colossalai_times)):
        for seed, t in enumerate(times):
            runs[f"{framework}{seed}"] = record(config(seed=seed, **{"framework.name": framework}),
                                                run_id=f"{framework}{seed}", step_s=t,
                                                step_times=[t * (1 - step_spread), t, t * (1 + step_spread)]
                                                if step_spread else None)
    return _collect(tmp_path, runs)


FULL = ("glm-base", "2", "bf16", "full fine-tuning")


def test_a_single_run_per_cell_cannot_name_a_framework(tmp_path):
    leaf = _leaves(_two_frameworks(tmp_path, [5.0], [10.0]))[FULL]
    assert not leaf.decided and leaf.verdict.startswith("cannot call")  # old behaviour: named dschat


def test_three_repeats_and_a_clear_lead_name_the_framework(tmp_path):
    leaf = _leaves(_two_frameworks(tmp_path, [5.0, 5.1, 5.2], [10.0, 10.1, 10.2]))[FULL]
    assert leaf.decided and leaf.verdict.startswith("dschat"), leaf.verdict
    # batch 2 x 2 ranks / 5.1 s / 2 ranks, the median of three repeats
    assert any("measured 0.392 samples/s per rank, range [0.385, 0.400] over 3 repeats" in e for e in leaf.evidence)


def test_overlapping_repeats_are_too_close_to_call(tmp_path):
    leaf = _leaves(_two_frameworks(tmp_path, [5.0, 5.2, 9.0], [6.0, 6.1, 8.0]))[FULL]
    assert not leaf.decided and leaf.verdict.startswith("too close to call")


def test_a_faster_cell_without_repeats_is_named_beside_the_repeated_candidate_not_in_its_place(tmp_path):
    runs = {}
    for seed in range(3):  # both at ZeRO-2 with 3 repeats: dschat 5 s a step, colossalai 10 s
        for framework, step_s in (("dschat", 5.0), ("colossalai", 10.0)):
            runs[f"{framework}{seed}"] = record(config(seed=seed, **{"framework.name": framework}),
                                                run_id=f"{framework}{seed}", step_s=step_s)
    # one colossalai run at ZeRO-0, 2 s a step: the fastest cell, but a single run
    runs["colossalai-z0"] = record(config(zero=0, **{"framework.name": "colossalai"}), run_id="z0", step_s=2.0)
    leaf = _leaves(_collect(tmp_path, runs))[FULL]
    assert leaf.decided and leaf.verdict.startswith("dschat"), leaf.verdict  # 0.400 against 0.200 samples/s
    assert any(e.startswith("colossalai: fastest fitting config zero=2") for e in leaf.evidence), leaf.evidence
    # batch 2 x 2 ranks / 2 s / 2 ranks = 1.000 samples/s per rank
    assert any(e.startswith("colossalai: faster but unrepeated, not a candidate: zero=0") and "1.000" in e
               and "(n=1 < 3)" in e for e in leaf.evidence), leaf.evidence


def test_runs_refused_as_unsupported_are_not_counted_as_runs_that_did_not_fit(tmp_path):
    runs = {}
    for seed in range(3):
        for framework, step_s in (("dschat", 5.0), ("colossalai", 10.0)):
            runs[f"{framework}{seed}"] = record(config(seed=seed, **{"framework.name": framework}),
                                                run_id=f"{framework}{seed}", step_s=step_s + 0.1 * seed)
    runs["colossalai-z3"] = record(config(zero=3, **{"framework.name": "colossalai"}), run_id="z3",
                                   status="unsupported")
    leaf = _leaves(_collect(tmp_path, runs))[FULL]
    said = next(e for e in leaf.evidence if e.startswith("colossalai: fastest fitting config"))
    assert said.endswith("(3 of 3 runs fit and stayed stable; 1 more refused as unsupported)"), said


def test_one_run_with_steady_steps_is_not_a_repeat(tmp_path):
    leaf = _leaves(_two_frameworks(tmp_path, [5.0], [10.0], step_spread=0.02))[FULL]
    assert not leaf.decided and "without 3 repeats" in leaf.verdict  # old behaviour: 3 timed steps decided


def test_one_run_whose_steps_spread_into_the_other_cannot_decide(tmp_path):
    leaf = _leaves(_two_frameworks(tmp_path, [5.0], [6.0], step_spread=0.3))[FULL]
    assert not leaf.decided


def test_the_plain_pytorch_reference_is_the_yardstick_never_the_verdict(tmp_path):
    runs = {}
    for seed in range(3):
        for framework, step_s in (("torch", 2.0), ("dschat", 5.0), ("colossalai", 10.0)):
            runs[f"{framework}{seed}"] = record(config(seed=seed, **{"framework.name": framework}),
                                                run_id=f"{framework}{seed}", step_s=step_s + 0.1 * seed)
    leaf = _leaves(_collect(tmp_path, runs))[FULL]
    assert leaf.decided and leaf.verdict.startswith("dschat"), leaf.verdict  # torch is 2.5x faster
    assert leaf.evidence[0].startswith("yardstick (torch, plain PyTorch; never a verdict)"), leaf.evidence


def test_frameworks_are_divided_by_the_reference_run_of_the_same_seed(tmp_path):
    runs = {}
    for seed, dschat_s in enumerate((4.0, 4.4, 5.0)):
        runs[f"torch{seed}"] = record(config(seed=seed, **{"framework.name": "torch"}), run_id=f"torch{seed}",
                                      step_s=2.0, growth_mib=1000)
        runs[f"dschat{seed}"] = record(config(seed=seed), run_id=f"dschat{seed}", step_s=dschat_s, growth_mib=1500)
    c = _collect(tmp_path, runs)
    (table,) = yardstick.yardstick_tables(c.rows, c.cells)
    by_phase = {row[3]: row[4:] for row in table.rows}
    # step time 4.0/2, 4.4/2, 5.0/2; tokens/s the inverse; growth 1500/1000 in training and in init
    assert by_phase["training"] == ["2.20 [2.00, 2.50]", "0.45 [0.40, 0.50]", "1.50 [1.50, 1.50]", "3"]
    assert by_phase["init"] == ["-", "-", "1.50 [1.50, 1.50]", "3"]
    assert yardstick.yardstick_tables([r for r in c.rows if r["framework"] != "torch"], c.cells) == []


def test_partial_freezing_is_not_full_fine_tuning(tmp_path):
    runs = {}
    for seed in range(3):
        runs[f"t{seed}"] = record(config(seed=seed, **{"framework.name": "trlx"}), run_id=f"t{seed}", step_s=1.0,
                                  trainable=30, total=100)
        runs[f"d{seed}"] = record(config(seed=seed), run_id=f"d{seed}", step_s=10.0)
    leaves = _leaves(_collect(tmp_path, runs))
    assert leaves[FULL].verdict.startswith("only dschat runs this mode")  # old: trlx, 10x faster by training 30 %
    partial = leaves[("glm-base", "2", "bf16", "partial freezing (only some blocks train, e.g. trlx's hydra policy)")]
    assert partial.verdict.startswith("only trlx runs this mode") and not partial.decided  # no winner of one


def test_runs_on_different_rank_counts_are_compared_per_gpu_in_separate_branches(tmp_path):
    runs = {}
    for seed in range(3):
        runs[f"one{seed}"] = record(config(seed=seed, **{"launcher.nproc": 1}), run_id=f"one{seed}", step_s=10.0)
        runs[f"two{seed}"] = record(config(seed=seed), run_id=f"two{seed}", step_s=10.0)
    leaves = _leaves(_collect(tmp_path, runs))
    assert ("glm-base", "1", "bf16", "full fine-tuning") in leaves and FULL in leaves
    speeds = {r["nproc"]: decision.speed(r) for r in collect(str(tmp_path)).rows}
    assert speeds == {1: pytest.approx(0.2), 2: pytest.approx(0.2)}  # batch 2 x ranks / 10 s / ranks


# --- dedupe and folder names ------------------------------------------------------------------------------------------

def test_a_run_collected_twice_counts_once_and_a_sweep_named_report_is_read(tmp_path):
    data = record(config(), run_id="a")
    write(str(tmp_path / "sweeps" / "report"), "a", data)
    shutil.copytree(tmp_path / "sweeps", tmp_path / "examples")
    c = collect(str(tmp_path))
    assert len(c.records) == 1 and len(c.rows) == 1  # old behaviour: no run (path had /report/) ...
    assert len(c.duplicates) == 1
    write(str(tmp_path / "examples"), "b", record(config(), run_id="a", created="2026-12-02T00:00:00Z"))
    assert len(collect(str(tmp_path)).records) == 2  # same id, another run: both count


def test_a_folder_named_like_a_hydra_override_with_brackets_is_read_literally(tmp_path):
    root = tmp_path / "tags=[forced-failure]"  # a glob pattern would read [...] as a character class
    write(str(root), "a", record(config(), run_id="a"))
    assert len(collect(str(root)).records) == 1


# --- where memory differs ---------------------------------------------------------------------------------------------

def test_a_memory_difference_beyond_the_spread_names_its_phase_and_term(tmp_path):
    runs = {}
    for seed in range(3):
        runs[f"d{seed}"] = record(config(seed=seed), run_id=f"d{seed}", growth_mib=1000 + seed, rest_mib=400)
        runs[f"c{seed}"] = record(config(seed=seed, **{"framework.name": "colossalai"}), run_id=f"c{seed}",
                                  growth_mib=1600 + seed, rest_mib=1000)
    c = _collect(tmp_path, runs)
    table = differences.differences_table(c.rows, c.cells)
    assert table.rows[0][2:] == ["colossalai (full) vs dschat (full)",
                                 "1,601 [1,600, 1,602] CI±2 (n=3) vs 1,001 [1,000, 1,002] CI±2 (n=3)",
                                 "colossalai +600 MiB in training", "rest", "+600 MiB"]


def test_the_breakdown_keeps_process_start_and_engine_runtime_apart(tmp_path):
    # record(): process start 300 MiB, runtime 100 MiB, growth 1000 = rest 400 + state 600 (a quarter parameters)
    c = _collect(tmp_path, {"d": record(config(), run_id="d", growth_mib=1000, rest_mib=400)})
    terms = {t: c.rows[0][f"{t}_training_bytes"] / MIB
             for t in ("process_start", "runtime", "params", "optimizer", "reward_fn", "rest")}
    assert terms == {"process_start": 300, "runtime": 100, "params": 150, "optimizer": 450, "reward_fn": 0,
                     "rest": 400}


def test_the_caveat_states_scale_machine_and_repeats(tmp_path):
    c = _two_frameworks(tmp_path, [5.0, 5.0], [6.0])
    text = claims.caveat(c.rows, c.records)
    assert "3 finished runs in 2 cells" in text and "repeats per cell 1-2" in text and "glm-base" in text


def test_side_by_side_figures_take_one_configuration_that_differs_only_in_the_framework(tmp_path):
    c = _collect(tmp_path, {"d": record(config(), run_id="d"), "dl": record(config(lr=1e-3), run_id="dl"),
                            "c": record(config(**{"framework.name": "colossalai"}), run_id="c")})
    _, chosen = plots._shared_configuration(c.rows, c.cells)
    assert sorted(r["run"] for r in chosen) == ["c", "d"]  # the lr=1e-3 run shares the main columns only


# --- soak runs ---------------------------------------------------------------------------------------------------

def test_soak_runs_get_a_verdict_table_and_a_trend_figure(tmp_path):
    from bench.measure.trend import MIB as T_MIB
    from bench.measure.trend import soak_trends
    from bench.report import soak

    leaky = record(config(soak=True), run_id="leaky")
    timeline = [{"phase": phase, "step": step, "peak_bytes": 500 * T_MIB + step * T_MIB,
                 "retained_bytes": T_MIB if phase == "experience" else 0}
                for step in range(30) for phase in ("generation", "experience")]
    leaky["stages"]["ppo"]["memory"]["timeline"] = timeline
    leaky["stages"]["ppo"]["memory"]["trend"] = soak_trends(timeline, [], 2, 30, 1000 * T_MIB, "test budget")
    c = _collect(tmp_path / "records", {"leaky": leaky, "plain": record(config(), run_id="plain")})
    (table,) = soak.soak_table(c.rows, c.records)
    column = {name: i for i, name in enumerate(table.header)}
    rows = {row[column["phase"]]: row for row in table.rows}
    assert set(rows) == {"generation", "experience"}  # the plain run is no soak run: no rows
    experience = rows["experience"]
    assert experience[column["verdict"]] == "growing"
    assert experience[column["MiB / 100 steps"]] == "+100.0"
    assert experience[column["grows in"]] == "experience"
    assert experience[column["budget crossed at step"]] == "501"  # 500 + step MiB passes 1000 MiB after 500
    assert "1.0 GiB (test budget)" in table.caption
    (figure,) = soak.soak_figure(c.rows, c.records, str(tmp_path / "plots"))
    assert figure.path.endswith("soak_memory.png") and "least-squares" in figure.caption
    assert soak.soak_table([r for r in c.rows if r["run"] == "plain"], c.records) == []


# --- checkpoint stalls -----------------------------------------------------------------------------------------

def test_checkpoint_stalls_compare_sync_and_async_per_cell(tmp_path):
    from bench.report.checkpoints import checkpoint_table

    def saving(mode: str, stalls: list[float], run_id: str, seed: int) -> dict:
        data = record(config(seed=seed, checkpoint={"every": 2, "async": mode == "async"}), run_id=run_id,
                      step_s=10.0)
        data["stages"]["ppo"]["checkpoints"] = {"saves": [
            {"steps_done": 2 * (i + 1), "mode": mode, "stall_s": stall, "bytes_written": 64 * MIB,
             **({"background_write_s": 3.0} if mode == "async" else {})} for i, stall in enumerate(stalls)]}
        return data

    c = _collect(tmp_path, {"s1": saving("sync", [4.0, 6.0, 5.0], "s1", 1), "s2": saving("sync", [7.0], "s2", 2),
                            "a1": saving("async", [0.5, 0.7, 0.6], "a1", 1), "plain": record(config(), run_id="plain")})
    (table,) = checkpoint_table(c.rows, c.cells)
    column = {name: i for i, name in enumerate(table.header)}
    rows = {row[column["mode"]]: row for row in table.rows}
    assert set(rows) == {"sync", "async"}  # the run without checkpoints is no row
    # sync: run medians 5.0 and 7.0 -> median 6.0 +-1.0; stall over a 10 s step: 60 % +-10
    # two runs whose saves stall 5 and 7 s: sd 1.414, 95 % CI of the mean 12.706 x 1.414 / sqrt 2 = 12.706
    assert rows["sync"][column["stall s per save"]] == "6.000 [5.000, 7.000] CI±12.706 (n=2)"
    assert rows["sync"][column["stall / step %"]] == "60.0 [50.0, 70.0] CI±127.1 (n=2)"
    assert rows["sync"][column["saves"]] == "4" and rows["sync"][column["background write s per save"]] == "-"
    assert rows["async"][column["stall s per save"]] == "0.600"
    assert rows["async"][column["background write s per save"]] == "3.000"
    assert rows["async"][column["MiB per checkpoint"]] == "64.0"


def _convergence_runs(tmp_path, steps: dict[str, list[int | None]]):
    runs = {}
    for mode, converged in steps.items():
        for seed, step in enumerate(converged):
            data = record(config(seed=seed, **{"reward": {"normalize": mode}}), run_id=f"{mode}{seed}",
                          step_times=[1.0] * 120)
            data["stages"]["ppo"]["learning"].update(converged_step=step, preferred_fraction_end=0.8)
            runs[f"{mode}{seed}"] = data
    return _collect(tmp_path, runs)


@pytest.mark.parametrize("zscore, none, verdict", [
    ([30, 35, 40], [70, 80, 90], SUPPORTED),  # median 35 vs 80: 56 % fewer steps, ranges apart
    ([50, 55, 60], [70, 80, 90], PARTLY),  # 31 % fewer: faster beyond the spread, short of 40 %
    ([30, 60, 75], [70, 80, 90], TIE),  # ranges touch: a tie (old behaviour: contradicted)
    ([95, 100, 110], [70, 80, 90], CONTRADICTED),  # slower beyond the spread
    ([30, 35, 40], [70, None, None], SUPPORTED),  # none never rose twice: 120 (its whole length), median 120
])
def test_zscore_convergence_claim_reads_medians_over_three_seeds(tmp_path, zscore, none, verdict):
    got, evidence = _verdict(_convergence_runs(tmp_path, {"zscore": zscore, "none": none}), "A13")
    assert got == verdict, evidence
    assert "steps to 90 % of the preferred-share rise" in evidence


def test_zscore_convergence_needs_three_seeds_a_cell(tmp_path):
    got, evidence = _verdict(_convergence_runs(tmp_path, {"zscore": [30, 35], "none": [70, 80]}), "A13")
    assert got == NOT_MEASURED and "3+ seeds" in evidence


@pytest.mark.parametrize("times_5e8, times_5e7, verdict", [
    ([8.0, 8.2, 8.4], [10.0, 10.1, 10.3], SUPPORTED),  # lower beyond the spread
    ([8.0, 9.0, 10.0], [9.5, 10.1, 10.3], TIE),  # ranges touch: a tie (old behaviour: contradicted)
    ([11.0, 11.2, 11.4], [9.5, 10.1, 10.3], CONTRADICTED),  # slower beyond the spread
    ([8.0, 8.2], [10.0, 10.1], claims.UNDECIDED),  # two repeats a side
])
def test_allgather_bucket_claim_compares_training_steps(tmp_path, times_5e8, times_5e7, verdict):
    runs = {}
    for bucket, times in ((500_000_000, times_5e8), (50_000_000, times_5e7)):
        for seed, t in enumerate(times):
            name = f"b{bucket}s{seed}"
            runs[name] = record(config(seed=seed, **{"ds": {"allgather_bucket_size": bucket}}), run_id=name, step_s=t)
    got, evidence = _verdict(_collect(tmp_path, runs), "A14")
    assert got == verdict, evidence
    assert "at 5e+07" in evidence


def test_trl_s_ppo_trains_policy_and_value_model_under_one_optimizer(tmp_path):
    """TRL's PPO steps one AdamW over policy and value model (PolicyAndValueWrapper); under DeepSpeed its record
    books the whole optimizer state to the actor. The row still counts both models as trained: glm-base's
    108,943,872 policy and 108,944,640 value-model parameters, 217,888,512 in all."""
    source = next(p for p in sorted((ROOT / "results" / "examples" / "glm-base").iterdir())
                  if "framework=trl," in p.name and "stage=ppo" in p.name and "zero=2" in p.name)
    shutil.copytree(source, tmp_path / source.name)
    row = next(r for r in collect(str(tmp_path)).rows if r["stage"] == "ppo")
    assert row["trained_params"] == row["trainable_params"] == 108_943_872 + 108_944_640


def _quantized(seed: int, library: str | None, experience_mib: float, peak_mib: float) -> dict:
    """A PPO record whose experience phase grows `experience_mib` and whose peak phase (training) `peak_mib`;
    `library` None: reference and reward unquantized, else both int8 through that library."""
    cfg = config(seed=seed)
    if library:
        cfg.update(reference={"quant": "int8"}, reward={"quant": "int8"}, quant_library=library)
    data = record(cfg, run_id=f"{library}{seed}", growth_mib=peak_mib)
    phases = data["stages"]["ppo"]["memory"]["phases"]
    phases["experience"] = dict(phases["training"], growth_over_baseline_bytes=int(experience_mib * MIB))
    return data


def test_int8_frozen_roles_need_repeats_and_a_lower_peak_not_only_a_lower_experience_phase(tmp_path):
    """torchao's experience growth (800-820 MiB) is below none's (1,000-1,020) beyond the spread, but its peak
    (1,490-1,530) overlaps none's (1,500-1,520): a tie for the memory half; bitsandbytes' single run decides
    nothing. Each quantized cell's evidence names its library once."""
    runs = {}
    for seed in range(3):
        runs[f"none{seed}"] = _quantized(seed, None, 1000 + 10 * seed, 1500 + 10 * seed)
        runs[f"torchao{seed}"] = _quantized(seed, "torchao", 800 + 10 * seed, 1490 + 20 * seed)
    runs["bnb"] = _quantized(0, "bitsandbytes", 700, 1300)
    verdict, evidence = _verdict(_collect(tmp_path, runs), "B10")
    assert verdict == TIE, evidence
    assert "ref int8, reward int8 (torchao) against none: experience growth lower; peak growth within the spread" \
        in evidence, evidence
    assert "ref int8, reward int8 (bitsandbytes) against none: not decided (n=1 against 3; 3 a side)" in evidence
    assert evidence.count("(torchao) against none") == 1


def test_every_claim_judged_against_a_card_uses_the_share_a_plan_may_fill():
    """A20's memory part and B2 both compare a bound with 90 % of the card as torch reports it (bench.plan.cluster's
    SAFETY): A20's PPO bound, 77.2 GiB, fits the A100-80GB's 79.14 GiB but not the 71.2 GiB a plan may fill."""
    verdict, evidence = claims._a20([], {}, {})
    assert "(90% of the A100-80GB's 79.14 GiB as torch reports it) (implausible as stated)" in evidence, evidence
    assert "(90% of the A100-40GB's" in claims._b2([], {}, {})[1]


def test_figures_say_where_lora_0_is_partial_freezing_and_where_seeds_had_their_own_reward_model():
    rows = [{"framework": "trlx", "lora": 0, "finetune": "partial", "stage": "ppo"},
            {"framework": "dschat", "lora": 0, "finetune": "full", "stage": "ppo"}]
    assert "trlx at 0: partial freezing" in plots._knob_label("lora", rows)
    assert plots._knob_label("lora", rows[1:]) == plots.KNOB_LABEL["lora"]
    assert plots._knob_label("zero", rows) == plots.KNOB_LABEL["zero"]
    # three seeds of one cell, each scored by its own prerequisite reward model (held-out accuracy 0.25/0.75/0.25)
    ppo = [{"run": f"r{seed}", "cell": "c", "stage": "ppo", "status": "ok", "tags": [], "framework": "dschat",
            "lora": 0} for seed in range(3)]
    records = {f"r{seed}": {"prerequisites": {"rm": {"checkpoint": f"rm-{seed}.pt", "accuracy_end": acc}}}
               for seed, acc in enumerate((0.25, 0.75, 0.25))}
    note = plots._reward_model_note(ppo, records)
    assert "In 1 of 1 PPO cells each run scored with its own prerequisite reward model" in note, note
    assert "0.25/0.75/0.25" in note
    shared = {run: {"prerequisites": {"rm": {"checkpoint": "rm.pt", "accuracy_end": 0.5}}} for run in records}
    assert plots._reward_model_note(ppo, shared) == ""


def test_the_claims_live_in_the_project_with_a_check_each_and_the_docs_page_lists_them(tmp_path):
    """conf/claims.yaml holds every claim the report states, each with its article and what that article
    published; every claim has a check and every check a claim; docs/published-claims.md shows the file as it is;
    a claim naming an article the file does not have is refused by name."""
    from bench.report import claims_data

    sources, stated = claims_data.load()
    assert {c.id for c in stated} == {claim_id for claim_id, _ in claims.CHECKS}
    assert {c.source for c in stated} == set(sources) == {"A", "B"}
    assert all(c.published and c.statement for c in stated)
    with open(ROOT / "docs" / "published-claims.md") as f:
        assert claims_data.markdown() in f.read(), "regenerate the page's tables from claims_data.markdown()"
    bad = tmp_path / "claims.yaml"
    bad.write_text("sources: {A: {title: t, kind: k, setting: s}}\n"
                   "claims: [{id: X1, source: C, statement: s, published: p}]\n")
    with pytest.raises(ValueError, match=r"unknown sources \['C'\]; allowed: \['A'\]"):
        claims_data.load(str(bad))
