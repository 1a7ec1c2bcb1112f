"""The record's arithmetic on hand-made per-rank data: no engine, values worked out by hand."""

from __future__ import annotations

import math

import pytest

from adapters.base import TrainOutput
from bench.measure.flops import Attention, phase_flops, token_flops
from bench.measure.params import ParamCounts
from bench.results.record import fixed_cost, merge_status, stage_record
from bench.run.launcher import missing_ranks_failure, sigkilled_ranks

MIB = 1024 * 1024


def test_token_flops_count_frozen_weights_at_4n_and_the_attention_term():
    counts = ParamCounts(total=1100, trainable=600, compute=1000, compute_trainable=600)
    attention = Attention(layers=2, hidden=8)
    # forward: 2*1000 + 4*(2*10*8) = 2000 + 640
    assert token_flops("experience", counts, attention, context=10) == 2640
    # training: 6*600 trainable + 4*400 frozen + 12*(2*10*8) = 3600 + 1600 + 1920
    assert token_flops("training", counts, attention, context=10) == 7120
    # two roles, 5 tokens: (2640 + 2640) * 5
    both = phase_flops("experience", ("actor", "ref"), {"actor": counts, "ref": counts},
                       {"actor": attention, "ref": attention}, tokens=5, context=10)
    assert both == 26400


def _samples(phase_peaks: dict[str, list[int]], times: list[float], flops: float, tokens: int) -> list[dict]:
    """phase_samples as a worker writes them: imports and init once, then training steps 0..n-1."""
    samples = [{"phase": "imports", "step": None, "time_s": 3.0, "peak_bytes": phase_peaks["imports"][0],
                "end_bytes": phase_peaks["imports"][0], "host_peak_bytes": phase_peaks["imports"][0]},
               {"phase": "init", "step": None, "time_s": 1.0, "peak_bytes": phase_peaks["init"][0],
                "end_bytes": phase_peaks["init"][0], "host_peak_bytes": phase_peaks["init"][0]}]
    for step, (peak, time_s) in enumerate(zip(phase_peaks["training"], times, strict=True)):
        samples.append({"phase": "training", "step": step, "time_s": time_s, "peak_bytes": peak, "end_bytes": peak,
                        "host_peak_bytes": peak, "tokens": tokens, "samples": 2, "flops": flops})
    return samples


def _rank(rank: int, peaks: dict[str, list[int]], times: list[float], losses: list, status: str = "ok",
          classification: str = "stable") -> dict:
    return {
        "rank": rank, "status": status, "error": None if status == "ok" else {"message": status, "phase": "training"},
        "device": "cpu", "process_start_bytes": 300 * MIB, "baseline_bytes": 320 * MIB,
        "data_parallel_rank": rank, "layout": {"data_parallel_rank": rank},
        "model_state": {"actor": {"param_bytes": 10 * MIB, "optimizer_state_bytes": 20 * MIB,
                                  "trainable_param_bytes": 10 * MIB, "accelerator_bytes": 0}},
        "phase_samples": _samples(peaks, times, flops=4e12, tokens=100),
        "steps": [{"step": i, "loss/actor": loss} for i, loss in enumerate(losses)],
        "stability": {"classification": classification, "first_nonfinite_step": None if classification == "stable"
                      else 2, "first_nonfinite_metric": None},
        "learning": {},
    }


def test_stage_merge_takes_max_over_ranks_excludes_warmup_and_breaks_peaks_down():
    rank0 = _rank(0, {"imports": [330 * MIB], "init": [350 * MIB], "training": [400 * MIB, 380 * MIB, 390 * MIB]},
                  times=[9.0, 2.0, 2.0], losses=[3.0, 2.0, 1.0])
    rank1 = _rank(1, {"imports": [331 * MIB], "init": [352 * MIB], "training": [360 * MIB, 410 * MIB, 370 * MIB]},
                  times=[9.0, 4.0, 4.0], losses=[3.0, 2.5, 1.5], classification="recovered")
    record = stage_record("sft", [rank1, rank0], warmup=1, wall_time_s=30.0)
    training = record.memory["phases"]["training"]
    assert training["peak_bytes"] == 410 * MIB and training["peak_bytes_per_rank"] == [400 * MIB, 410 * MIB]
    assert training["growth_over_baseline_bytes"] == 90 * MIB  # 410 - 320, from the post-import baseline
    # process start 300 + runtime 20 + model state 30 + rest 50 = the 400 MiB peak of rank 0
    assert training["breakdown_bytes_per_rank"][0] == {"process_start_bytes": 300 * MIB, "runtime_bytes": 20 * MIB,
                                                 "model_state_bytes": 30 * MIB, "rest_bytes": 50 * MIB}
    assert record.memory["phases"]["imports"]["peak_bytes"] == 331 * MIB
    speed = record.throughput["phases"]["training"]
    assert speed["measured_steps"] == 2  # step 0 is warm-up
    # rank 0: 2 steps x 4e12 FLOPs in 4 s = 2 TFLOP/s; rank 1: in 8 s = 1 TFLOP/s
    assert speed["tflops_per_s_per_rank"] == pytest.approx([2.0, 1.0])
    # 2 replicas x 2 steps x 100 tokens over the slowest rank's 8 s
    assert speed["tokens_per_s_global"] == pytest.approx(50.0)
    assert record.throughput["phases"]["imports"]["time_s"] == 3.0
    # per measured step, the slowest rank: steps 1 and 2 took 2 s on rank 0 and 4 s on rank 1
    assert record.throughput["step_times_s"] == [4.0, 4.0]
    assert record.stability["classification"] == "recovered" and record.stability["aggregate"] == "worst rank"
    assert record.learning["loss_curve"] == pytest.approx([3.0, 2.25, 1.25])


