"""The ColossalChat adapter on the real colossalai Booster, tiny model, CPU (or GPU where present).

Each test is a real run in its own process tree; assertions are on what the record measured. The
first run on a fresh machine builds ColossalAI's CPU Adam kernel once (about 45 s, cached).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from bench.run.config import compose
from bench.run.data import SyntheticData
from bench.run.models import build_causal_lm
from bench.run.spec import spec_from_config
from tests.loss_scale_rules import assert_scale_halves_only_on_skipped_steps

CAI = "framework=colossalai"
ON_CPU = not torch.cuda.is_available()

pytestmark = pytest.mark.engine


def stage_statuses(record: dict) -> dict[str, str]:
    return {name: stage["status"] for name, stage in record["stages"].items()}


def errors(record: dict) -> dict:
    return {name: stage["error"] for name, stage in record["stages"].items() if stage["error"]}


def plain_pytorch_sft_losses(overrides: list[str], steps: int,
                             rate: Callable[[int], float] = lambda step: 1.0) -> list[float]:
    """The same model, data, seed and optimizer settings in a bare PyTorch loop; `rate`: the learning rate of
    each step over the base rate."""
    spec = spec_from_config(compose(overrides))
    options = spec.framework_options
    torch.manual_seed(spec.seed)
    model = build_causal_lm(spec.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.stage_lr("sft"), betas=tuple(options["betas"]),
                                  weight_decay=options["weight_decay"])
    data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed, rank=0)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = spec.stage_lr("sft") * rate(step)
        batch = data.sft(step)
        loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.skipif(not ON_CPU, reason="the ddp plugin on a GPU runs TF32/cuBLAS kernels: not bitwise a CPU loop")
def test_fp32_ddp_sft_losses_match_a_plain_pytorch_loop_and_the_reference(run_bench):
    overrides = [CAI, "stage=sft", "steps=6", "launcher.device=cpu", "precision=fp32"]
    record = run_bench(*overrides)
    sft = record["stages"]["sft"]
    assert sft["status"] == "ok", sft["error"]
    engine = sft["learning"]["loss_curve"]
    # train_sft.py's CosineAnnealingWarmupLR over the 6 steps to 0.1 x lr, no warm-up (int(0.025 x 6) = 0)
    plain = plain_pytorch_sft_losses(overrides, 6, lambda t: 0.1 + 0.9 * (1 + math.cos(math.pi * t / 6)) / 2)
    assert engine[-1] < engine[0]
    assert engine == pytest.approx(plain, abs=1e-4), (engine, plain)
    # the plain-PyTorch reference (framework=torch, a constant rate) with coati's ddp settings: weight decay 0.1,
    # no clipping
    reference = run_bench("framework=torch", *overrides[1:], "framework.weight_decay=0.1", "framework.grad_clip=0",
                          name="reference")
    constant = plain_pytorch_sft_losses(overrides, 6)
    assert reference["stages"]["sft"]["learning"]["loss_curve"] == pytest.approx(constant, abs=1e-4)
    notes = " ".join(sft["notes"])
    assert "TorchDDPPlugin" in notes and "HybridAdam" in notes and "P7" in notes


# Every plugin of the auto table once: 3d at tp=pp=1 (z0 bf16, with LoRA) and LowLevelZero 2 (bf16) in CI; ddp
# (z0 fp32: its SFT is the plain-loop test above; PPO on ddp is a harness extension) and LowLevelZero 1 (fp32
# with LoRA, the same plugin class at another stage) in the slow tier, to keep CI under its time budget.
# scripts/colossalai_matrix.sh runs the full cross product.
# CI runs the 3d plugin with LoRA; LowLevelZero's ZeRO-2 PPO runs in CI in tests/test_quantize.py (with its
# clipping read back) and its bucket in tests/test_comm_knobs.py, so the ZeRO-2 pipeline cell is in the slow tier
PIPELINE_CELLS = [pytest.param("0", "fp32", "0", marks=pytest.mark.slow), ("0", "bf16", "8"),
                  pytest.param("1", "fp32", "8", marks=pytest.mark.slow),
                  pytest.param("2", "bf16", "0", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("zero", "precision", "lora"), PIPELINE_CELLS)
def test_sft_rm_ppo_pipeline_runs_on_each_plugin(run_bench, zero, precision, lora):
    record = run_bench(CAI, "stage=pipeline", f"zero={zero}", f"precision={precision}", f"lora={lora}",
                       "steps=3", "warmup_steps=1")
    assert stage_statuses(record) == {"sft": "ok", "rm": "ok", "ppo": "ok"}, errors(record)
    expected = {"0": "ddp" if precision == "fp32" else "3d", "1": "zero1", "2": "zero2"}[zero]
    ppo = record["stages"]["ppo"]
    assert ppo["notes"][0].startswith(f"plugin: {expected} = ")
    assert set(ppo["params"]) == {"actor", "critic", "ref", "reward"}
    clip = 0.0 if expected == "ddp" else 1.0  # train_ppo.py's grad_clip 1.0, read back from the ZeRO optimizer
    assert ppo["engine_knobs"]["grad_clip"] == {"actor": clip, "critic": clip}
    assert ppo["engine_knobs"]["reward_normalize"] == {"mode": "none"}
    if expected.startswith("zero"):  # LowLevelZero's own 12 Mi-value bucket; no overlap on the CPU
        assert ppo["engine_knobs"]["reduce_bucket_size"] == dict.fromkeys(("actor", "critic"), 12 * 2**20)
        assert ppo["engine_knobs"]["overlap_comm"] == {"actor": False, "critic": False}
    state = ppo["model_state"]
    assert state["ref"]["optimizer_state_bytes_per_rank"] == [0] == state["reward"]["optimizer_state_bytes_per_rank"]
    assert state["actor"]["optimizer_state_bytes_per_rank"][0] > 0
    params = record["stages"]["sft"]["params"]["actor"]
    if lora == "0":
        assert params["trainable"] == params["total"]
    else:
        assert 0 < params["trainable"] < params["total"] / 5
    phases = ppo["memory"]["phases"]
    assert set(phases) == {"imports", "init", "onload", "generation", "experience", "offload", "training"}
    for stage in record["stages"].values():
        assert stage["stability"]["classification"] == "stable"


@pytest.mark.slow
def test_ppo_default_config_raises_the_reward_over_30_steps(run_bench):
    record = run_bench(CAI, "steps=30")
    ppo = record["stages"]["ppo"]
    learning = ppo["learning"]
    assert learning["reward_window_steps"] == 10
    assert learning["reward_end"] > learning["reward_start"], learning["reward_curve"]
    # The reference and reward models were shuttled every step; the time is its own phase.
    shuttle = ppo["throughput"]["phases"]["offload"]
    assert shuttle["time_s_per_step"] > 0 and "bytes_moved_per_step_rank0" in shuttle
    assert ppo["throughput"]["share_of_step_time"]["onload"] > 0


@pytest.mark.slow  # CI time: the 3d plugin stays in CI through the pp=2 x dp=2 test below
def test_tensor_parallel_two_ranks_runs_every_stage(run_bench):
    record = run_bench(CAI, "stage=pipeline", "plugin=3d", "tp=2", "precision=bf16", "launcher.nproc=2",
                       "steps=3", "warmup_steps=1")
    assert stage_statuses(record) == {"sft": "ok", "rm": "ok", "ppo": "ok"}, errors(record)
    sft = record["stages"]["sft"]
    assert sft["notes"][0].startswith("plugin: 3d = HybridParallelPlugin(") and "tp_size=2" in sft["notes"][0]
    # Each rank holds about half of the transformer's weights.
    held = sft["model_state"]["actor"]["param_bytes_per_rank"]
    full = sft["params"]["actor"]["total"] * 2  # bf16 working weights
    assert all(0.4 * full < h < 0.75 * full for h in held), (held, full)
    generation = record["stages"]["ppo"]["throughput"]["phases"]["generation"]
    # Both TP ranks work on one batch: the global rate counts it once.
    assert generation["tokens_per_s_global"] <= 1.01 * max(generation["tokens_per_s_per_rank"])


@pytest.mark.slow  # 2 ranks, SFT through the shardformer's Llama policy
def test_tensor_parallel_runs_a_llama_through_its_shardformer_policy(run_bench):
    """tiny-llama at tp=2: the Llama policy splits q, k, v, o, gate, up and down over 2 ranks (4 query and 2
    K/V heads: 2 and 1 per rank), the embedding and the untied head by vocabulary, and keeps the norms whole."""
    record = run_bench(CAI, "model=tiny-llama", "stage=sft", "plugin=3d", "tp=2", "precision=bf16",
                       "launcher.nproc=2", "steps=3", "warmup_steps=1")
    sft = record["stages"]["sft"]
    assert sft["status"] == "ok", sft["error"]
    assert "tp_size=2" in sft["notes"][0]
    # by hand: 4 blocks' linears 4 x 184,320 / 2 = 368,640, embedding and head 2 x 32,768 / 2 = 32,768, the
    # 9 norms whole 9 x 128 = 1,152: 402,560 parameters a rank, 805,120 bf16 bytes
    held = sft["model_state"]["actor"]["param_bytes_per_rank"]
    assert sft["params"]["actor"]["total"] == 803_968
    assert held == [805_120, 805_120], held


def test_pipeline_parallel_with_data_parallel_replicas_trains_sft(run_bench):
    """pp=2 x dp=2 on 4 ranks: both stages of a replica must draw the same batch (colossalai lays its mesh
    out as (dp, pp, tp), so the data-parallel rank comes from the plugin's own groups)."""
    record = run_bench(CAI, "stage=sft", "pp=2", "launcher.nproc=4", "steps=3", "warmup_steps=1", "precision=fp32")
    sft = record["stages"]["sft"]
    assert sft["status"] == "ok", sft["error"]
    curve = sft["learning"]["loss_curve"]
    assert curve[-1] < curve[0], curve
    assert "pp_size=2" in sft["notes"][0]
    layout = sft["layout_per_rank"]
    replicas: dict[int, set[int]] = {}
    for coordinates in layout:
        replicas.setdefault(coordinates["data_parallel_rank"], set()).add(coordinates["pp_rank"])
    assert replicas == {0: {0, 1}, 1: {0, 1}}, layout
    # Each stage holds part of the layers (embeddings and head sit with the first and last stage).
    held = sft["model_state"]["actor"]["param_bytes_per_rank"]
    assert max(held) < 0.8 * sft["params"]["actor"]["total"] * 4, held


@pytest.mark.skipif(not ON_CPU, reason="on a GPU Gemini is supported")
def test_zero3_is_unsupported_on_the_cpu_and_names_gemini(run_bench):
    record = run_bench(CAI, "stage=sft", "zero=3", "precision=bf16")
    assert record["status"] == "unsupported"
    sft = record["stages"]["sft"]
    assert sft["status"] == "unsupported"
    assert "GeminiPlugin" in sft["error"]["message"] and "CUDA" in sft["error"]["message"]


def test_zero2_on_two_ranks_halves_optimizer_state_per_rank(run_bench):
    common = (CAI, "stage=sft", "zero=2", "precision=bf16", "steps=3", "warmup_steps=1")
    one = run_bench(*common, name="one")
    two = run_bench(*common, "launcher.nproc=2", name="two")
    state_one = one["stages"]["sft"]["model_state"]["actor"]
    state_two = two["stages"]["sft"]["model_state"]["actor"]
    single = state_one["optimizer_state_bytes_per_rank"][0]
    assert single > 0
    for per_rank in state_two["optimizer_state_bytes_per_rank"]:
        assert per_rank == pytest.approx(single / 2, rel=0.02), (single, state_two)
    # ZeRO-2 shards optimizer state, not the working weights.
    assert state_two["param_bytes_per_rank"] == state_one["param_bytes_per_rank"] * 2


def test_fp16_zero2_tracks_the_dynamic_loss_scale(run_bench):
    record = run_bench(CAI, "stage=sft", "zero=2", "precision=fp16", "steps=4", "warmup_steps=1")
    sft = record["stages"]["sft"]
    assert sft["status"] == "ok", sft["error"]
    # coati's initial_scale (its yaml: 2**16, as ColossalChat passes)
    assert_scale_halves_only_on_skipped_steps(sft["stability"], "actor", 2.0**16)
