"""Conclusions that hold: each rule of the report's verdicts, leaves and provenance on hand-made records whose
numbers are chosen so that the old behaviour and the rule disagree."""

from __future__ import annotations

import copy

import pytest

from bench.plan import claims_arithmetic as arithmetic
from bench.report import claims, decision
from bench.report.cells import rerun_command, split_overrides
from bench.report.environment import environment_tables
from bench.report.tables import memory_table
from bench.results.collect import collect
from tests.report_records import MIB, config, record, write

GIB = 2**30


def _collect(tmp_path, runs: dict[str, dict], allow_mixed: bool = False):
    for name, data in runs.items():
        write(str(tmp_path), name, data)
    return collect(str(tmp_path), allow_mixed=allow_mixed)


def _verdict(collection, claim_id: str) -> tuple[str, str]:
    found = {v.claim_id: v for v in claims.check_all(collection.rows, collection.records, collection.cells)}
    return found[claim_id].verdict, found[claim_id].evidence


def _leaves(collection, **kwargs):
    return dict(decision.questions(decision.build(collection.rows, **kwargs)))


def _zero_pair(zero2_mib: list[float], zero3_mib: list[float]) -> dict[str, dict]:
    runs = {}
    for zero, growths in ((2, zero2_mib), (3, zero3_mib)):
        for seed, growth in enumerate(growths):
            runs[f"z{zero}s{seed}"] = record(config(zero=zero, seed=seed), run_id=f"z{zero}s{seed}", growth_mib=growth)
    return runs


# --- verdicts: ties, ranges, repeats --------------------------------------------------------------------------------

@pytest.mark.parametrize("zero3, verdict, ratio", [
    # peaks are baseline 400 MiB + growth; medians 1,400 (ZeRO-2) against 400 + the middle ZeRO-3 growth
    ([1238, 1240, 1242], claims.SUPPORTED, "1.171 (seed extremes 1.166-1.177)"),  # 1,640 / 1,400: inside 1.15-1.20
    ([1068, 1070, 1072], claims.PARTLY, "1.050 (seed extremes 1.045-1.055)"),  # 1,470 / 1,400: more, below
    ([1480, 1500, 1520], claims.PARTLY, "1.357 (seed extremes 1.338-1.376)"),  # 1,900 / 1,400: above
    ([990, 1000, 1010], claims.TIE, "1.000 (seed extremes 0.989-1.011)"),  # ranges touch
    ([700, 702, 704], claims.CONTRADICTED, "0.787 (seed extremes 0.783-0.791)"),  # less
])
def test_a_range_claim_is_supported_only_inside_its_range(tmp_path, zero3, verdict, ratio):
    got, evidence = _verdict(_collect(tmp_path, _zero_pair([995, 1000, 1005], zero3)), "A7")
    assert got == verdict, evidence
    assert f"ZeRO-3 / ZeRO-2 peak = {ratio} against the claimed 1.15-1.20" in evidence
    assert "(n=3)" in evidence  # each verdict names its pairs' n


def test_overlapping_ranges_read_not_supported_tie_and_two_repeats_decide_nothing(tmp_path):
    got, _ = _verdict(_collect(tmp_path / "tie", _zero_pair([995, 1000, 1005], [1000, 1010, 1240])), "A7")
    assert got == "not supported (tie)"  # 1,405 is inside ZeRO-2's [1,395, 1,405]: the ranges touch
    got, evidence = _verdict(_collect(tmp_path / "two", _zero_pair([995, 1000], [1238, 1240])), "A7")
    assert got == claims.UNDECIDED and "(n=2)" in evidence  # apart, but 2 repeats a side


def test_a_published_gb_is_read_as_ten_to_the_nine_bytes():
    setting = arithmetic.Setting(arithmetic.SMALL_MODEL, "sft", gpus=8, zero=2, micro_batch=4, seq=512)
    bound = arithmetic.lower_bound(setting)
    between = (bound / 1e9 + bound / GIB) / 2  # below the bound as 10^9 bytes, above it as GiB
    verdict, evidence = arithmetic.memory_figures(setting, {"x": between})
    assert verdict == arithmetic.IMPLAUSIBLE, evidence
    assert f"{bound / 1e9:.1f} GB ({bound / GIB:.1f} GiB)" in evidence
    assert arithmetic.memory_figures(setting, {"x": bound / 1e9 * 1.001})[0] == arithmetic.CONSISTENT
    assert "10^9 bytes" in claims.UNITS