def test_a_non_finite_value_on_one_rank_survives_the_merge():
    rank0 = _rank(0, {"imports": [1], "init": [1], "training": [1, 1, 1]}, [1.0] * 3, losses=[3.0, 2.0, 1.0])
    rank1 = _rank(1, {"imports": [1], "init": [1], "training": [1, 1, 1]}, [1.0] * 3, losses=[3.0, "nan", "inf"])
    record = stage_record("sft", [rank0, rank1], warmup=1, wall_time_s=1.0)
    curve = record.learning["loss_curve"]
    assert curve[0] == 3.0 and math.isnan(curve[1]) and curve[2] == math.inf


@pytest.mark.parametrize(("statuses", "expected"), [
    (["ok", "ok"], "ok"),
    (["error", "oom"], "oom"),
    (["nan", "error"], "nan"),
    (["error", "timeout"], "timeout"),
    (["timeout", "nan", "oom"], "oom"),
])
def test_status_precedence(statuses, expected):
    assert merge_status(statuses) == expected


def test_an_oom_on_one_rank_with_a_knock_on_error_names_the_stage_oom():
    ok = {"imports": [1], "init": [1], "training": [1]}
    rank0 = _rank(0, ok, [1.0], [1.0], status="error")
    rank1 = _rank(1, ok, [1.0], [1.0], status="oom")
    record = stage_record("sft", [rank0, rank1], warmup=0, wall_time_s=1.0)
    assert record.status == "oom" and record.error["rank"] == 1
    # the launcher's timeout outranks a rank's error, an OOM outranks the timeout
    timeout = {"status": "timeout", "error": {"message": "still running", "phase": None}}
    assert stage_record("sft", [rank0], 0, 1.0, timeout).status == "timeout"
    assert stage_record("sft", [rank0, rank1], 0, 1.0, timeout).status == "oom"


TORCHRUN_SUMMARY = """\
Failures:
[1]:
  time      : 2026-12-01_03:45:21
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5224)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 5224
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_03:45:21
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5225)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 5225
"""


def test_a_rank_killed_by_sigkill_without_a_result_is_an_oom():
    assert sigkilled_ranks(TORCHRUN_SUMMARY) == [1]
    failure = missing_ranks_failure(2, [0], 1, TORCHRUN_SUMMARY)
    assert failure["status"] == "oom" and failure["error"]["killed_ranks"] == [1]
    assert "OOM killer" in failure["error"]["message"]
    # a rank that died otherwise stays an error
    assert missing_ranks_failure(2, [0], 1, "rank 1 segfaulted")["status"] == "error"


def test_repeated_optimizer_steps_keep_every_skip_and_non_finite_value():
    out = TrainOutput(losses={}, tokens=0, samples=0)
    out.record("actor", float("nan"), 1.0, skipped=True, loss_scale=2.0**15)
    for _ in range(3):  # later epochs are finite and not skipped
        out.record("actor", 0.5, 2.0, skipped=False, loss_scale=2.0**15)
    assert math.isnan(out.losses["actor"]) and out.skipped["actor"]
    assert out.metrics["optimizer_steps/actor"] == 4 and out.metrics["skipped_steps/actor"] == 1
    out = TrainOutput(losses={}, tokens=0, samples=0)
    out.record("actor", 0.5, 2.0, skipped=False, loss_scale=None)
    out.record("actor", 0.4, float("inf"), skipped=False, loss_scale=None)
    out.record("actor", 0.3, 1.0, skipped=False, loss_scale=None)
    assert out.losses["actor"] == 0.3 and out.grad_norms["actor"] == math.inf and not out.skipped["actor"]


