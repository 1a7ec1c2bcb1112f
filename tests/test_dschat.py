"""The DeepSpeed-Chat adapter on the real deepspeed engine, tiny model, CPU (or GPU where present).

Each test is a real run in its own process tree; assertions are on what the record measured.
`framework.optimizer=torch_adamw` keeps most runs off DeepSpeed's JIT-built Adam ops; the tests that
need DS-Chat's own optimizers (FusedAdam, DeepSpeedCPUAdam) use them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from tests.loss_scale_rules import assert_scale_halves_only_on_skipped_steps
from tests.processes import run_tree

REPO = Path(__file__).resolve().parent.parent
TORCH_ADAMW = "framework.optimizer=torch_adamw"
UNIT_MARKERS = ("bytes", "_s_", "_s", "steps")

pytestmark = pytest.mark.engine


def phase_peak(record: dict, stage: str, phase: str) -> int:
    return record["stages"][stage]["memory"]["phases"][phase]["peak_bytes"]


def test_sft_fp32_zero0_trains_and_records_every_figure_with_its_unit(run_bench, tmp_path):
    record = run_bench("stage=sft", "zero=0", "precision=fp32", "lora=0", TORCH_ADAMW)
    rank0 = json.loads((tmp_path / "run" / "sft" / "rank0.json").read_text())
    assert rank0["device"].startswith(record["environment"]["device"])  # the merge reads each rank's device
    assert record["status"] == "ok" and record["schema_version"] == 2
    sft = record["stages"]["sft"]
    curve = sft["learning"]["loss_curve"]
    assert len(curve) == 20 and curve[-1] < curve[0] - 1.0, curve
    memory = sft["memory"]
    assert set(memory["phases"]) == {"imports", "init", "training"}
    assert memory["method"] and memory["unit"] == "bytes"
    # The baseline is taken after DeepSpeed is imported: the imports are runtime, not the run's growth.
    assert memory["baseline_bytes_per_rank"][0] > memory["process_start_bytes_per_rank"][0]
    training = memory["phases"]["training"]
    assert training["peak_bytes"] >= memory["baseline_bytes_per_rank"][0]
    parts = training["breakdown_bytes_per_rank"][0]
    assert parts["runtime_bytes"] > 0
    # fp32 weights + torch AdamW's two fp32 moments: 12 bytes a parameter (its per-tensor `step` counters aside)
    assert parts["model_state_bytes"] == pytest.approx(12 * sft["params"]["actor"]["total"], rel=0.001)
    assert training["growth_over_baseline_bytes"] == training["peak_bytes"] - memory["baseline_bytes_per_rank"][0]
    speed = sft["throughput"]["phases"]["training"]
    assert speed["measured_steps"] == 20 - record["config"]["warmup_steps"]
    assert speed["tokens_per_s_global"] > 0 and speed["tflops_per_s_per_rank"][0] > 0
    for key in list(speed) + list(training):
        assert any(marker in key for marker in UNIT_MARKERS), f"{key} names no unit"
    assert sft["params"]["actor"]["total"] == sft["params"]["actor"]["trainable"] > 0
    assert record["environment"]["libraries"]["deepspeed"] == "0.19.8"
    assert sft["stability"]["classification"] == "stable"
    # the fixed cost's parts: the actor built inside init; on the CPU DeepSpeed loads its shm_comm op through
    # torch's JIT loader when it sets up communication
    cost = sft["fixed_cost"]
    assert 0 < cost["init_model_build_s"] < cost["init_s"]
    assert cost["jit_ops_s"] > 0 or record["environment"]["device"] != "cpu"


def test_rm_bf16_zero2_lora_freezes_the_wrapped_weights(run_bench):
    record = run_bench("stage=rm", "zero=2", "precision=bf16", "lora=8", TORCH_ADAMW)
    rm = record["stages"]["rm"]
    assert rm["status"] == "ok"
    # DS-Chat's LoRA (alpha 1) learns slowly; the loss must still come down.
    curve = rm["learning"]["loss_curve"]
    assert sum(curve[-5:]) < sum(curve[:5]), curve
    assert 0 <= rm["learning"]["accuracy_start"] <= 1 and 0 <= rm["learning"]["accuracy_end"] <= 1
    params = rm["params"]["reward"]
    # worked by hand for model=tiny (hidden 128, 4 blocks, vocab 256, 128 positions): tables 256 x 128 + 128 x 128;
    # a block's four wrapped weights 128 x 384, 128 x 128, 128 x 512, 512 x 128 (196,608), its biases and norms
    # 1,664, its LoRA factors 8 x (128 + 384) + 8 x (128 + 128) + 8 x (128 + 512) + 8 x (512 + 128) (16,384); the
    # final norm 256 and the bias-free v_head 128. The wrapped weights freeze; everything else trains.
    tables, wrapped, others, factors = 32_768 + 16_384, 4 * 196_608, 4 * 1_664 + 256 + 128, 4 * 16_384
    assert params["total"] == tables + wrapped + others + factors == 908_160
    assert params["trainable"] == tables + others + factors == 121_728
    state = rm["model_state"]["reward"]
    assert state["trainable_param_bytes_per_rank"][0] < state["param_bytes_per_rank"][0] / 5


# CI has each part of this run elsewhere: DeepSpeed's fp16 loss scale halving on DS-Chat's engines (the ZeRO-0
# defect test below), the four engines with a ZeRO-3 actor (tests/test_plan_run.py's plan run), LoRA freezing the
# wrapped weights (the RM LoRA test below); the three together run in the slow tier, for CI's time
@pytest.mark.slow
def test_ppo_fp16_zero3_lora_builds_four_engines_and_tracks_the_loss_scale(run_bench):
    record = run_bench("zero=3", "precision=fp16", "lora=8", "steps=5", TORCH_ADAMW)
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    assert set(ppo["params"]) == {"actor", "ref", "critic", "reward"}
    params = ppo["params"]
    assert params["actor"]["trainable"] < params["actor"]["total"]  # LoRA rank 8: the wrapped weights freeze
    assert params["critic"]["trainable"] == params["critic"]["total"]  # critic_lora_dim 0, as upstream
    state = ppo["model_state"]
    assert state["ref"]["optimizer_state_bytes_per_rank"] == [0] == state["reward"]["optimizer_state_bytes_per_rank"]
    assert state["actor"]["optimizer_state_bytes_per_rank"][0] > 0
    assert set(ppo["memory"]["phases"]) == {"imports", "init", "generation", "experience", "training"}
    assert set(ppo["stability"]["loss_scale_trajectory"]) == {"actor", "critic"}
    for role in ("actor", "critic"):  # DeepSpeed's initial_scale_power 16, which DS-Chat's fp16 block keeps
        assert_scale_halves_only_on_skipped_steps(ppo["stability"], role, 2.0**16)
    prerequisite = record["prerequisites"]["rm"]
    assert prerequisite["status"] == "ok" and prerequisite["accuracy_end"] >= 0.9, prerequisite


@pytest.mark.slow  # orchestration (36 s): CI's minutes go to tests that compare measured figures
def test_pipeline_chains_sft_into_actor_and_rm_into_critic(run_bench):
    record = run_bench("stage=pipeline", "zero=2", "precision=bf16", "steps=4", "warmup_steps=1", TORCH_ADAMW)
    assert [s["status"] for s in record["stages"].values()] == ["ok", "ok", "ok"]
    assert not record["prerequisites"], "the pipeline trains its own RM"
    assert record["stages"]["sft"]["checkpoint"].endswith("actor.pt")
    assert record["stages"]["rm"]["checkpoint"].endswith("reward.pt")
    notes = " ".join(record["stages"]["ppo"]["notes"])
    assert "random base weights" not in notes
    assert record["stages"]["ppo"]["checkpoint"].endswith("ppo/checkpoint/actor.pt")
    spec = json.loads((Path(record["stages"]["ppo"]["checkpoint"]).parents[1] / "spec.json").read_text())
    assert spec["stage"] == "pipeline"
    assert [e["knob"] for e in record["harness_extension"]] == ["framework.optimizer=torch_adamw"]
    # DS-Chat's gradient_clipping 1.0, read back from every trained engine of every step
    knobs = [record["stages"][s]["engine_knobs"] for s in ("sft", "rm", "ppo")]
    assert [k["grad_clip"] for k in knobs] == [{"actor": 1.0}, {"reward": 1.0}, {"actor": 1.0, "critic": 1.0}]
    assert knobs[2]["reward_normalize"] == {"mode": "none"}  # the RM score as it is
    # DeepSpeed's own buckets (DS-Chat sets none); no overlap on a device without streams
    assert knobs[2]["reduce_bucket_size"] == knobs[2]["allgather_bucket_size"] == dict.fromkeys(
        ("actor", "critic"), 500_000_000)
    assert knobs[2]["overlap_comm"] == {"actor": False, "critic": False}


def test_compute_fp32_loss_upcasts_the_experience_logits_and_values_but_not_the_new_log_probs(run_bench):
    record = run_bench("zero=2", "precision=bf16", "steps=1", "warmup_steps=0", "framework.compute_fp32_loss=true",
                       TORCH_ADAMW)
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    assert ppo["computation_dtypes"] == {
        "experience/log_probs": "torch.float32", "experience/values": "torch.bfloat16",
        "experience/reward_score": "torch.bfloat16", "update/log_probs": "torch.bfloat16",
        "update/values": "torch.float32"}  # as generate_experience and train_rlhf / critic_loss_fn


@pytest.mark.slow
def test_ppo_default_config_raises_the_reward_over_30_steps(run_bench):
    record = run_bench("steps=30")  # DS-Chat defaults: FusedAdam, fp32, ZeRO-0, no LoRA
    learning = record["stages"]["ppo"]["learning"]
    assert learning["reward_window_steps"] == 10
    assert learning["reward_end"] > learning["reward_start"], learning["reward_curve"]


def test_forced_divergence_is_recorded_with_its_step_and_exits_cleanly(tmp_path):
    proc = run_tree([sys.executable, "-m", "bench.run", "stage=sft", "precision=fp16", "lr=1000", TORCH_ADAMW,
                     f"output_root={tmp_path}"], timeout=600, check=False, cwd=REPO, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record_path,) = tmp_path.glob("runs/*/record.json")
    record = json.loads(record_path.read_text())
    stability = record["stages"]["sft"]["stability"]
    assert stability["classification"] in ("diverged", "skip-storm")
    assert stability["first_nonfinite_step"] is not None or stability["longest_skip_run"] >= 5
    assert record["status"] in ("nan", "ok")
    assert stability["loss_scale_min"] < 2.0**16  # the dynamic scale came down
    assert_scale_halves_only_on_skipped_steps(stability, "actor", 2.0**16)  # DeepSpeed's initial_scale_power 16


# ZeRO-3's bytes a rank on 2 ranks are checked in CI against bytes worked by hand in tests/test_plan_run.py's
# plan run (the actor and reference at ZeRO-3, with their optimizer states); this 1-rank against 2-rank ratio runs
# in the slow tier, for CI's time
@pytest.mark.slow
def test_zero3_on_two_ranks_halves_parameter_and_optimizer_memory_per_rank(run_bench):
    one = run_bench("stage=sft", "zero=3", "precision=bf16", "steps=4", "warmup_steps=1", TORCH_ADAMW, name="one")
    two = run_bench("stage=sft", "zero=3", "precision=bf16", "steps=4", "warmup_steps=1", TORCH_ADAMW,
                    "launcher.nproc=2", name="two")
    state_one = one["stages"]["sft"]["model_state"]["actor"]
    state_two = two["stages"]["sft"]["model_state"]["actor"]
    assert len(state_two["param_bytes_per_rank"]) == 2
    for key in ("param_bytes_per_rank", "optimizer_state_bytes_per_rank"):
        assert max(state_two[key]) < 0.6 * state_one[key][0], (key, state_one[key], state_two[key])
    # fp32 master + two Adam moments, 12 bytes per trained parameter, shared by the ranks: ZeRO-3 keeps the
    # masters outside its optimizer's groups between steps, and they count all the same
    trained = one["stages"]["sft"]["params"]["actor"]["trainable"]
    assert state_one["optimizer_state_bytes_per_rank"][0] >= 12 * trained
    assert min(state_two["optimizer_state_bytes_per_rank"]) >= 12 * trained // 2
    assert len(two["stages"]["sft"]["memory"]["phases"]["training"]["peak_bytes_per_rank"]) == 2
    assert two["environment"]["world_size"] == 2


@pytest.mark.slow  # CI's DS-Chat ZeRO-3 PPO on 2 ranks is tests/test_plan_run.py's plan run (the same checks)
def test_two_rank_ppo_zero3_generates_in_lockstep(run_bench):
    record = run_bench("zero=3", "precision=bf16", "steps=3", "warmup_steps=1", "launcher.nproc=2", TORCH_ADAMW)
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    generation = ppo["throughput"]["phases"]["generation"]
    assert len(generation["tokens_per_s_per_rank"]) == 2
    assert generation["tokens_per_s_global"] > max(generation["tokens_per_s_per_rank"])
    # ZeRO-3 partitions each role's bf16 weights over the 2 ranks (2 bytes a parameter, half on each), except
    # that a tensor under DS-Chat's stage3_param_persistence_threshold (1e4 elements) also stays whole on every
    # rank beside its partition: model=tiny's biases and norms, 4 x 1,664 + 256 = 6,912 elements, and the critic's
    # 128-element v_head. (The frozen reward model, built with the reference's eval config, reads as its partitions
    # alone, total / 2 per rank: why its small tensors hold no whole copy is not established, so it is left out.)
    for role, persistent in (("actor", 6_912), ("ref", 6_912), ("critic", 7_040)):
        expected = 2 * (ppo["params"][role]["total"] // 2 + persistent)
        assert ppo["model_state"][role]["param_bytes_per_rank"] == [expected] * 2, role


def test_hybrid_engine_on_cpu_says_it_runs_control_flow_only(run_bench):
    record = run_bench("framework.hybrid_engine=true", "zero=2", "precision=bf16", "steps=3", "warmup_steps=1",
                       TORCH_ADAMW)
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    (note,) = [n for n in ppo["notes"] if n.startswith("hybrid engine")]
    if record["environment"]["device"] == "cpu":
        assert "0 inference containers" in note and "no inference kernels" in note


@pytest.mark.slow  # builds DeepSpeedCPUAdam on a fresh machine (~2 of its ~3 minutes); the CI budget is 25
def test_offload_and_gradient_checkpointing_with_ds_chat_optimizers(run_bench):
    record = run_bench("zero=3", "offload=true", "grad_ckpt=true", "precision=bf16", "steps=3", "warmup_steps=1")
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    assert any("DeepSpeedCPUAdam" in n for n in ppo["notes"])


def test_a_failing_run_is_a_record_not_a_crash(run_bench, tmp_path):
    checkpoint = tmp_path / "no-weights"  # passes validation (a GPT-2 config), fails when the model loads
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "gpt2"}')
    record = run_bench("stage=sft", "model=checkpoint", f"model.path={checkpoint}", TORCH_ADAMW)
    assert record["status"] == "error"
    error = record["stages"]["sft"]["error"]
    assert error["phase"] == "init" and "no-weights" in error["message"]


def test_fp16_zero0_defect_is_marked_and_the_opt_in_fix_scales_the_loss(run_bench):
    """DeepSpeed 0.19.8 never scales the fp16 ZeRO-0 loss (see adapters/dschat/fp16_zero0.py). As upstream:
    the engine's norm is the module's divided by the loss scale and clipping (at 1.0) never fires. With the
    fix: the two norms agree and clipping fires, since this model's gradient norm is above 1."""
    runs = {fix: run_bench("stage=sft", "zero=0", "precision=fp16", "steps=3", "warmup_steps=1",
                           f"framework.fix_fp16_zero0_loss_scale={fix}", name=f"fix-{fix}")
            for fix in ("false", "true")}
    for fix, record in runs.items():
        sft = record["stages"]["sft"]
        assert sft["status"] == "ok", sft["error"]
        (defect,) = sft["upstream_defects"]
        assert defect["id"] == "deepspeed-0.19.8-fp16-zero0-unscaled-loss"
        assert ("fixed by" in defect["handling"]) == (fix == "true")
    for step in runs["false"]["stages"]["sft"]["steps"]:
        module, engine, scale = step["grad_norm/actor"], step["engine_grad_norm/actor"], step["loss_scale/actor"]
        assert module > 1.0 and engine == pytest.approx(module / scale, rel=0.05), step
        assert step["clip_coef/actor"] == 1.0  # clipping never fires
    for step in runs["true"]["stages"]["sft"]["steps"]:
        module, engine = step["grad_norm/actor"], step["engine_grad_norm/actor"]
        assert engine == pytest.approx(module, rel=1e-3), step
        assert engine > 1.0 and step["clip_coef/actor"] == pytest.approx(engine, rel=1e-3)  # clipped to norm 1.0