# --- peak, growth and peak phase from one phase set ------------------------------------------------------------------

def test_peak_growth_and_peak_phase_come_from_the_same_phases(tmp_path):
    data = record(config(), run_id="a", growth_mib=1000, rest_mib=900)  # training: +1,000; init: +100 (the state)
    phases = data["stages"]["ppo"]["memory"]["phases"]
    phases["init"].update(peak_bytes=400 * MIB + 3000 * MIB, growth_over_baseline_bytes=3000 * MIB,
                          peak_bytes_per_rank=[3400 * MIB] * 2)
    phases["imports"] = {"peak_bytes": 9000 * MIB, "growth_over_baseline_bytes": 8600 * MIB}  # the baseline's own
    (row,) = _collect(tmp_path, {"a": data}).rows
    # old behaviour: peak 3,400 from init beside growth 1,000 and peak phase "training"
    assert (row["peak_bytes"], row["growth_bytes"], row["peak_phase"]) == (3400 * MIB, 3000 * MIB, "init")


# --- provenance: flagged in tables, refused by verdicts and leaves ---------------------------------------------------

def _with_git(data: dict, commit: str, dirty: bool = False, diff: str | None = None, host: str = "cpu A x 2") -> dict:
    data["environment"].update(git={"commit": commit, "dirty": dirty, "diff_sha256": diff},
                               host={"type": host}, libraries={"torch": "2.13.0"})
    return data


def _framework_cells(tmp_path, dschat_commits: list[tuple[str, bool, str]], allow_mixed: bool = False):
    runs = {}
    for seed in range(3):
        runs[f"c{seed}"] = _with_git(record(config(seed=seed, **{"framework.name": "colossalai"}), run_id=f"c{seed}",
                                            growth_mib=2000 + seed, step_s=10.0 + 0.1 * seed), "a" * 40)
        commit, dirty, host = dschat_commits[seed]
        runs[f"d{seed}"] = _with_git(record(config(seed=seed), run_id=f"d{seed}", growth_mib=1000 + seed,
                                            step_s=5.0 + 0.1 * seed), commit, dirty, "f" * 64 if dirty else None, host)
    return _collect(tmp_path, runs, allow_mixed)


@pytest.mark.parametrize("commits, reason", [
    ([("a" * 40, False, "cpu A x 2"), ("b" * 40, False, "cpu A x 2"), ("a" * 40, False, "cpu A x 2")], "2 commits"),
    ([("a" * 40, False, "cpu A x 2"), ("a" * 40, True, "cpu A x 2"), ("a" * 40, False, "cpu A x 2")],
     "dirty and clean trees"),
    ([("a" * 40, False, "cpu A x 2"), ("a" * 40, False, "cpu B x 2"), ("a" * 40, False, "cpu A x 2")],
     "2 host types"),
])
def test_a_cell_of_mixed_provenance_is_flagged_and_refused(tmp_path, commits, reason):
    c = _framework_cells(tmp_path, commits)
    dschat = [r for r in c.rows if r["framework"] == "dschat"]
    assert {r["mixed"] for r in dschat} == {reason} and all(r["refused"] for r in dschat)
    table = memory_table(c.rows, c.cells)
    flags = {row[table.header.index("configuration")]: row[table.header.index("provenance")] for row in table.rows}
    assert flags == {"framework=dschat": f"mixed: {reason}", "framework=colossalai": "-"}
    verdict, evidence = _verdict(c, "A3")
    assert verdict == claims.NOT_MEASURED and "1 cell(s) of mixed provenance left out" in evidence
    leaf = _leaves(c)[("glm-base", "2", "bf16", "full fine-tuning")]
    # dschat's runs are all refused: it is not said to be unable to run the mode
    assert leaf.verdict.startswith("only colossalai's evidence is admissible (dschat: mixed provenance, left out)")
    assert any("3 run(s) left out: their cells mix provenance" in e for e in leaf.evidence)
    # asked for, the mixed cell counts (and the flag stays)
    allowed = _framework_cells(tmp_path / "allowed", commits, allow_mixed=True)
    assert _verdict(allowed, "A3")[0] == claims.SUPPORTED  # colossalai 2,001 > dschat 1,001: the claimed order
    assert _leaves(allowed)[("glm-base", "2", "bf16", "full fine-tuning")].verdict.startswith("dschat")


