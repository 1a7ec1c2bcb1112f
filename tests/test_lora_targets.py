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
from bench.plan.physics import Arch, lora_linear_inputs
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
    assert spec("lora=4", "lora_targets=all").lora_target_set == ("qkv", "attn_out", "mlp_in", "mlp_out")
    assert spec("lora=4", "lora_targets=attention").lora_target_set == ("qkv", "attn_out")
    assert spec("lora=4", "lora_targets=[mlp_out,qkv]").lora_target_set == ("qkv", "mlp_out")  # block order
    assert spec("lora=4").lora_target_set is None  # the framework's default
    assert spec("lora=4", "lora_alpha=8").lora_alpha_or(32.0) == 8.0
    assert spec("lora=4").lora_alpha_or(32.0) == 32.0
    for bad, message in [("lora_targets=mlp", "choose one of: all, attention, qkv"),
                         ("lora_targets=[qkv,gate]", "'gate' is not allowed"),
                         ("lora_targets=[qkv,qkv]", "names a layer twice"),
                         ("lora_targets=[]", "non-empty list"),
                         ("lora_alpha=0", "lora_alpha=0 must be a positive number")]:
        with pytest.raises(SpecError, match=message):
            spec("lora=4", bad)
    with pytest.raises(SpecError, match="lora=0 trains without them"):
        spec("lora_targets=qkv")


def test_lora_parameters_per_target_set_by_hand() -> None:
    # glm-base, h 768, 12 blocks, rank 64: r * h * 12 * (d_in + d_out in h): qkv 4, attn_out 2, mlp_in 5, mlp_out 5
    assert GLM_BASE.lora_params(64) == 9_437_184  # 16 r h per block
    assert GLM_BASE.lora_params(64, ("qkv",)) == 2_359_296
    assert GLM_BASE.lora_params(64, ("attn_out", "mlp_out")) == 64 * 768 * 12 * 7 == 4_128_768
    assert GLM_BASE.block_weights(("qkv",)) == 768 ** 2 * 12 * 3 == 21_233_664
    assert GLM_BASE.block_weights() == 84_934_656  # 12 h^2 per block
    assert lora_linear_inputs(("qkv", "mlp_out")) == 5 and lora_linear_inputs(("qkv", "attn_out", "mlp_in",
                                                                               "mlp_out")) == 7


def test_dschat_takes_one_substring_where_one_selects_the_set() -> None:
    assert lora_module_names(None, "h.") == ("h.",) == lora_module_names(("qkv", "attn_out", "mlp_in", "mlp_out"),
                                                                          "h.")
    assert lora_module_names(("qkv",), "h.") == ("attn.c_attn",)
    assert lora_module_names(("qkv", "attn_out"), "h.") == ("attn.",)
    assert lora_module_names(("mlp_in", "mlp_out"), "h.") == ("mlp.",)
    assert lora_module_names(("qkv", "mlp_out"), "h.") == ("attn.c_attn", "mlp.c_proj")  # a harness extension
    tagged = [e["knob"] for e in DSChatOptions.harness_extensions(spec("lora=4", "lora_targets=[qkv,mlp_out]",
                                                                       "lora_alpha=2"))]
    assert tagged == ["lora_targets=('qkv', 'mlp_out')", "lora_alpha=2"]
    assert DSChatOptions.harness_extensions(spec("lora=4", "lora_targets=attention")) == []


def test_coati_matches_a_childs_own_name() -> None:
    # GPT-2 names the attention output and the MLP output both c_proj: either target converts both
    assert matched_layers(("qkv",)) == ("qkv",)
    assert matched_layers(("attn_out",)) == ("attn_out", "mlp_out")
    assert matched_layers(("qkv", "mlp_in")) == ("qkv", "mlp_in")


def shape(framework: str, stage: str, *overrides: str) -> RunShape:
    config = compose([f"framework={framework}", f"stage={stage}", "model=glm-base", "lora=64", *overrides])
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


def test_lora_layout_reads_each_implementation() -> None:
    from adapters.colossalai.lora import convert_to_lora as coati_convert
    from adapters.colossalai.options import LoraOptions
    from adapters.dschat.lora import convert_to_lora as dschat_convert

    ds = build_causal_lm(MODEL)
    dschat_convert(ds, lora_module_names(("qkv", "attn_out"), "h."), 4, lora_scaling=2.0)
    co = build_causal_lm(MODEL)
    coati_convert(co, 4, LoraOptions(alpha=8.0), target_modules=["mlp.c_fc"])
    full = build_causal_lm(MODEL)
    coati_convert(full, 4, LoraOptions(alpha=8.0))
    assert lora_layout({"ds": ds, "coati": co, "full": full}) == {
        "ds": {"targets": ["qkv", "attn_out"], "other": [], "alpha": 2.0},
        "coati": {"targets": ["mlp_in"], "other": [], "alpha": 32.0},  # lora_alpha never reaches a linear layer
        "full": {"targets": ["qkv", "attn_out", "mlp_in", "mlp_out"], "other": ["lm_head", "wpe", "wte"],
                 "alpha": 32.0}}


EXPECTED_LAYOUT = {  # lora=4 lora_targets=[qkv,mlp_out] lora_alpha=2, RM stage
    "dschat": {"targets": ["qkv", "mlp_out"], "other": [], "alpha": 2.0},
    "colossalai": {"targets": ["qkv", "attn_out", "mlp_out"], "other": [], "alpha": 32.0},
    "trlx": {"targets": ["qkv", "mlp_out"], "other": [], "alpha": 2.0},
    "torch": {"targets": ["qkv", "mlp_out"], "other": [], "alpha": 2.0},
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
    assert verdict == CONTRADICTED and "trains more" in evidence
    # RM accuracy: alpha 8 (rank / 2) worse beyond the spread than the default -> contradicted
    rm = [_row("trlx", "rm", "qkv", a, s, q, 100, 32.0 if a is None else 8.0)
          for a, qs in ((None, (0.9, 0.95)), (8, (0.6, 0.7))) for s, q in zip((1, 2), qs, strict=True)]
    assert lora_practice(rm, {}, _cells(rm))[0] == CONTRADICTED
    # coati: both cells ran alpha 32 on its linear layers -> the pair is shown, not counted
    co = [_row("colossalai", "rm", "qkv", a, s, 0.9, 100, 32.0) for a in (None, 8) for s in (1, 2)]
    verdict, evidence = lora_practice(co, {}, _cells(co))
    assert verdict == NOT_MEASURED and "not counted" in evidence
    assert lora_practice(rows + rm, {}, _cells(rows + rm))[0] == "partly supported"