@pytest.mark.slow  # orchestration (33 s): CI's minutes go to tests that compare measured figures
def test_a_rank_killed_by_sigkill_is_an_oom_and_the_other_rank_keeps_what_it_measured(run_bench, tmp_path):
    """The kernel's OOM killer sends SIGKILL: no result file, no traceback. The other rank fails on its next
    collective (or is stopped by torchrun's SIGTERM) and still writes what it measured."""
    import os
    import threading
    import time

    import psutil

    def kill_rank_one() -> None:
        deadline = time.time() + 240
        while time.time() < deadline:
            for proc in psutil.process_iter(["cmdline", "create_time"]):
                try:
                    cmdline = proc.info["cmdline"] or []
                    if "bench.run.worker" in cmdline and str(tmp_path) in " ".join(cmdline) \
                            and proc.environ().get("RANK") == "1" and time.time() - proc.info["create_time"] > 30:
                        os.kill(proc.pid, 9)
                        return
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            time.sleep(0.5)

    killer = threading.Thread(target=kill_rank_one, daemon=True)
    killer.start()
    record = run_bench("stage=sft", "launcher.nproc=2", "steps=100000", TORCH_ADAMW)
    killer.join(timeout=5)
    sft = record["stages"]["sft"]
    assert record["status"] == "oom" and sft["status"] == "oom", sft["error"]
    assert sft["error"]["killed_ranks"] == [1] and "OOM killer" in sft["error"]["message"]
    assert sft["ranks"] == 1 and sft["memory"]["phases"]["training"]["peak_bytes_per_rank"][0] > 0