def test_torn_writes_are_removed_and_never_read_as_records(tmp_path):
    from bench.results.collect import collect
    from bench.results.record import ResultRecord
    from bench.run.launcher import remove_torn_writes

    ResultRecord(run_id="run", config={"stage": {"name": "sft"}}).write(str(tmp_path / "run" / "record.json"))
    torn = tmp_path / "run" / ".tmp-abc123.json"
    torn.write_text('{"schema_version": 2, "stat')  # what a SIGKILL midway through write_json leaves
    assert not collect(str(tmp_path)).problems  # the collector reads record.json files only
    remove_torn_writes(str(tmp_path / "run"))
    assert not torn.exists() and (tmp_path / "run" / "record.json").exists()


def test_on_cuda_the_breakdown_counts_only_model_state_on_the_gpu():
    rank = _rank(0, {"imports": [0], "init": [50 * MIB], "training": [100 * MIB]}, [1.0], [1.0])
    rank.update(device="cuda:0", process_start_bytes=0, baseline_bytes=2 * MIB)
    rank["model_state"]["actor"]["accelerator_bytes"] = 10 * MIB  # optimizer state offloaded to the host
    record = stage_record("sft", [rank], warmup=0, wall_time_s=1.0)
    parts = record.memory["phases"]["training"]["breakdown_bytes_per_rank"][0]
    assert parts == {"process_start_bytes": 0, "runtime_bytes": 2 * MIB, "model_state_bytes": 10 * MIB,
                     "rest_bytes": 88 * MIB}


def test_trlx_reward_function_is_its_own_breakdown_line_and_counts_only_on_the_ranks_device():
    rank = _rank(0, {"imports": [0], "init": [50 * MIB], "training": [100 * MIB]}, [1.0], [1.0])
    rank.update(device="cuda:0", process_start_bytes=0, baseline_bytes=2 * MIB)
    rank["model_state"]["actor"]["accelerator_bytes"] = 10 * MIB
    rank["model_state"]["reward_fn"] = {"param_bytes": 6 * MIB, "optimizer_state_bytes": 0,
                                        "trainable_param_bytes": 0, "accelerator_bytes": 6 * MIB, "device": "cuda:0"}
    parts = stage_record("ppo", [rank], warmup=0, wall_time_s=1.0).memory["phases"]["training"][
        "breakdown_bytes_per_rank"][0]
    # 100 = 0 start + 2 runtime + 10 engines + 6 reward function + 82 rest
    assert parts == {"process_start_bytes": 0, "runtime_bytes": 2 * MIB, "model_state_bytes": 10 * MIB,
                     "reward_fn_bytes": 6 * MIB, "rest_bytes": 82 * MIB}
    rank["model_state"]["reward_fn"]["device"] = "cuda:7"  # upstream's own GPU: not in this rank's peak
    parts = stage_record("ppo", [rank], warmup=0, wall_time_s=1.0).memory["phases"]["training"][
        "breakdown_bytes_per_rank"][0]
    assert parts["reward_fn_bytes"] == 0 and parts["rest_bytes"] == 88 * MIB


def test_live_tensors_come_from_the_lowest_rank_that_reached_each_point():
    ranks = [_rank(r, {"imports": [MIB], "init": [MIB], "training": [MIB]}, [1.0], [1.0]) for r in (0, 1)]
    groups = [{"shape": [2, 8, 50304], "dtype": "float16", "device": "cpu", "count": 2,
               "storage_bytes": 1_609_728, "total_bytes": 3_219_456}]
    ranks[1]["live_tensors"] = {"reward_call": groups, "reference_call": []}
    ranks[0]["live_tensors"] = {"reference_call": groups}
    live = stage_record("ppo", ranks, warmup=0, wall_time_s=1.0).live_tensors
    assert live["reward_call"] == {"rank": 1, "groups": groups}
    assert live["reference_call"] == {"rank": 0, "groups": groups}
    assert "gc census" in live["method"]


