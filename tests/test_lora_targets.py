"""lora_targets and lora_alpha: the spec's checks, each framework's selection mechanism on real modules, the
memory models' parameter counts per target set (values worked by hand), the read-back from built engines,
and the A15 claim rule."""

from __future__ import annotations

import pytest

from adapters.colossalai import memory as coati
from adapters.colossalai.lora_match import matched_layers
from adapters.dschat import memory as dschat
from adapters.dschat.options import DSChatOptions, lora_module_names
from adapters.lora_targets import lora_layout
from adapters.trlx import memory as trlx
from bench.plan.physics import Arch
from bench.plan.run_shape import RunShape
from bench.report.claims import CONTRADICTED, NOT_MEASURED, SUPPORTED, lora_practice
from bench.run.config import compose
from bench.run.models import build_causal_lm
from bench.run.spec import SpecError, spec_from_config
from tests.test_lora_rules import MODEL

GLM_BASE = Arch(hidden=768, layers=12, heads=12, vocab=50304, positions=1024)


def spec(*overrides: str):
    return spec_from_config(compose(["framework=dschat", "stage=sft", *overrides]))


def test_spec_resolves_sets_and_lists_and_names_bad_values() -> None:
    # GPT-2 (the GLM stand-in): no gate map, q/k/v fused in c_attn
    assert spec("lora=4", "lora_targets=all").lora_target_set == ("q", "k", "v", "o", "up", "down")
    assert spec("lora=4", "lora_targets=attention").lora_target_set == ("q", "k", "v", "o")
    assert spec("lora=4", "lora_targets=mlp").lora_target_set == ("up", "down")
    assert spec("lora=4", "lora_targets=[mlp_out,qkv]").lora_target_set == ("q", "k", "v", "down")  # block order
    assert spec("lora=4", "lora_targets=[mlp_in]").lora_target_set == ("up",)
    assert spec("lora=4").lora_target_set is None  # the framework's default
    assert spec("lora=4", "lora_alpha=8").lora_alpha_or(32.0) == 8.0
    assert spec("lora=4").lora_alpha_or(32.0) == 32.0
    # Llama: seven separate maps; GLM-4: gate and up fused
    assert spec("model=tiny-llama", "lora=4", "lora_targets=[v,q]").lora_target_set == ("q", "v")
    assert spec("model=tiny-llama", "lora=4", "lora_targets=all").lora_target_set == (
        "q", "k", "v", "o", "gate", "up", "down")
    assert spec("model=tiny-glm4", "lora=4", "lora_targets=[mlp_in]").lora_target_set == ("gate", "up")
    for bad, message in [("lora_targets=mlps", "choose one of: all, attention, mlp, qkv"),
                         ("lora_targets=[qkv,gate]", "the gpt2 family has no 'gate' map"),
                         ("lora_targets=[q,v]", r"computes q, k, v in one module \(attn.c_attn\)"),
                         ("lora_targets=[qkv,q]", "names a layer twice"),
                         ("lora_targets=[w]", "'w' is not allowed"),
                         ("lora_targets=[]", "non-empty list"),
                         ("lora_alpha=0", "lora_alpha=0 must be a positive number")]:
        with pytest.raises(SpecError, match=message):
            spec("lora=4", bad)
    with pytest.raises(SpecError, match=r"computes gate, up in one module \(mlp.gate_up_proj\)"):
        spec("model=tiny-glm4", "lora=4", "lora_targets=[gate]")
    with pytest.raises(SpecError, match="lora=0 trains without them"):
        spec("lora_targets=qkv")


def test_lora_parameters_per_target_set_by_hand() -> None:
    # glm-base, h 768, 12 blocks, rank 64: r * h * 12 * (d_in + d_out in h): c_attn 4, attn c_proj 2, c_fc 5,
    # mlp c_proj 5
    assert GLM_BASE.lora_params(64) == 9_437_184  # 16 r h per block
    assert GLM_BASE.lora_params(64, ("q", "k", "v")) == 2_359_296
    assert GLM_BASE.lora_params(64, ("o", "down")) == 64 * 768 * 12 * 7 == 4_128_768
    assert GLM_BASE.block_weights(("q", "k", "v")) == 768 ** 2 * 12 * 3 == 21_233_664
    assert GLM_BASE.block_weights() == 84_934_656  # 12 h^2 per block
    assert GLM_BASE.linear_inputs(("q", "k", "v", "down")) == 5 and GLM_BASE.linear_inputs() == 7


