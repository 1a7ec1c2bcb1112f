"""The frameworks' memory models carried to a GPU, against values worked by hand: what a GPU's allocator holds
where a CPU host's retained heap differs (ColossalChat's update), what ZeRO-Offload moves to the host (DS-Chat's
gradient partitions), and a critic of its own model (DS-Chat's --critic_model_name_or_path)."""

from __future__ import annotations

import pytest

from adapters.colossalai.memory import predict as colossal
from adapters.dschat.memory import predict as dschat
from bench.plan.plan_file import arch_of
from bench.plan.run_shape import RunShape, build_transient

# Llama-2-7B (config.json: 32 x 4096, SwiGLU 11,008, vocabulary 32,000, untied head): 6,738,415,616 parameters, of
# which the LM head is 32,000 x 4,096 = 131,072,000
LLAMA2_7B = 6_738_415_616
LLAMA2_7B_BACKBONE = LLAMA2_7B - 32_000 * 4_096


def gpt2_params(hidden: int, layers: int, vocab: int, positions: int) -> int:
    """A GPT-2-shaped model with a tied head: embeddings, positions, 12h^2 + 13h a block, the final norm."""
    return vocab * hidden + positions * hidden + layers * (12 * hidden**2 + 13 * hidden) + 2 * hidden


def shape(model: str | dict, **kw) -> RunShape:
    values = dict(stage="ppo", precision="bf16", zero=0, lora=0, batch=1, prompt_len=1536, answer_len=512,
                  data_parallel=1, tp=1, pp=1, grad_ckpt=True, offload=False, options={}, device="cuda")
    values.update(kw)
    return RunShape(arch=arch_of(model)[1], **values)


def test_the_model_counts_llama2_7b_as_published():
    assert arch_of("llama2-7b")[1].total_params == LLAMA2_7B


def test_colossalchat_updates_with_its_inference_models_on_the_host_and_fp32_gradients_one_role_at_a_time():
    """tp 8, ZeRO-0, bf16: actor (P) and critic (backbone + a value head h -> 1, Pc) hold 14 bytes a parameter
    over tp (bf16 weights, fp32 master, two moments); reference (P) and reward (Pc) 2 bytes, on the host for the
    update. The update peaks at the actor's step: its fp32 gradients (4 bytes) beside the critic's bf16 ones
    (2 bytes), the actor's bf16 ones freed as they were copied."""
    p, pc = LLAMA2_7B, LLAMA2_7B_BACKBONE + 4096 + 1
    phases = colossal(shape("llama2-7b", tp=8, options={"ppo": {"offload_inference_models": True}}))
    assert phases["offload"].device == pytest.approx(14 * (p + pc) / 8)
    assert phases["offload"].host == pytest.approx(2 * (p + pc) / 8)
    assert phases["onload"].device == pytest.approx(16 * (p + pc) / 8)  # back on the GPU for experience
    assert phases["training"].grads == pytest.approx((4 * p + 2 * pc) / 8)
    # without the shuttle the frozen models stay; on the CPU host every transient of the update adds up
    kept = colossal(shape("llama2-7b", tp=8, options={"ppo": {"offload_inference_models": False}}))
    assert kept["offload"].device == pytest.approx(16 * (p + pc) / 8) and kept["offload"].host == 0
    cpu = colossal(shape("llama2-7b", tp=8, device="cpu"))
    assert cpu["training"].grads == pytest.approx(6 * (p + pc) / 8)


def test_colossalchat_offload_keeps_the_masters_on_the_host_from_the_start():
    """zero2_cpu on 2 ranks: before the first step HybridAdam has made no moments, and the fp32 master partitions
    (4 bytes a trained parameter over 2 ranks) sit on the host beside the reward's fp32 build; nothing of the
    optimizer is on the GPU."""
    s = shape("llama2-7b", zero=2, data_parallel=2, offload=True)
    init = colossal(s)["init"]
    p, pc = LLAMA2_7B, LLAMA2_7B_BACKBONE + 4096 + 1
    assert init.optimizer == 0 and init.device > 0
    assert init.host - build_transient(s, pc).host == pytest.approx(4 * (p + pc) / 2)


def test_ds_chat_zero3_offload_keeps_the_gradient_partitions_on_the_host():
    """ZeRO-3 with --offload on one GPU, fp16: per trained model (actor P, critic backbone + bias-free head Pc) the
    host holds Adam's fp32 master and moments (12 bytes), the fp16 weight partition (2), the fp16 gradient
    partition DeepSpeed allocates on the optimizer's device (2) and the step's fp32 gradients (4): 20 bytes a
    parameter. The GPU keeps no gradient tensor, only the reduce bucket."""
    p, pc = LLAMA2_7B, LLAMA2_7B_BACKBONE + 4096
    phases = dschat(shape("llama2-7b", zero=3, offload=True, precision="fp16", prompt_len=256, answer_len=256))
    for phase in ("generation", "experience", "training"):
        assert phases[phase].host == pytest.approx(20 * (p + pc)), phase
    assert phases["training"].grads == 0


def test_ds_chat_builds_critic_and_reward_from_the_critic_model():
    """OPT-13B actor, OPT-350m critic (GPT-2-shaped, tied heads), ZeRO-0, fp16, full fine-tuning: the weights
    resident through generation are two fp16 copies of the actor (actor, reference) and two of the critic's
    backbone with its bias-free value head (critic, reward)."""
    opt13 = {"name": "opt-13b", "arch": "gpt2", "hidden": 5120, "layers": 40, "heads": 40, "vocab": 50272,
             "positions": 2048}
    opt350 = {"name": "opt-350m", "arch": "gpt2", "hidden": 1024, "layers": 24, "heads": 16, "vocab": 50272,
              "positions": 2048}
    s = shape(opt13, precision="fp16", prompt_len=256, answer_len=256, critic_arch=arch_of(opt350)[1])
    actor, critic = gpt2_params(5120, 40, 50272, 2048), gpt2_params(1024, 24, 50272, 2048) + 1024
    assert dschat(s)["generation"].params == pytest.approx(2 * 2 * (actor + critic))
    # without a critic model of its own, critic and reward are OPT-13B's backbone (its whole tied model) and head
    same = dschat(shape(opt13, precision="fp16", prompt_len=256, answer_len=256))
    assert same["generation"].params == pytest.approx(2 * 2 * (actor + actor + 5120))