def test_step_times_sum_a_steps_phases_and_take_the_slowest_rank():
    ranks = [_rank(r, {"imports": [330 * MIB], "init": [350 * MIB], "training": [400 * MIB] * 3}, times=times,
                   losses=[1.0] * 3) for r, times in enumerate(([5.0, 1.0, 3.0], [5.0, 2.0, 1.0]))]
    for rank, generation in zip(ranks, ([0.5, 0.5, 0.5], [0.1, 0.1, 0.1]), strict=True):
        rank["phase_samples"] += [{"phase": "generation", "step": i, "time_s": t, "peak_bytes": 400 * MIB,
                                   "tokens": 10, "samples": 2} for i, t in enumerate(generation)]
    # step 1: rank 0 1.0 + 0.5 = 1.5, rank 1 2.0 + 0.1 = 2.1 -> 2.1; step 2: 3.5 vs 1.1 -> 3.5 (step 0 warm-up)
    assert stage_record("ppo", ranks, warmup=1, wall_time_s=1.0).throughput["step_times_s"] == pytest.approx([2.1, 3.5])


def test_one_pass_throughput_divides_only_the_training_time_by_the_update_passes():
    from bench.results.collect import stage_row

    record = {"config": {"framework": {"name": "trlx", "ppo": {"ppo_epochs": 4}}, "batch": 4,
                         "launcher": {"nproc": 2}, "model": {"name": "tiny"}},
              "harness_extension": [{"knob": "grad_ckpt=true", "reason": "..."}]}
    result = {"status": "ok", "throughput": {"phases": {
        "generation": {"time_s_per_step": 1.0}, "experience": {"time_s_per_step": 0.5},
        "training": {"time_s_per_step": 4.0}}}}
    row = stage_row("r", record, "ppo", result)
    # trlx's step learns on num_rollouts = 4 x batch = 16 rollouts per rank (4 generate calls of 4 prompts), 32 on
    # 2 ranks; step: 1 + 0.5 + 4 = 5.5 s; one pass: 1 + 0.5 + 4 / 4 = 2.5 s
    assert (row["update_passes"], row["rollouts_per_step"], row["global_batch"]) == (4, 4, 32)
    assert row["samples_per_s_step"] == pytest.approx(32 / 5.5)
    assert row["samples_per_s_one_pass"] == pytest.approx(32 / 2.5)
    assert row["harness_extension"] == "grad_ckpt=true"


def test_trl_s_update_passes_come_from_its_record_and_older_records_from_num_ppo_epochs():
    """TRL's PPOConfig runs num_ppo_epochs (4) passes: a record that states them, and one written before records
    did, both count 4, so its one-pass rate is (1 + 0.5 + 4 / 4) s for 8 samples, not the whole 5.5 s."""
    from bench.results.collect import stage_row

    config = {"framework": {"name": "trl", "ppo": {"num_ppo_epochs": 4, "num_mini_batches": 1}}, "batch": 4,
              "launcher": {"nproc": 2}, "model": {"name": "tiny"}}
    throughput = {"phases": {"generation": {"time_s_per_step": 1.0}, "experience": {"time_s_per_step": 0.5},
                             "training": {"time_s_per_step": 4.0}}}
    stated = stage_row("r", {"config": config}, "ppo", {"status": "ok", "throughput": throughput,
                                                        "update_passes": 4})
    older = stage_row("r", {"config": config}, "ppo", {"status": "ok", "throughput": throughput})
    for row in (stated, older):
        assert row["update_passes"] == 4 and row["samples_per_s_one_pass"] == pytest.approx(8 / 2.5)
    # the stated figure wins over the config's: a record says what its run did
    other = {**config, "framework": {"name": "trl", "ppo": {"num_ppo_epochs": 2}}}
    assert stage_row("r", {"config": other}, "ppo", {"status": "ok", "throughput": throughput,
                                                     "update_passes": 4})["update_passes"] == 4


def test_a_ppo_step_s_samples_are_its_rollouts_as_stated_or_from_the_config():
    """coati collects num_collect_steps (2) rollouts of `batch` prompts a step: 2 x 2 prompts x 2 ranks = 8
    samples in a 4 s step, not the 4 that batch x ranks says; DS-Chat, one rollout a step, 4."""
    from bench.results.collect import stage_row

    throughput = {"phases": {"generation": {"time_s_per_step": 1.0}, "training": {"time_s_per_step": 3.0}}}
    coati = {"framework": {"name": "colossalai", "ppo": {"num_collect_steps": 2, "num_update_steps": 1}},
             "batch": 2, "launcher": {"nproc": 2}, "model": {"name": "tiny"}}
    older = stage_row("r", {"config": coati}, "ppo", {"status": "ok", "throughput": throughput})
    stated = stage_row("r", {"config": {**coati, "framework": {"name": "colossalai", "ppo": {}}}}, "ppo",
                       {"status": "ok", "throughput": throughput, "rollouts_per_step": 2})
    for row in (older, stated):
        assert (row["rollouts_per_step"], row["global_batch"]) == (2, 8)
        assert row["samples_per_s_step"] == pytest.approx(8 / 4.0)
    dschat = {**coati, "framework": {"name": "dschat", "ppo": {"ppo_epochs": 1}}}
    row = stage_row("r", {"config": dschat}, "ppo", {"status": "ok", "throughput": throughput})
    assert (row["rollouts_per_step"], row["samples_per_s_step"]) == (1, pytest.approx(4 / 4.0))