def test_dschat_takes_one_substring_where_one_selects_the_set() -> None:
    everything = ("q", "k", "v", "o", "up", "down")
    assert lora_module_names(None, "h.") == ("h.",) == lora_module_names(everything, "h.")
    assert lora_module_names(("q", "k", "v"), "h.") == ("attn.c_attn",)
    assert lora_module_names(("q", "k", "v", "o"), "h.") == ("attn.",)
    assert lora_module_names(("up", "down"), "h.") == ("mlp.",)
    assert lora_module_names(("q", "k", "v", "down"), "h.") == ("attn.c_attn", "mlp.c_proj")  # a harness extension
    # Llama-style: the scripts' "layers." for all, the attention and MLP prefixes, one module's own name
    assert lora_module_names(None, "layers.", "llama") == ("layers.",)
    assert lora_module_names(("q", "k", "v", "o"), "layers.", "llama") == ("self_attn.",)
    assert lora_module_names(("gate", "up", "down"), "layers.", "qwen2") == ("mlp.",)
    assert lora_module_names(("q",), "layers.", "llama") == ("self_attn.q_proj",)
    assert lora_module_names(("q", "v"), "layers.", "llama") == ("self_attn.q_proj", "self_attn.v_proj")
    assert lora_module_names(("gate", "up"), "layers.", "glm") == ("mlp.gate_up_proj",)
    assert DSChatOptions().module_name("llama") == "layers." and DSChatOptions().module_name("gpt2") == "h."
    tagged = [e["knob"] for e in DSChatOptions.harness_extensions(spec("lora=4", "lora_targets=[qkv,mlp_out]",
                                                                       "lora_alpha=2"))]
    assert tagged == ["lora_targets=('qkv', 'mlp_out')", "lora_alpha=2"]
    assert DSChatOptions.harness_extensions(spec("lora=4", "lora_targets=attention")) == []


def test_coati_matches_a_childs_own_name() -> None:
    # GPT-2 names the attention output and the MLP output both c_proj: either target converts both
    assert matched_layers(("q", "k", "v")) == ("q", "k", "v")
    assert matched_layers(("o",)) == ("o", "down")
    assert matched_layers(("q", "k", "v", "up")) == ("q", "k", "v", "up")
    # Llama's names are distinct: the rule converts exactly the targets
    assert matched_layers(("o",), "llama") == ("o",)
    assert matched_layers(("q", "v"), "qwen2") == ("q", "v")


def shape(framework: str, stage: str, *overrides: str, model: str = "glm-base") -> RunShape:
    config = compose([f"framework={framework}", f"stage={stage}", f"model={model}", "lora=64", *overrides])
    return RunShape.from_spec(spec_from_config(config), stage)


def test_memory_models_count_lora_per_target_set_by_hand() -> None:
    base = 108_943_872  # glm-base, the tied LM head once
    # DS-Chat, q/k/v only: + 2,359,296 adapters; only the 21,233,664 qkv weights freeze, the rest trains
    assert dschat.role_params(shape("dschat", "sft", "lora_targets=qkv"), "actor", 64) == (
        base + 2_359_296, base + 2_359_296 - 21_233_664)
    # coati, q/k/v only: the adapters alone train; the 3h bias per block is dropped; no embedding or head LoRA
    assert coati.role_params(shape("colossalai", "sft", "lora_targets=qkv"), "actor", 64) == (
        base + 2_359_296 - 27_648, 2_359_296)
    # coati, attention: c_proj matches the MLP's too -> qkv + attn_out + mlp_out = 11 r h per block
    assert coati.role_params(shape("colossalai", "sft", "lora_targets=attention"), "actor", 64) == (
        base + 6_488_064 - 46_080, 6_488_064)
    # trlx PPO, all four: + 9,437,184 adapters and the 1,182,721 value head (h -> 2h -> 1), all trained
    assert trlx.role_params(shape("trlx", "ppo", "lora_targets=all"), "ppo", 64) == (
        base + 10_619_905, 10_619_905)


