"""TRL (the package's own trainers): its knobs and refusals, the seams that hand its loops to the harness, the
synthetic data as its trainers take it, and real runs: ZeRO 0/2/3, LoRA on/off, bf16/fp32, the pipeline and GRPO;
that the seams change no result and that the phases add up to TRL's own step; (slow tier) that PPO and GRPO learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from adapters.hf_trl import engines, examples
from adapters.hf_trl.adapter import _answer_mask
from adapters.hf_trl.driver import LoopDriver
from bench.run.config import compose
from bench.run.data import EOS, PAD, SyntheticData
from bench.run.launcher import rank_env
from bench.run.spec import RunSpec, SpecError, UnsupportedError, spec_from_config
from tests.processes import run_tree


def spec(*overrides: str):
    return spec_from_config(compose(["framework=trl", *overrides]))


# ----------------------------------------------------------------- knobs and refusals
@pytest.mark.parametrize("overrides, message", [
    (("stage=ppo", "grad_accum=2"), "one generation call"),
    (("stage=grpo", "grad_accum=2"), "one generation call"),
    (("stage=ppo", "grad_ckpt=true"), "never enables gradient checkpointing"),
    (("stage=pipeline", "lora=8", "zero=3"), "defragment"),
    (("stage=ppo", "reward.normalize=zscore"), "as it is"),
    (("stage=sft", "ds.reduce_bucket_size=1000"), "DeepSpeed config file"),
    (("stage=sft", "tp=2", "launcher.nproc=2"), "data parallelism only"),
])
def test_what_trl_cannot_run_is_refused_naming_why(overrides, message) -> None:
    with pytest.raises(UnsupportedError, match=message):
        spec(*overrides)


@pytest.mark.parametrize("override, message", [
    ("framework.ppo.kl_estimator=k2", "kl_estimator='k2'"), ("framework.ppo.stop_token=eot", "stop_token='eot'"),
    ("framework.grpo.num_generations=1", "relative to the other answers"),
    ("framework.grpo.loss_type=ppo", "loss_type='ppo'"), ("+framework.grpo.group=4", "group"),
])
def test_bad_trl_options_name_the_value(override, message) -> None:
    with pytest.raises(SpecError, match=message):
        spec("stage=grpo", override)


@pytest.mark.parametrize("framework", ["dschat", "colossalai", "trlx", "torch"])
def test_grpo_is_trl_only(framework) -> None:
    with pytest.raises(UnsupportedError, match=f"stage=grpo with framework={framework}: it has no GRPO trainer"):
        spec_from_config(compose([f"framework={framework}", "stage=grpo"]))


def test_zero_reaches_trl_as_accelerate_launch_exports_it() -> None:
    cpu = torch.device("cpu")
    assert engines.launch_env(spec("stage=sft"), cpu) == {
        "ACCELERATE_MIXED_PRECISION": "no", "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_CPU": "true"}
    env = engines.launch_env(spec("stage=sft", "zero=3", "offload=true", "precision=bf16", "grad_accum=2"), cpu)
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16", "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true",
                   "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
                   "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                   "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
                   "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}
    assert engines.launch_env(spec("stage=sft", "zero=2", "offload=true"), cpu)[
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"  # parameters are offloaded at ZeRO-3 only


# ----------------------------------------------------------------- data
def test_the_tokenizer_maps_the_synthetic_ids_to_words_and_back() -> None:
    tokenizer = examples.tokenizer(64)
    ids = torch.tensor([5, 63, 2])
    assert examples.text(ids) == "t5 t63 t2"
    assert tokenizer(examples.text(ids), add_special_tokens=False).input_ids == [5, 63, 2]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (PAD, EOS, 64)


def test_grpo_reward_is_the_preferred_token_share_of_the_answer() -> None:
    data = SyntheticData(vocab=64, prompt_len=4, answer_len=4, batch=1, seed=1, rank=0)
    assert data.preferred.tolist() == list(range(2, 9))  # (64 - 2) // 8 = 7 preferred tokens
    reward = examples.preferred_reward(data)
    # [2, 3, 20, EOS]: 2 of 3 answer tokens preferred (EOS not counted); [30]: none; [EOS]: empty -> 0
    assert reward([], completion_ids=[[2, 3, 20, EOS], [30], [EOS]]) == [2 / 3, 0.0, 0.0]


def test_rows_hold_every_ranks_samples_unpadded() -> None:
    rows = examples.Rows(vocab=64, prompt_len=6, answer_len=4, batch=2, seed=3, ranks=2)
    sft = rows.sft(batches=2)["input_ids"]
    assert len(sft) == 2 * 2 * 2
    first = SyntheticData(64, 6, 4, 2, 3, rank=1).sft(0)
    assert sft[2] == first.input_ids[0][first.attention_mask[0].bool()].tolist()  # batch 0, rank 1, row 0
    pairs = rows.preferences(batches=1)
    assert all(PAD not in row for row in pairs["input_ids_chosen"] + pairs["input_ids_rejected"])


def test_the_answer_mask_ends_at_the_first_eos() -> None:
    answers = torch.tensor([[7, EOS, PAD, PAD], [7, 8, 9, 10], [EOS, 9, PAD, PAD]])
    assert _answer_mask(answers).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


# ----------------------------------------------------------------- the driver
def test_the_driver_runs_the_loop_seam_to_seam_and_times_its_steps() -> None:
    order: list[str] = []

    def train() -> None:
        driver.seam("train_begin")
        for step in range(2):
            order.append(f"generate {step}")
            driver.seam("generation_end")
            time.sleep(0.05)
            order.append(f"update {step}")
            driver.seam("step_end", {"loss": float(step)})
        order.append("end")

    driver = LoopDriver(train, step_seams=("train_begin", "step_end"))
    driver.advance("train_begin")
    assert order == []
    driver.advance("generation_end")
    assert order == ["generate 0"]
    time.sleep(0.2)  # the harness's own time between phases is not the trainer's
    assert driver.advance("step_end") == {"loss": 0.0}
    assert driver.advance("step_end") == {"loss": 1.0}  # passes generation_end on the way
    assert order == ["generate 0", "update 0", "generate 1", "update 1"]
    # a step that took in the harness's 0.2 s would last at least 0.25 s; below that, scheduling delay on a busy host
    assert len(driver.step_seconds) == 2 and all(0.05 <= s < 0.25 for s in driver.step_seconds)
    driver.finish()
    assert order[-1] == "end" and driver.finished


def test_the_trainers_error_is_raised_in_the_harness_and_a_stop_ends_its_thread() -> None:
    def failing() -> None:
        driver.seam("train_begin")
        raise MemoryError("planted")

    driver = LoopDriver(failing, step_seams=("train_begin",))
    driver.advance("train_begin")
    with pytest.raises(MemoryError, match="planted"):
        driver.advance("step_end")

    def endless() -> None:
        while True:
            driver.seam("step_end")

    driver = LoopDriver(endless, step_seams=("step_end",))
    driver.advance("step_end")
    driver.stop()
    assert driver.finished and not any(t.name == "trainer-loop" and t.is_alive() for t in threading.enumerate())


# ----------------------------------------------------------------- real runs
def _phase_times(stage_dir: str) -> dict[int, float]:
    with open(os.path.join(stage_dir, "rank0.json")) as f:
        rank0 = json.load(f)
    times: dict[int, float] = {}
    for sample in rank0["phase_samples"]:
        if sample["step"] is not None and sample["phase"] in ("generation", "experience", "training"):
            times[sample["step"]] = times.get(sample["step"], 0.0) + sample["time_s"]
    return times


def _plain(stage_dir: str, stage: str, tmp_path, init: dict[str, str]) -> list[dict[str, float]]:
    """The same stage run by TRL alone (adapters/hf_trl/plain.py), its per-step logs."""
    out = tmp_path / f"plain-{stage}.json"
    # --standalone: torchrun's rendezvous on a free port (a fixed one would be shared by two runs at once)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "adapters.hf_trl.plain", os.path.join(stage_dir, "spec.json"), stage, str(out)]
    command += [arg for key, path in init.items() for arg in (f"--init-{key}", path)]
    with open(os.path.join(stage_dir, "spec.json")) as f:
        env = rank_env(RunSpec.from_dict(json.load(f)))  # the environment the harness's ranks had
    try:
        run_tree(command, timeout=600, env=env)
    except subprocess.SubprocessError as err:  # a stall's stacks (bench.run.watchdog) or the end of its output
        stall = tmp_path / "stall-rank0.txt"
        told = stall.read_text() if stall.exists() and "Timeout (" in stall.read_text() else ""
        pytest.fail(f"{err}\n{told}\n{(err.stderr or b'')[-3000:].decode(errors='replace')}")
    return json.loads(out.read_text())


@pytest.mark.engine
@pytest.mark.slow  # 51 s of CI's 30 minutes (TRL's step run twice): scripts/test_slow.sh
def test_the_seams_change_no_result_and_the_phases_add_up_to_trls_step(run_bench, tmp_path) -> None:
    sft = run_bench("framework=trl", "stage=sft", "steps=4", "warmup_steps=1", name="sft")
    run_dir = tmp_path / "sft"
    plain = _plain(str(run_dir / "sft"), "sft", tmp_path, {})
    assert [s["loss/actor"] for s in sft["stages"]["sft"]["steps"]] == [log["loss"] for log in plain]
    assert [s["grad_norm/actor"] for s in sft["stages"]["sft"]["steps"]] == [log["grad_norm"] for log in plain]

    ppo = run_bench("framework=trl", "stage=ppo", "steps=3", "warmup_steps=1", name="ppo")
    steps = ppo["stages"]["ppo"]["steps"]
    plain = _plain(str(tmp_path / "ppo" / "ppo"), "ppo", tmp_path, {"rm": ppo["prerequisites"]["rm"]["checkpoint"]})
    assert [s["loss/actor"] for s in steps] == [log["loss/policy_avg"] for log in plain]
    assert [s["trl/objective/scores"] for s in steps] == [log["objective/scores"] for log in plain]
    for directory, record, stage in ((run_dir / "sft", sft, "sft"), (tmp_path / "ppo" / "ppo", ppo, "ppo")):
        times = _phase_times(str(directory))
        for step in record["stages"][stage]["steps"]:  # each step's phases against TRL's step, timed in its thread
            assert times[step["step"]] == pytest.approx(step["trl_step_s"], rel=0.05)


@pytest.mark.engine
def test_pipeline_at_zero2_bf16_with_lora_on_two_ranks(run_bench) -> None:
    record = run_bench("framework=trl", "stage=pipeline", "steps=3", "warmup_steps=1", "zero=2", "precision=bf16",
                       "lora=8", "launcher.nproc=2")
    assert record["status"] == "ok"
    assert record["stages"]["ppo"]["update_passes"] == 4  # PPOConfig's num_ppo_epochs, which the report counts
    for stage, role in (("sft", "actor"), ("rm", "reward"), ("ppo", "actor")):
        result = record["stages"][stage]
        assert result["engine_knobs"]["grad_clip"][role] == 1.0  # DeepSpeed's, filled from max_grad_norm
        # peft's GPT-2 default target (c_attn) in every block, TRL's ModelConfig alpha
        assert result["engine_knobs"]["lora"][role]["targets"] == ["q", "k", "v"]
        assert result["engine_knobs"]["lora"][role]["alpha"] == 32.0
        assert "hf-trainer-deepspeed-empty-param-group-scheduler" in [d["id"] for d in result["upstream_defects"]]
        state = result["model_state"][role]
        params = result["params"][role]
        assert state["param_bytes_per_rank"] == [2 * params["total"]] * 2  # bf16 weights on each rank (ZeRO-2)
        # fp32 master + Adam's two moments of what trains, split over the two ranks: the LoRA weights, and in PPO
        # the value model too (no LoRA: TRL applies peft to the policy only; one optimizer over both)
        trainable = params["trainable"] + (result["params"]["critic"]["trainable"] if stage == "ppo" else 0)
        assert state["optimizer_state_bytes_per_rank"] == [6 * trainable] * 2
    ppo = record["stages"]["ppo"]
    # peft: the reference is the policy with its adapters off (no model of its own)
    assert set(ppo["model_state"]) - {"method"} == {"actor", "critic", "reward"}
    assert {"generation", "experience", "training"} <= set(ppo["memory"]["phases"])


@pytest.mark.engine
def test_sft_at_zero3_fp32_partitions_the_model(run_bench) -> None:
    record = run_bench("framework=trl", "stage=sft", "steps=3", "warmup_steps=1", "zero=3", "launcher.nproc=2")
    sft = record["stages"]["sft"]
    assert sft["status"] == "ok"
    total = sft["params"]["actor"]["total"]
    state = sft["model_state"]["actor"]
    # Adam's fp32 master and two moments (12 bytes a parameter), half on each rank
    assert state["optimizer_state_bytes_per_rank"] == [6 * total] * 2
    # each rank's fp32 half (2 bytes a parameter) plus the whole model kept gathered: every tiny tensor is under
    # DeepSpeed's default stage3_param_persistence_threshold (1e5 elements; accelerate's plugin sets none)
    assert state["param_bytes_per_rank"] == [6 * total] * 2


@pytest.mark.engine
def test_grpo_writes_a_complete_record(run_bench) -> None:
    record = run_bench("framework=trl", "stage=grpo", "steps=3", "warmup_steps=1")
    grpo = record["stages"]["grpo"]
    assert grpo["status"] == "ok"
    assert set(grpo["memory"]["phases"]) >= {"generation", "experience", "training"}
    step = grpo["steps"][-1]
    assert 0.0 <= step["reward"] <= 1.0 and step["kl"] is None and step["value"] is None
    assert [d["id"] for d in grpo["upstream_defects"]] == ["trl-grpo-logits-to-keep-ignored-by-gpt2"]
    assert grpo["learning"]["reward_start"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_trl_learns_over_30_steps(run_bench, stage) -> None:
    record = run_bench("framework=trl", f"stage={stage}", "steps=30", "launcher.nproc=2")
    rewards = [s["reward"] for s in record["stages"][stage]["steps"]]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10


def test_the_report_sets_trl_against_trlx_phase_by_phase() -> None:
    from bench.report.trl_vs_trlx import trl_vs_trlx_table

    shared = {"stage": "ppo", "model": "glm-base", "precision": "bf16", "zero": 2, "lora": 0, "batch": 2, "nproc": 2}
    rows, cells = [], {}
    for framework, growth, seconds in (("trl", (900, 1000), (3.0, 3.2)), ("trlx", (400,), (2.0,))):
        cells[framework] = {**{k: v for k, v in shared.items() if k != "stage"}, "framework.name": framework}
        for mib, s in zip(growth, seconds + (None,) * (len(growth) - len(seconds)), strict=True):
            rows.append({**shared, "framework": framework, "cell": framework, "status": "ok",
                         "growth_generation_bytes": mib * 2**20, "time_s_per_step_generation": s})
    rows.append({**shared, "stage": "sft", "framework": "dschat", "cell": "other", "status": "ok"})
    cells["other"] = {"framework.name": "dschat"}
    (table,) = trl_vs_trlx_table(rows, cells)
    generation = next(r for r in table.rows if r[2] == "generation")
    # n=2: the range, and the 95 % CI of the mean 12.706 x sd / sqrt 2 = 12.706 x 50 (MiB) and x 0.1 (s)
    assert generation[3:7] == ["950 [900, 1,000] CI±635 (n=2)", "400", "3.10 [3.00, 3.20] CI±1.27 (n=2)", "2.00"]
    assert "output_scores" in generation[7]
    assert trl_vs_trlx_table([r for r in rows if r["framework"] != "trlx"], cells) == []
