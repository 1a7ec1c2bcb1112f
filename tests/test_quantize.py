"""Frozen PPO roles in 8 or 4 bits (reference.quant, reward.quant): the replacement and its bytes worked by hand
on the tiny model (h = 128, 4 blocks, vocab 256), the memory model's account of it, the refusals, and real
runs of every adapter whose records hold what quantizing cost."""

from __future__ import annotations

import math

import pytest
import torch

from adapters.quantize import nf4_scaler_block, quantize_linears, quantize_reference
from bench.plan.predict import physics
from bench.plan.run_shape import quantized_weight_bytes
from bench.run.config import compose
from bench.run.models import build_causal_lm
from bench.run.spec import SpecError, UnsupportedError, spec_from_config

H, LAYERS, VOCAB = 128, 4, 256
BLOCK_WEIGHTS = 12 * H * H  # c_attn h x 3h, attention c_proj h x h, c_fc h x 4h, MLP c_proj 4h x h
BLOCK_ROWS = 9 * H  # their output rows: 3h + h + 4h + h


def _tiny_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_causal_lm(spec_from_config(compose(["stage=ppo"])).model).to(torch.bfloat16).eval()


@pytest.mark.parametrize("library, weight_type", [("torchao", "Int8Tensor"), ("bitsandbytes", "Int8Params")])
def test_int8_replaces_every_block_projection_and_leaves_the_tied_head(library: str, weight_type: str) -> None:
    lm = _tiny_lm()
    layers, before, after = quantize_linears(lm, "int8", torch.device("cpu"), library)
    assert layers == 4 * LAYERS
    assert before == LAYERS * BLOCK_WEIGHTS * 2  # bf16: 1,572,864
    # one byte a weight and one fp32 scale a row: 4 x (196,608 + 4,608) = 804,864
    assert after == LAYERS * (BLOCK_WEIGHTS + 4 * BLOCK_ROWS) == 804_864
    assert after == quantized_weight_bytes(LAYERS * BLOCK_WEIGHTS, LAYERS * BLOCK_ROWS, "int8", library)
    projections = [m for block in lm.transformer.h
                   for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)]
    assert {type(m.weight).__name__ for m in projections} == {weight_type}
    assert all(getattr(m.weight, "qdata", m.weight).dtype == torch.int8 for m in projections)
    assert lm.lm_head.weight is lm.transformer.wte.weight  # tied, in bf16: not quantized


@pytest.mark.parametrize("library, block_bytes", [
    # per block: c_attn 49,152 weights -> 24,576 code bytes + 768 absmax bytes + 3 factors of the 256-block
    # groups (bf16: 6 bytes) = 25,350; attention c_proj 16,384 -> 8,450; c_fc and MLP c_proj 65,536 -> 33,800
    # each: 101,400 a block
    ("torchao", 101_400),
    # bitsandbytes keeps the group factors in fp32: 25,356 + 8,452 + 2 x 33,808 = 101,424
    ("bitsandbytes", 101_424),
])
def test_nf4_packs_two_weights_a_byte_with_compressed_block_scales(library: str, block_bytes: int) -> None:
    lm = _tiny_lm()
    layers, _, after = quantize_linears(lm, "nf4", torch.device("cpu"), library)
    assert layers == 4 * LAYERS and after == LAYERS * block_bytes
    assert after == quantized_weight_bytes(LAYERS * BLOCK_WEIGHTS, LAYERS * BLOCK_ROWS, "nf4", library)


@pytest.mark.parametrize("blocks, scaler_block", [(768, 256), (1024, 256), (64, 64), (96, 96), (1000, 250)])
def test_nf4_groups_block_scales_by_the_largest_divisor_up_to_256(blocks: int, scaler_block: int) -> None:
    assert nf4_scaler_block(blocks) == scaler_block


def test_quantizing_the_reference_moves_its_log_probs_a_little() -> None:
    spec = spec_from_config(compose(["stage=ppo", "reference.quant=int8"]))
    lm = _tiny_lm()
    entry = quantize_reference(spec, lm, torch.device("cpu"), lambda ids, mask: lm(input_ids=ids,
                                                                                  attention_mask=mask).logits)
    assert entry.mode == "int8" and entry.layers == 4 * LAYERS
    # int8 with per-row scales: a deviation well under 1 % of the log-probs' size, but not none
    assert 0 < entry.mean_abs_deviation < 0.01 * entry.mean_abs_value
    assert math.isclose(entry.mean_abs_value, 5.56, rel_tol=0.05)  # ~ln(256): a random model's next token


@pytest.mark.parametrize("overrides, message", [
    (["stage=sft", "reference.quant=int8"], "stage=sft runs no PPO"),
    (["stage=ppo", "reward.quant=int4"], "choose one of: none, int8, nf4"),
    (["stage=ppo", "reward.quant=int8", "quant_library=gptq"], "choose one of: torchao, bitsandbytes"),
])
def test_quant_refuses_what_it_cannot_mean(overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        spec_from_config(compose(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["lora=8"], "adapters disabled"),  # the peft reference is the policy itself
    (["zero=3"], "ZeRO-3 cannot partition"),  # the hydra branch inside the partitioned policy
])
def test_trlx_refuses_a_reference_it_cannot_quantize(overrides: list[str], message: str) -> None:
    with pytest.raises(UnsupportedError, match=message):
        spec_from_config(compose(["framework=trlx", "stage=ppo", "reference.quant=int8", *overrides]))
    # the reward function's model is quantized whatever the reference is
    spec_from_config(compose(["framework=trlx", "stage=ppo", "reward.quant=int8", *overrides]))