@pytest.mark.slow  # 38 s: the slow tier since TRL's engine tests joined CI's 25 minutes (scripts/test_slow.sh)
def test_a_run_past_its_timeout_keeps_what_it_measured_marked_as_cut_short(run_bench, tmp_path):
    record = run_bench("stage=sft", "launcher.timeout_s=35", "steps=1000000", TORCH_ADAMW)
    sft = record["stages"]["sft"]
    assert record["status"] == "timeout" and "launcher.timeout_s=35" in sft["error"]["message"]
    (cut,) = sft["cut_short"]["ranks"]
    assert cut["signal"] == "SIGTERM" and cut["steps_done"] > 0
    assert len(sft["steps"]) == cut["steps_done"] and sft["memory"]["phases"]["training"]["peak_bytes"] > 0
    log = (tmp_path / "run" / "sft" / "worker.log").read_text()  # each rank's stacks, dumped before the kill
    assert "==== launcher.timeout_s reached: the stacks of pid" in log
    assert "thread 0x" in log.lower() and "bench/run/loop.py" in log


# What DeepSpeed, torchao, torch and transformers print on their own: it belongs in the stage logs
ENGINE_CHATTER = ("begin bf16_optimizer", "CPU Virtual Memory", "[WARNING]", "FutureWarning", "loss_type=None",
                  "Setting accelerator to CPU", "Failed to load", "built successfully", "UserWarning")