def test_memory_models_count_a_llama_model_by_hand() -> None:
    # llama-base: 12 blocks of h 768, 4 K/V heads of 64 (kv width 256), SwiGLU 2048, vocab 32,000, untied
    base, head = 124_668_672, 32_000 * 768
    # rank 64 on all seven maps, per block: q, o r(768 + 768) = 98,304 each; k, v r(768 + 256) = 65,536 each;
    # gate, up, down r(768 + 2048) = 180,224 each: 868,352, x 12 = 10,420,224; their weights 6,291,456 a block
    adapters, weights = 10_420_224, 75_497_472
    assert dschat.role_params(shape("dschat", "sft", model="llama-base"), "actor", 64) == (
        base + adapters, base + adapters - weights)
    # DS-Chat's critic: the backbone (no LM head) and a bias-free value head, LoRA off (critic_lora_dim 0)
    assert dschat.role_params(shape("dschat", "ppo", model="llama-base"), "critic", 0) == (base - head + 768,) * 2
    # coati: + the embedding's r(32,000 + 768) and the LM head's r(768 + 32,000) = 2,097,152 each; no biases
    assert coati.role_params(shape("colossalai", "sft", model="llama-base"), "actor", 64) == (
        base + adapters + 2 * 2_097_152, adapters + 2 * 2_097_152)
    # trlx, peft's Llama default q and v: 12 x (98,304 + 65,536) = 1,966,080
    assert trlx.role_params(shape("trlx", "sft", model="llama-base"), "sft", 64) == (base + 1_966_080, 1_966_080)
    # trlx PPO without LoRA, hydra of 2: the top 2 blocks (6,292,992 each), the final norm, the untied head
    # (24,576,000) and the value head (1,182,721) train; the branch copies 2 blocks, the norm and the head
    no_lora = shape("trlx", "ppo", "lora=0", model="llama-base")
    trained = 2 * 6_292_992 + 768 + head + 1_182_721
    assert trlx.role_params(no_lora, "ppo", 0) == (base + 2 * 6_292_992 + 768 + head + 1_182_721, trained)


def test_lora_layout_reads_each_implementation() -> None:
    from adapters.colossalai.lora import convert_to_lora as coati_convert
    from adapters.colossalai.options import LoraOptions
    from adapters.dschat.lora import convert_to_lora as dschat_convert

    ds = build_causal_lm(MODEL)
    dschat_convert(ds, lora_module_names(("q", "k", "v", "o"), "h."), 4, lora_scaling=2.0)
    co = build_causal_lm(MODEL)
    coati_convert(co, 4, LoraOptions(alpha=8.0), target_modules=["mlp.c_fc"])
    full = build_causal_lm(MODEL)
    coati_convert(full, 4, LoraOptions(alpha=8.0))
    assert lora_layout({"ds": ds, "coati": co, "full": full}) == {
        "ds": {"targets": ["q", "k", "v", "o"], "other": [], "alpha": 2.0},
        "coati": {"targets": ["up"], "other": [], "alpha": 32.0},  # lora_alpha never reaches a linear layer
        "full": {"targets": ["q", "k", "v", "o", "up", "down"], "other": ["lm_head", "wpe", "wte"],
                 "alpha": 32.0}}


EXPECTED_LAYOUT = {  # lora=4 lora_targets=[qkv,mlp_out] lora_alpha=2, RM stage
    "dschat": {"targets": ["q", "k", "v", "down"], "other": [], "alpha": 2.0},
    "colossalai": {"targets": ["q", "k", "v", "o", "down"], "other": [], "alpha": 32.0},
    "trlx": {"targets": ["q", "k", "v", "down"], "other": [], "alpha": 2.0},
    "torch": {"targets": ["q", "k", "v", "down"], "other": [], "alpha": 2.0},
}
MEMORY_MODELS = {"dschat": (dschat, "reward"), "colossalai": (coati, "reward"), "trlx": (trlx, "rm")}