def test_a_quantized_role_is_a_tagged_harness_extension() -> None:
    spec = spec_from_config(compose(["framework=dschat", "stage=ppo", "reward.quant=nf4"]))
    from adapters.dschat.options import DSChatOptions

    assert [e["knob"] for e in DSChatOptions.harness_extensions(spec)] == ["reward.quant=nf4"]


def _experience_params(framework: str, quant: str, zero: int = 2, ranks: int = 1) -> float:
    spec = spec_from_config(compose([f"framework={framework}", "stage=ppo", "precision=bf16", f"zero={zero}",
                                     f"launcher.nproc={ranks}", f"reference.quant={quant}", f"reward.quant={quant}"]))
    return physics(spec, "ppo")["experience"].params


# what int8 saves on one whole tiny model in bf16: 1,572,864 - 804,864
WHOLE_MODEL_SAVING = 768_000
# trlx's hydra branch: 2 blocks, 393,216 weights and 2,304 rows: 786,432 in bf16 - 402,432 (its untied LM head stays)
HYDRA_SAVING = 384_000


@pytest.mark.parametrize("framework, saving", [("dschat", 2 * WHOLE_MODEL_SAVING),
                                               ("colossalai", 2 * WHOLE_MODEL_SAVING),
                                               ("trlx", HYDRA_SAVING + WHOLE_MODEL_SAVING)])
def test_memory_models_count_the_quantized_roles(framework: str, saving: int) -> None:
    assert _experience_params(framework, "none") - _experience_params(framework, "int8") == saving


def test_a_quantized_role_is_whole_on_every_rank_even_at_zero3() -> None:
    # DS-Chat's ZeRO-3 shards its eval engines over the ranks; a quantized role is built whole outside DeepSpeed.
    # Tiny: 842,496 parameters (reward: + h = 842,624). Sharded over 2 ranks in bf16 each rank holds one byte a
    # parameter: 1,685,120. Whole in int8: the 786,432 block weights in 804,864 bytes, the rest in bf16:
    # 916,992 + 917,248 = 1,834,240 -- 149,120 more than two-way ZeRO-3 sharding.
    assert _experience_params("dschat", "int8", 3, 2) - _experience_params("dschat", "none", 3, 2) == 149_120


# DS-Chat in CI: the claims sweep's blocks K, N and Q run these knobs through it; the other adapters' runs are in
# the slow tier, for CI's time (their quantized roles are counted by hand above, without an engine)
@pytest.mark.engine
@pytest.mark.parametrize("framework", ["dschat", *(pytest.param(f, marks=pytest.mark.slow)
                                                   for f in ("colossalai", "trlx", "torch"))])
def test_every_adapter_runs_ppo_with_the_claims_knobs(run_bench, framework: str) -> None:
    # ZeRO-2 (trlx through DeepSpeed), int8 frozen roles; the same runs read a set grad_clip back from each
    # trained engine and z-score the RM's scores with the prerequisite RM stage's held-out statistics
    record = run_bench(f"framework={framework}", "stage=ppo", "steps=3", "warmup_steps=1", "precision=bf16",
                       "zero=2", "grad_clip=0.125", "reference.quant=int8", "reward.quant=int8",
                       "reward.normalize=zscore")
    ppo = record["stages"]["ppo"]
    assert record["status"] == "ok", ppo.get("error")
    heldout = record["prerequisites"]["rm"]["heldout_scores"]
    applied = ppo["engine_knobs"]["reward_normalize"]
    assert applied == {"mode": "zscore", **{k: heldout[k] for k in ("mean", "std", "count", "check_mean",
                                                                   "check_std")}}
    # z-scored with the first split's statistics, the second held-out split has mean about 0 and std about 1
    # (64 scores a split: the mean's standard error is about 1/8)
    assert abs(heldout["check_mean"]) < 0.4 and 0.7 < heldout["check_std"] < 1.3, heldout
    # the plain-PyTorch reference has no upstream, so nothing it does is an extension of one
    tagged = [e["knob"] for e in record["harness_extension"]]
    assert ("reward.normalize=zscore" in tagged) == (framework != "torch")
    trained = ["actor"] if framework == "trlx" else ["actor", "critic"]
    assert ppo["engine_knobs"]["grad_clip"] == dict.fromkeys(trained, 0.125)
    quantized = ppo["quantized"]
    assert set(quantized) == {"ref", "reward"}
    for role, entry in quantized.items():
        assert entry["layers"] == (2 * 4 if (framework, role) == ("trlx", "ref") else 4 * LAYERS)
        assert entry["weight_bytes_after"] < entry["weight_bytes_before"]
        assert entry["library"].startswith("torchao ")  # the default
        # a bf16 score of ~2 moves in steps of 1/128: int8's ~0.1 % can leave all four scores where they were
        assert 0 <= entry["mean_abs_deviation"] < 0.05 * entry["mean_abs_value"]
    assert quantized["ref"]["mean_abs_deviation"] > 0  # log-probs in fp32 over every position
    assert record["config"]["reference"]["quant"] == "int8"
    assert any("int8" in note for note in ppo["notes"])