def test_readme_command_prints_a_table_and_writes_a_record(tmp_path):
    """The README's first command as a newcomer runs it: its terminal holds the progress lines, the table and
    the closing lines, none of the engines' chatter (which the stage logs keep); PPO starts from the cached
    prerequisite SFT model and scores with the prerequisite RM."""
    proc = run_tree([sys.executable, "-m", "bench.run", "framework=dschat", "zero=2", "precision=bf16",
                     f"output_root={tmp_path}"], timeout=900, check=False, cwd=REPO, text=True,
                    env=dict(os.environ, COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    terminal = proc.stdout + proc.stderr
    assert "peak" in proc.stdout and "MiB" in proc.stdout and "ppo: ok" in proc.stdout
    for chatter in ENGINE_CHATTER:
        assert chatter not in terminal, chatter
    (record_path,) = tmp_path.glob("runs/*/record.json")
    ppo_log = (record_path.parent / "ppo" / "worker.log").read_text()
    assert "begin bf16_optimizer" in ppo_log and "Setting accelerator to CPU" in ppo_log
    assert proc.stdout.splitlines()[-2:] == [f"record: {record_path}", f"report: python -m bench.report "
                                                                      f"{tmp_path / 'runs'}"]
    record = json.loads(record_path.read_text())
    assert record["status"] == "ok"
    sft = record["prerequisites"]["sft"]
    assert sft["status"] == "ok" and sft["loss_end"] < sft["loss_start"], sft
    assert not any("random base weights" in note for note in record["stages"]["ppo"]["notes"])
    # the trend worked a second way from the record's per-step rewards: 10 steps, windows of 3, statistics' stdev
    rewards = [step["reward"] for step in record["stages"]["ppo"]["steps"]]
    first, last = rewards[:3], rewards[-3:]
    change = statistics.mean(last) - statistics.mean(first)
    se = (statistics.stdev(first) ** 2 / 3 + statistics.stdev(last) ** 2 / 3) ** 0.5
    trend = record["stages"]["ppo"]["learning"]["reward_trend"]
    assert len(rewards) == 10 and trend["change"] == pytest.approx(change) and trend["change_se"] == pytest.approx(se)
    assert trend["verdict"] == ("within noise" if abs(change) <= 2 * se else "rose" if change > 0 else "fell")
    assert f"{change:+.3f}"[1:] in proc.stdout.replace("\n  ", " ")  # the terminal states the same change
    for stage in ("sft (prerequisite)", "rm (prerequisite)", "ppo "):
        assert stage in proc.stderr, stage  # each stage's progress line


@pytest.mark.slow  # model.path through DS-Chat runs in CI on a saved Llama checkpoint (tests/test_architectures.py)
def test_local_hugging_face_checkpoint_via_model_path(run_bench, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    checkpoint = tmp_path / "local-gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64)).save_pretrained(
        checkpoint)
    record = run_bench("stage=sft", "model=checkpoint", f"model.path={checkpoint}", "steps=4", "warmup_steps=1",
                       TORCH_ADAMW)
    sft = record["stages"]["sft"]
    assert sft["status"] == "ok", sft["error"]
    # the checkpoint's own size, worked by hand (not model=tiny's): token and position tables 256 x 64 + 64 x 64;
    # per block two layer norms 2 x 128, c_attn 64 x 192 + 192, attn c_proj 64 x 64 + 64, c_fc 64 x 256 + 256,
    # mlp c_proj 256 x 64 + 64 (49,984); the final norm 128; the LM head tied to the token table
    assert sft["params"]["actor"]["total"] == 16_384 + 4_096 + 2 * 49_984 + 128 == 120_576