def test_clean_repeats_at_one_commit_are_not_flagged_and_the_environment_counts_them(tmp_path):
    c = _framework_cells(tmp_path, [("a" * 40, False, "cpu A x 2")] * 3)
    assert not any(r["mixed"] for r in c.rows)
    assert "provenance" not in memory_table(c.rows, c.cells).header
    (env,) = environment_tables(c)
    # these hand-made hosts name no matrix instructions, as records from before environment.host.matrix_isa
    assert ["code", "aaaaaaaaaa", "6"] in env.rows
    assert ["host", "cpu A x 2, matrix ISA not recorded; device cpu", "6"] in env.rows
    assert "1 code version(s) (0 run(s) from a dirty tree)" in env.caption


# --- the decision tree --------------------------------------------------------------------------------------------

def _three(framework: str, step_s: float, **changes) -> dict[str, dict]:
    return {f"{framework}{seed}": record(config(seed=seed, **{"framework.name": framework, **changes}),
                                         run_id=f"{framework}{seed}", step_s=step_s + 0.05 * seed)
            for seed in range(3)}


def test_unsupported_is_its_own_outcome_never_does_not_fit(tmp_path):
    runs = _three("dschat", 5.0)
    for seed in range(3):
        runs[f"c{seed}"] = record(config(seed=seed, **{"framework.name": "colossalai"}), run_id=f"c{seed}",
                                  status="unsupported")
    leaf = _leaves(_collect(tmp_path, runs))[("glm-base", "2", "bf16", "full fine-tuning")]
    assert leaf.verdict.startswith("only dschat runs this mode (colossalai: unsupported)") and not leaf.decided
    assert any(e.startswith("colossalai: cannot run this mode (unsupported") for e in leaf.evidence)
    assert not any("ruled out" in e for e in leaf.evidence)  # old behaviour: "ruled out -- no run finished"
    mixed = _collect(tmp_path / "mixed", {name: _with_git(copy.deepcopy(data), name[-1] * 40)
                                          for name, data in runs.items()})  # a commit per seed
    assert _leaves(mixed)[("glm-base", "2", "bf16", "full fine-tuning")].verdict.startswith(
        "no admissible evidence: every run in this branch is in a cell of mixed provenance")
    only = {f"c{seed}": runs[f"c{seed}"] for seed in range(3)}
    alone = _leaves(_collect(tmp_path / "alone", only))[("glm-base", "2", "bf16", "full fine-tuning")]
    assert alone.verdict.startswith("unsupported: no measured framework can run this mode")


def test_a_leaf_only_one_framework_runs_names_no_winner(tmp_path):
    leaf = _leaves(_collect(tmp_path, _three("trlx", 2.0)))[("glm-base", "2", "bf16", "full fine-tuning")]
    assert leaf.verdict == "only trlx runs this mode: nothing to compare it with, no winner" and not leaf.decided


def test_a_framework_the_sweep_did_not_run_in_a_branch_is_not_said_unable_to(tmp_path):
    # dschat ran PPO at 2 ranks only; colossalai at 1 rank only: each 2-rank and 1-rank leaf has one framework
    runs = {**_three("dschat", 5.0), **_three("colossalai", 5.0, **{"launcher.nproc": 1})}
    leaves = _leaves(_collect(tmp_path, runs))
    assert leaves[("glm-base", "2", "bf16", "full fine-tuning")].verdict == (
        "only dschat measured in this branch (colossalai: not measured): nothing to compare it with, no winner")
    assert leaves[("glm-base", "1", "bf16", "full fine-tuning")].verdict.startswith("only colossalai measured")