@pytest.mark.engine
@pytest.mark.parametrize("framework", list(EXPECTED_LAYOUT))
def test_every_adapter_runs_the_lora_and_accumulation_knobs(run_bench, framework: str) -> None:
    # one RM run per adapter at ZeRO-2 (trlx through DeepSpeed, the reference through FSDP2) turns lora_targets,
    # lora_alpha and grad_accum; what the built engines did is read back from them
    overrides = ("lora=4", "lora_targets=[qkv,mlp_out]", "lora_alpha=2", "zero=2", "precision=bf16")
    record = run_bench(f"framework={framework}", "stage=rm", "steps=3", "warmup_steps=1", "grad_accum=2",
                       *overrides)
    rm = record["stages"]["rm"]
    assert record["status"] == "ok", rm.get("error")
    assert rm["engine_knobs"]["lora"] == {"reward": EXPECTED_LAYOUT[framework]}
    if framework in MEMORY_MODELS:  # the memory model counts what the engine holds
        model, name = MEMORY_MODELS[framework]
        built = RunShape.from_spec(spec_from_config(compose([f"framework={framework}", "stage=rm", *overrides])), "rm")
        counts = rm["params"]["reward"]
        assert model.role_params(built, name, 4) == (counts["total"], counts["trainable"])
    # 3 steps of 2 micro-batches each: the engine (DeepSpeed's own counters, else the optimizer's state) took
    # one optimizer step per record step; the record says what a step trained on
    assert rm["engine_knobs"]["accumulation"] == {"micro_batches": {"reward": 6}, "optimizer_steps": {"reward": 3}}
    assert all(step["optimizer_steps/reward"] == 1 for step in rm["steps"])
    assert record["batch"]["global"] == 4 * 2 and record["batch"]["grad_accum"] == 2
    assert rm["throughput"]["phases"]["training"]["measured_steps"] == 2  # 3 steps less 1 warm-up


def _row(framework: str, stage: str, targets: str, alpha: float | None, seed: int, quality: float,
         trainable: int, applied: float) -> dict:
    column = {"sft": "loss_end_mean", "rm": "accuracy_end"}[stage]
    return {"status": "ok", "tags": None, "framework": framework, "stage": stage, "model": "tiny", "lora": 16,
            "lora_targets": targets, "lora_alpha": alpha, "seed": seed, column: quality,
            "trainable_params": trainable, "lora_alpha_applied": applied, "lora_layers": targets,
            "cell": f"{framework}-{stage}-{targets}-{alpha}", "memory_method": "host RSS"}


def _cells(rows: list[dict]) -> dict:
    return {r["cell"]: {"framework.name": r["framework"], "stage_row": r["stage"], "lora": 16,
                        "lora_targets": r["lora_targets"], "lora_alpha": r["lora_alpha"]} for r in rows}


def test_a15_rule_from_matched_pairs() -> None:
    assert lora_practice([], {}, {})[0] == NOT_MEASURED
    # SFT: qkv's final loss 1.0-1.1 against all's 1.05-1.2 (ranges touch: as well), fewer trainable -> supported
    rows = [_row("trlx", "sft", t, None, s, q, n, 32.0) for t, qs, n in (("qkv", (1.0, 1.1), 100),
                                                                          ("all", (1.05, 1.2), 400))
            for s, q in zip((1, 2), qs, strict=True)]
    assert lora_practice(rows, {}, _cells(rows))[0] == SUPPORTED
    # DS-Chat: qkv learns as well but trains more (unwrapped layers stay trainable) -> contradicted
    ds = [_row("dschat", "sft", t, None, s, 1.0, n, 1.0) for t, n in (("qkv", 900), ("all", 500)) for s in (1, 2)]
    verdict, evidence = lora_practice(ds, {}, _cells(ds))
    assert verdict == CONTRADICTED and "learns as well, trains more" in evidence
    # qkv's loss 0.5-0.6 against 1.0-1.1: beyond the spread, in the better direction -> said as "better"
    better = [_row("trlx", "sft", t, None, s, q, n, 32.0) for t, qs, n in (("qkv", (0.5, 0.6), 100),
                                                                            ("all", (1.0, 1.1), 400))
              for s, q in zip((1, 2), qs, strict=True)]
    verdict, evidence = lora_practice(better, {}, _cells(better))
    assert verdict == SUPPORTED and "learns better (supported)" in evidence
    # RM accuracy: alpha 8 (rank / 2) worse beyond the spread than the default -> contradicted
    rm = [_row("trlx", "rm", "qkv", a, s, q, 100, 32.0 if a is None else 8.0)
          for a, qs in ((None, (0.9, 0.95)), (8, (0.6, 0.7))) for s, q in zip((1, 2), qs, strict=True)]
    assert lora_practice(rm, {}, _cells(rm))[0] == CONTRADICTED
    # coati: both cells ran alpha 32 on its linear layers -> the pair is shown, not counted
    co = [_row("colossalai", "rm", "qkv", a, s, 0.9, 100, 32.0) for a in (None, 8) for s in (1, 2)]
    verdict, evidence = lora_practice(co, {}, _cells(co))
    assert verdict == NOT_MEASURED and "not counted" in evidence
    assert lora_practice(rows + rm, {}, _cells(rows + rm))[0] == "partly supported"
