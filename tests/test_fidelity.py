"""Each adapter keeps alive what its framework keeps alive, on a realistic vocabulary (GLM's 50,304).

One real PPO step per framework, 64 new tokens; the worker's live-tensor census (a forward pre-hook and
`gc`, first step) says which tensor storages exist when upstream's experience maker calls the reward
model. The expected lifetimes are the fidelity tables of docs/frameworks/:
- DS-Chat: actor and reference logits and both KV caches (generate_experience keeps `output` and
  `output_ref` through the reward and critic forwards), in fp16.
- ColossalChat: the joined full-batch logits of actor and reference, no KV cache (use_cache=False), no
  per-chunk logits (freed by the join).
- trlx: the reward function runs first, before any logits exist; at the reference's call the policy's
  logits, KV cache and every hidden state are alive (`logits, *_, values = self.model(...)`).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

VOCAB, HIDDEN, LAYERS, BATCH, PROMPT, ANSWER = 50304, 64, 3, 2, 16, 64
COMMON = ("stage=ppo", f"model.vocab={VOCAB}", f"model.hidden={HIDDEN}", f"model.layers={LAYERS}", "model.heads=2",
          "model.positions=128", f"prompt_len={PROMPT}", f"answer_len={ANSWER}", f"batch={BATCH}", "steps=1",
          "warmup_steps=0", "stage_steps.rm=2")


def groups_at(record: dict, point: str) -> list[dict]:
    live = record["stages"]["ppo"]["live_tensors"]
    assert point in live, f"no census at {point}: {sorted(live)}"
    return live[point]["groups"]


def logits(groups: list[dict]) -> list[dict]:
    return [g for g in groups if g["shape"][-1] == VOCAB]


def fused_qkv(groups: list[dict], width: int) -> int:
    """Storages of one layer's fused QKV projection output, [B * T, 3H]: what a returned KV cache keeps."""
    return sum(g["count"] for g in groups if g["shape"] == [BATCH * width, 3 * HIDDEN])


def test_dschat_keeps_both_outputs_with_their_kv_caches_through_the_reward_call(run_bench):
    record = run_bench("framework=dschat", *COMMON)
    assert record["status"] == "ok", record["error"]
    groups = groups_at(record, "reward_call")
    big = logits(groups)
    assert len(big) == 1 and big[0]["count"] == 2 and big[0]["dtype"] == "float16", big  # actor and reference
    width = big[0]["shape"][1]
    assert big[0]["shape"] == [BATCH, width, VOCAB] and width >= PROMPT + 64
    assert fused_qkv(groups, width) == 2 * LAYERS  # the KV cache of every layer of both models
    dtypes = record["stages"]["ppo"]["computation_dtypes"]
    assert dtypes["experience/log_probs"] == "torch.float16"  # no upcast without --compute_fp32_loss
    assert dtypes["update/log_probs"] == "torch.float16"


def test_colossalai_keeps_the_joined_logits_and_no_cache_through_the_reward_call(run_bench):
    record = run_bench("framework=colossalai", *COMMON, "framework.ppo.logits_forward_batch_size=1")
    assert record["status"] == "ok", record["error"]
    groups = groups_at(record, "reward_call")
    big = logits(groups)
    # only the joined [B, T, V] logits of actor and reference: the per-chunk [1, T, V] ones are gone
    assert len(big) == 1 and big[0]["count"] == 2 and big[0]["dtype"] == "float16", big
    width = big[0]["shape"][1]
    assert big[0]["shape"] == [BATCH, width, VOCAB] and width == PROMPT + ANSWER  # padded to max_length
    assert fused_qkv(groups, width) == 0 and fused_qkv(groups, width // BATCH) == 0  # use_cache=False


def test_trlx_scores_before_any_logits_exist_and_keeps_the_policy_outputs_through_the_reference(run_bench):
    record = run_bench("framework=trlx", *COMMON, "precision=bf16", "framework.reward_batch_size=1")
    assert record["status"] == "ok", record["error"]
    assert logits(groups_at(record, "reward_call")) == []  # the reward function runs first
    groups = groups_at(record, "reference_call")
    big = logits(groups)
    # the policy's logits and those of forward_hydra's own trunk pass, as accelerate returns them (fp32)
    assert len(big) == 1 and big[0]["count"] == 2 and big[0]["dtype"] == "float32", big
    width = big[0]["shape"][1]
    assert PROMPT < width <= PROMPT + ANSWER  # the batch's longest answer, no padding to prompt + answer
    hidden = sum(g["count"] for g in groups if g["shape"] == [BATCH, width, HIDDEN])
    cache = sum(g["count"] for g in groups if g["shape"] == [BATCH, 2, width, HIDDEN // 2])
    assert hidden == 2 * (LAYERS + 1)  # every hidden state of both trunk passes
    assert cache == 2 * 2 * LAYERS  # K and V of every layer of both passes (fp32 copies made by accelerate)
    stage = record["stages"]["ppo"]
    assert stage["computation_dtypes"]["experience/reward_score"] == "torch.bfloat16"  # the run's precision
    breakdown = stage["memory"]["phases"]["experience"]["breakdown_bytes_per_rank"][0]
    reward = stage["model_state"]["reward_fn"]["param_bytes_per_rank"][0]
    assert breakdown["reward_fn_bytes"] == reward > 0