def test_the_fixed_cost_splits_a_stage_s_time_outside_its_steps():
    samples = [{"phase": "imports", "step": None, "time_s": 3.0}, {"phase": "init", "step": None, "time_s": 4.0},
               {"phase": "training", "step": 0, "time_s": 9.0}, {"phase": "training", "step": 1, "time_s": 10.0},
               {"phase": "checkpoint", "step": 1, "time_s": 2.5}, {"phase": "evaluation", "step": 2, "time_s": 1.5}]
    ranks = [{"rank": 0, "lifetime_s": 50.0, "process_start_s": 6.0, "save_s": 2.0, "close_s": 0.5,
              "phase_samples": samples},
             {"rank": 1, "lifetime_s": 51.0, "process_start_s": 6.5, "phase_samples": samples}]
    split = fixed_cost(ranks, wall_time_s=55.0)
    # launch: 55 - the longest lifetime 51; other: rank 0's 50 s less 6 + 3 + 4 + 19 + 2.5 + 1.5 + 2 + 0.5
    assert {k: v for k, v in split.items() if k != "method"} == {
        "launch_s": 4.0, "process_start_s": 6.0, "imports_s": 3.0, "init_s": 4.0, "steps_s": 19.0,
        "checkpoints_s": 2.5, "evaluation_s": 1.5, "save_s": 2.0, "close_s": 0.5, "other_s": 11.5, "fixed_s": 36.0}
    assert fixed_cost([{"rank": 0, "phase_samples": samples}], 55.0) == {}  # a rank that wrote no timings
    # the parts of init and of imports + init a rank timed: shown beside the split, never added to it
    ranks[0].update(model_build_s=1.5, jit_ops_s=2.25)
    parts = fixed_cost(ranks, wall_time_s=55.0)
    assert (parts["init_model_build_s"], parts["init_engines_s"], parts["jit_ops_s"]) == (1.5, 2.5, 2.25)
    assert (parts["other_s"], parts["fixed_s"]) == (11.5, 36.0)


def test_a_step_a_rank_did_not_measure_has_no_peak_in_the_timeline_and_is_left_out_of_the_phase_peak():
    ranks = [_rank(r, {"imports": [330 * MIB], "init": [350 * MIB], "training": [400 * MIB] * 3}, [1.0] * 3,
                   [1.0] * 3) for r in (0, 1)]
    # rank 1 started step 2's training above its floor (the memory tracker's release schedule): a bound only
    unmeasured = ranks[1]["phase_samples"][4]
    assert unmeasured["step"] == 2
    unmeasured.update(peak_bytes=None, host_peak_bytes=None, peak_upper_bound_bytes=900 * MIB)
    ranks[0]["phase_samples"][3]["peak_bytes"] = 410 * MIB  # rank 0, step 1
    memory = stage_record("sft", ranks, warmup=0, wall_time_s=1.0).memory
    timeline = {entry["step"]: entry for entry in memory["timeline"]}
    assert timeline[1]["peak_bytes"] == 410 * MIB and "peak_upper_bound_bytes" not in timeline[1]
    assert timeline[2]["peak_bytes"] is None and timeline[2]["peak_upper_bound_bytes"] == 900 * MIB
    training = memory["phases"]["training"]
    assert training["peak_bytes_per_rank"] == [410 * MIB, 400 * MIB] and training["peak_bytes"] == 410 * MIB
    assert "started from its own floor" in memory["aggregate"]



def test_the_record_says_which_floor_rule_its_host_peaks_were_measured_under():
    ranks = [_rank(r, {"imports": [330 * MIB], "init": [350 * MIB], "training": [400 * MIB]}, [1.0], [1.0])
             for r in (0, 1)]
    assert stage_record("sft", ranks, warmup=0, wall_time_s=1.0).memory["floor_rule"] == 1  # written before the stamp
    for rank in ranks:
        rank["memory_floor_rule"] = 2
    assert stage_record("sft", ranks, warmup=0, wall_time_s=1.0).memory["floor_rule"] == 2