def test_the_tree_states_its_hardware_and_asks_for_ranks_on_a_cpu_host(tmp_path):
    tree = decision.build(_collect(tmp_path, _three("dschat", 5.0)).rows)
    assert tree.question.startswith("Evidence from device cpu on test cpu x 2, matrix ISA not recorded; memory: "
                                    "host RSS")
    (_, ranks), = tree.branches
    assert ranks.question == "How many ranks on this CPU host (processes, not GPUs)?"


def test_the_measured_step_rate_leads_and_the_one_pass_figure_stands_beside_it(tmp_path):
    # trlx: 4 update passes in an 8 s step (all training) -> one pass 2 s; dschat: one pass in 6 s
    runs = {}
    for seed in range(3):
        trlx = record(config(seed=seed, **{"framework.name": "trlx"}), run_id=f"t{seed}", step_s=8.0 + 0.01 * seed)
        trlx["stages"]["ppo"].update(update_passes=4, rollouts_per_step=1)  # one rollout of 2 prompts a rank
        runs[f"t{seed}"] = trlx
        runs[f"d{seed}"] = record(config(seed=seed), run_id=f"d{seed}", step_s=6.0 + 0.01 * seed)
    leaf = _leaves(_collect(tmp_path, runs))[("glm-base", "2", "bf16", "full fine-tuning")]
    # measured: dschat 4 samples / 6 s / 2 ranks = 0.333 a rank; trlx 4 / 8 / 2 = 0.250. At one pass trlx would
    # lead (4 / (8.01 - 8.01 x 3/4) / 2 = 0.999 at the median seed): the old rule named trlx
    assert leaf.verdict.startswith("dschat"), leaf.verdict
    trlx = next(e for e in leaf.evidence if e.startswith("trlx"))
    assert "measured 0.250 samples/s per rank" in trlx and "derived at one update pass: 0.999" in trlx


def test_lora_leaves_compare_like_work_only(tmp_path):
    runs = {}
    for framework, step_s, trainable in (("dschat", 5.0, 33_000_000), ("trlx", 10.0, 3_500_000)):
        for seed in range(3):
            runs[f"{framework}{seed}"] = record(config(seed=seed, lora=64, **{"framework.name": framework}),
                                                run_id=f"{framework}{seed}", step_s=step_s + 0.05 * seed,
                                                trainable=trainable, total=100_000_000)
            runs[f"{framework}{seed}"]["stages"]["ppo"]["rollouts_per_step"] = 1  # equal samples a step
    leaf = _leaves(_collect(tmp_path, runs))[("glm-base", "2", "bf16", "LoRA")]
    assert leaf.verdict == ("cannot call: not like work: dschat's LoRA trains 33.00 M parameters, trlx's 3.50 M "
                            "(more than 1.5x apart)")
    assert any("3.50 M parameters train" in e for e in leaf.evidence)


def test_cells_measured_with_different_settings_are_not_compared(tmp_path):
    runs = {**_three("dschat", 5.0), **_three("colossalai", 10.0, memory_release_every=4)}
    leaf = _leaves(_collect(tmp_path, runs))[("glm-base", "2", "bf16", "full fine-tuning")]
    assert leaf.verdict.startswith("cannot call: dschat and colossalai were measured unlike: measurement settings")
    assert "memory_release_every=1" in leaf.verdict and "memory_release_every=4" in leaf.verdict


# --- every cell names the command that re-runs it --------------------------------------------------------------

def test_a_cell_names_the_command_that_reruns_it():
    assert split_overrides("a=1,tags=[forced-failure,x],b=2") == ["a=1", "tags=[forced-failure,x]", "b=2"]
    assert split_overrides("2026-12-04_10-00-00") is None
    data = record(config(), run_id="framework=dschat,lr=1000,seed=1,stage=sft,tags=[forced-failure]")
    assert rerun_command(data, [1, 2, 3]) == ("python -m bench.run -m framework=dschat lr=1000 stage=sft "
                                              "'tags=[forced-failure]' seed=1,2,3")
    by_hand = record(config(), run_id="20261204-100000")
    assert rerun_command(by_hand, [1]).startswith("python -m bench.run framework=dschat stage=ppo model=glm-base")
