"""The plain-PyTorch reference (framework=torch): real runs on the tiny model, every layout it maps ZeRO to."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.adapter import fold_lora
from adapters.reference.models import pairwise_loss
from bench.run.config import compose
from bench.run.spec import UnsupportedError, spec_from_config

REF = "framework=torch"

pytestmark = pytest.mark.engine


def _statuses(record: dict) -> dict[str, str]:
    return {name: stage["status"] for name, stage in record["stages"].items()}


def _errors(record: dict) -> dict:
    return {name: stage["error"] for name, stage in record["stages"].items() if stage["error"]}


# FSDP2 per block (ZeRO-3) in bf16 with LoRA in CI; DDP + ZeroRedundancyOptimizer in fp32, DDP with fp16
# (GradScaler) and FSDP2 without resharding (ZeRO-2) in the slow tier, to keep CI under its time budget. The
# fp32 SFT loss curve against coati's ddp is in tests/test_colossalai.py (one coati run serves both checks).
LAYOUT_CELLS = [("3", "bf16", "8"), pytest.param("1", "fp32", "0", marks=pytest.mark.slow),
                pytest.param("0", "fp16", "0", marks=pytest.mark.slow),
                pytest.param("2", "bf16", "0", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("zero", "precision", "lora"), LAYOUT_CELLS)
def test_sft_rm_ppo_pipeline_runs_on_each_layout(run_bench, zero, precision, lora):
    steps = "steps=8" if precision == "fp16" else "steps=3"  # GradScaler calibrates its 2**16 in the first steps
    record = run_bench(REF, "stage=pipeline", f"zero={zero}", f"precision={precision}", f"lora={lora}",
                       "launcher.nproc=2", steps, "warmup_steps=1")
    assert _statuses(record) == {"sft": "ok", "rm": "ok", "ppo": "ok"}, _errors(record)
    ppo = record["stages"]["ppo"]
    layout = {"0": "layout: DDP;", "1": "layout: DDP + ZeroRedundancyOptimizer;",
              "2": "layout: FSDP2 fully_shard(reshard_after_forward=False);", "3": "layout: FSDP2 fully_shard;"}
    assert any(note.startswith(layout[zero]) for note in ppo["notes"]), ppo["notes"]
    assert set(ppo["params"]) == {"actor", "critic", "ref", "reward"}
    lora_layout = {"targets": ["q", "k", "v", "o", "up", "down"], "other": [], "alpha": 32.0}  # peft's
    # PPO steps of one rollout each: a micro-batch per step and trained role, and an optimizer step (the torch
    # optimizer's own count) for each but those GradScaler skipped on overflow (the harness's per-step reading)
    n = 8 if precision == "fp16" else 3
    micro = dict.fromkeys(("actor", "critic"), n)
    skipped = ppo["stability"]["overflow_skipped_steps"]
    stepped = {role: n - skipped.get(role, 0) for role in micro}
    assert ppo["engine_knobs"] == {"grad_clip": {"actor": 1.0, "critic": 1.0}, "reward_normalize": {"mode": "none"},
                                   "accumulation": {"micro_batches": micro, "optimizer_steps": stepped},
                                   **({"lora": dict.fromkeys(("actor", "critic"), lora_layout)} if lora != "0" else {})}
    state = ppo["model_state"]
    assert state["ref"]["optimizer_state_bytes_per_rank"] == [0, 0] == state["reward"]["optimizer_state_bytes_per_rank"]
    actor = record["stages"]["sft"]["params"]["actor"]
    if lora == "0":
        assert actor["trainable"] == actor["total"]
    else:
        assert 0 < actor["trainable"] < actor["total"] / 5
    sft_state = record["stages"]["sft"]["model_state"]["actor"]
    whole = 4 * actor["total"]  # fp32 parameters: the reference keeps its trained weights in fp32
    if zero in ("2", "3"):  # FSDP2 shards the parameters between steps at both: each rank holds about half
        assert all(0.4 * whole < held < 0.6 * whole for held in sft_state["param_bytes_per_rank"]), sft_state
    else:
        assert sft_state["param_bytes_per_rank"] == [whole, whole]
    if zero in ("1", "3"):  # Adam's two moments, sharded: about 8 bytes per trained parameter over 2 ranks
        assert all(0.4 * 8 * actor["trainable"] < o < 0.6 * 8 * actor["trainable"]
                   for o in sft_state["optimizer_state_bytes_per_rank"]), sft_state
    for stage in record["stages"].values():
        if precision != "fp16":
            assert stage["stability"]["classification"] == "stable"
    if precision == "fp16":  # GradScaler at work: overflowed steps skipped and the scale lowered, nothing diverged
        # (the tiny PPO critic overflows often at 2**16: skip-storm by the rules, as coati's fp16 critic does)
        assert ppo["stability"]["classification"] != "diverged"
        assert ppo["stability"]["loss_scale_min"] < 2.0**16


@pytest.mark.parametrize(("overrides", "message"), [(("zero=2", "precision=fp16"), "GradScaler"),
                                                     (("checkpoint.every=2",), "mid-stage checkpoints"),
                                                     (("offload=true", "zero=3"), "no CPU offload")])
def test_what_the_reference_cannot_do_is_refused_before_launch(overrides, message):
    with pytest.raises(UnsupportedError, match=message):
        spec_from_config(compose([REF, *overrides]))


@pytest.mark.slow
def test_ppo_raises_the_reward_over_30_steps(run_bench):
    record = run_bench(REF, "steps=30")
    learning = record["stages"]["ppo"]["learning"]
    assert learning["reward_end"] > learning["reward_start"], learning["reward_curve"]


def test_lora_folds_into_the_plain_weights_as_peft_merges_it():
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj", "c_fc"],
                                       fan_in_fan_out=True), model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # peft starts B at zero; a trained adapter is not
    ids = torch.arange(6)[None]
    expected = model.eval()(ids).logits
    folded = fold_lora(model.state_dict(), scaling=4 / 2)
    assert set(folded) == set(plain)
    fresh = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    fresh.load_state_dict(folded)
    assert torch.allclose(fresh.eval()(ids).logits, expected, atol=1e-5)


def test_the_rm_loss_spans_the_tokens_from_where_the_pair_differs_to_the_later_end():
    chosen = torch.tensor([[5, 6, 7, 1, 0], [5, 6, 1, 0, 0]])
    rejected = torch.tensor([[5, 6, 8, 9, 1], [5, 6, 1, 0, 0]])  # the second pair is one sequence twice
    chosen_mask, rejected_mask = (chosen != 0).long(), (rejected != 0).long()
    # pair 1: positions 2..4 (differs at 2, rejected ends after 5 tokens) with margins 1, 2, 3 and -100 outside
    chosen_v = torch.tensor([[-100.0, -100.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    rejected_v = torch.zeros(2, 5)
    # pair 2: only its last real token (position 2), margin 0
    expected = (sum(-torch.nn.functional.logsigmoid(torch.tensor(m)) for m in (1.0, 2.0, 3.0)) / 3
                - torch.nn.functional.logsigmoid(torch.tensor(0.0))) / 2
    loss = pairwise_loss(chosen, rejected, chosen_v, rejected_v, chosen_mask, rejected_mask)
    assert torch.isclose(loss, expected)


def test_zero1_steps_are_counted_from_the_local_optimizer_that_holds_them(tmp_path):
    """ZeroRedundancyOptimizer keeps its shard's state, and so the step counts, in its local optimizer (`.optim`);
    its own `state` stays empty. Stepped twice, the reference's ZeRO-1 has taken two steps, not none."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from adapters.base import optimizer_step_count

    assert not dist.is_initialized(), "a process group left by another test in this worker"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        layer = torch.nn.Linear(4, 2)
        zero1 = ZeroRedundancyOptimizer(layer.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        assert optimizer_step_count(zero1) == 0
        for _ in range(2):
            layer(torch.ones(3, 4)).sum().backward()
            zero1.step()
        assert not zero1.state  # what made the count read 0 before it looked inside
        assert optimizer_step_count(zero1) == 2
    finally:
        dist.destroy_process_group()
