"""Llama-, Qwen2-, Mistral- and GLM-4-style models beside the GPT-2-shaped GLM stand-in: presets counted two
ways (transformers' modules on the meta device, and bench.plan.physics arithmetic) against values worked by
hand and published totals, FLOPs per architecture by hand, the families' traits against the installed
libraries' own tables, trlx's hydra branch on both block kinds, and real runs of every framework."""

from __future__ import annotations

import os

import pytest

from bench.measure.flops import Attention, token_flops
from bench.measure.params import ParamCounts
from bench.plan.physics import Arch
from bench.run.config import CONF_DIR, compose
from bench.run.families import FAMILIES
from bench.run.spec import ModelSpec, spec_from_config

PRESETS = sorted(f[:-5] for f in os.listdir(CONF_DIR / "model") if f.endswith(".yaml") and f != "checkpoint.yaml")
# published totals of the shapes the GPU presets copy (model cards: Llama-3-8B 8.03 B, Qwen2.5-7B 7.61 B "7.62 B"
# with its untied head, GLM-4-9B 9.4 B, Llama-2-7B 6.74 B)
PUBLISHED_B = {"llama3-8b": 8.03, "qwen2.5-7b": 7.62, "glm4-9b": 9.40, "llama2-7b": 6.74}


def _model(preset: str) -> ModelSpec:
    return ModelSpec(**compose([f"model={preset}"])["model"])


def _arch(model: ModelSpec) -> Arch:
    return Arch(hidden=model.hidden, layers=model.layers, heads=model.heads, vocab=model.vocab,
                positions=model.positions, family=model.arch, kv_heads=model.kv_heads,
                intermediate=model.intermediate, tied=model.tie_embeddings)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_counts_alike_as_modules_and_as_arithmetic(preset: str) -> None:
    from bench.run.models import meta_param_count

    model = _model(preset)
    counts = meta_param_count(model)
    assert counts.total == _arch(model).total_params
    if preset in PUBLISHED_B:
        assert round(counts.total / 1e9, 2) == PUBLISHED_B[preset]


def test_tiny_llama_by_hand_and_what_a_token_multiplies_through() -> None:
    from bench.run.models import build_backbone, build_causal_lm, count_params

    # tiny-llama: per block q, o 128 x 128 = 16,384 each; k, v 128 x 64 (2 K/V heads of 32) = 8,192 each;
    # SwiGLU 3 x 128 x 352 = 135,168; two RMSNorms 256: 184,576; x 4 = 738,304; embedding and untied head
    # 256 x 128 = 32,768 each; final norm 128: 803,968. A token looks the embedding up (no multiply): N = 771,200
    lm = count_params(build_causal_lm(_model("tiny-llama")))
    assert lm == ParamCounts(total=803_968, trainable=803_968, compute=771_200, compute_trainable=771_200)
    # the backbone under a value head: no head, the embedding only looked up
    backbone = count_params(build_backbone(_model("tiny-llama")))
    assert backbone.total == 803_968 - 32_768 and backbone.compute == 803_968 - 2 * 32_768
    # tied GPT-2 (model=tiny): the embedding is the head and counts once; the position table (128 x 128) does
    # not; its backbone multiplies through neither table
    gpt2 = count_params(build_causal_lm(_model("tiny")))
    assert gpt2.total == 842_496 and gpt2.compute == 842_496 - 128 * 128
    assert count_params(build_backbone(_model("tiny"))).compute == 842_496 - 128 * 128 - 256 * 128
    # FLOPs of one trained token at a context of 32: 6 N + 12 L C H = 6 x 771,200 + 12 x 4 x 32 x 128
    assert token_flops("training", lm, Attention(layers=4, hidden=128), 32) == 4_627_200 + 196_608
    # a forward of the backbone alone: 2 N + 4 L C H with N = 738,304 + 128 (the blocks and the final norm)
    assert token_flops("inference", backbone, Attention(layers=4, hidden=128), 32) == 2 * 738_432 + 65_536


def test_family_traits_match_the_installed_transformers_and_peft() -> None:
    """The module names, biases and fusions the families declare are the ones transformers 4.51.3 builds, and
    PEFT_DEFAULTS is peft's own default table read as meanings."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    from adapters.lora_targets import PEFT_DEFAULTS, suffixes
    from bench.run.models import build_causal_lm, decoder_blocks, final_norm

    for arch in FAMILIES:
        preset = "tiny" if arch == "gpt2" else {"glm": "tiny-glm4"}.get(arch, f"tiny-{arch}")
        model = _model(preset)
        assert model.arch == arch
        lm = build_causal_lm(model)
        block = decoder_blocks(lm)[0]
        names = {name for name, _ in block.named_modules()}
        traits = FAMILIES[arch]
        assert set(traits.distinct_modules) <= names, arch
        for module in traits.distinct_modules:
            has_bias = getattr(block.get_submodule(module), "bias", None) is not None
            assert has_bias == any(traits.modules[m] == module for m in traits.biased), (arch, module)
        assert type(block).__name__ == traits.layer_class
        assert final_norm(lm) is getattr(lm.base_model, traits.final_norm)
        assert (lm.get_input_embeddings().weight is lm.get_output_embeddings().weight) == traits.tied_default
        defaults = PEFT.get(traits.model_type)
        if arch in PEFT_DEFAULTS:
            assert [s.rsplit(".", 1)[1] for s in suffixes(PEFT_DEFAULTS[arch], arch)] == defaults
        else:
            assert defaults is None


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_trlx_hydra_branch_reproduces_the_trunk_before_training(preset: str) -> None:
    """trlx's branch holds copies of the top blocks, norm and head: before any step its reference logits equal
    the policy's own, for a GPT-2 block (positions added below the branch) and a Llama block (rotary positions
    passed in), left padding included."""
    import torch

    from adapters.trlx.models import PolicyWithValueHead
    from bench.run.models import build_causal_lm

    model = _model(preset)
    torch.manual_seed(0)
    policy = PolicyWithValueHead(build_causal_lm(model).eval(), model.hidden, 2).eval()
    ids = torch.randint(2, model.vocab, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        reference = policy(ids, mask, reference=True)
        _, out = policy(ids, mask)
    assert torch.equal(reference, out.logits)


def test_frameworks_refuse_what_their_upstream_cannot_build() -> None:
    from bench.run.spec import UnsupportedError

    def check(*overrides: str) -> None:
        from adapters.registry import options_class

        spec = spec_from_config(compose(list(overrides)))
        options_class(spec.framework).validate(spec)

    with pytest.raises(UnsupportedError, match="no branch for the qwen2 family"):
        check("framework=trlx", "model=tiny-qwen2", "framework.num_layers_unfrozen=2")
    check("framework=trlx", "model=tiny-qwen2")  # null: -1, the full reference trlx offers it
    check("framework=trlx", "model=tiny-llama")  # the hh example's 2: trlx's LlamaModelBranch
    with pytest.raises(UnsupportedError, match="no default for model_type 'glm'"):
        check("framework=trl", "model=tiny-glm4", "lora=4")
    check("framework=trl", "model=tiny-glm4", "lora=4", "lora_targets=all")
    with pytest.raises(UnsupportedError, match="shardformer has no policy"):
        check("framework=colossalai", "model=tiny-glm4", "precision=bf16")
    check("framework=colossalai", "model=tiny-glm4", "precision=bf16", "zero=2")
    with pytest.raises(Exception, match="tp=4 must divide model.heads=4 and model.kv_heads=2"):
        check("framework=colossalai", "model=tiny-llama", "precision=bf16", "plugin=3d", "tp=4",
              "launcher.nproc=4")


FRAMEWORKS = ("dschat", "colossalai", "trlx", "trl", "torch")
# knobs a family needs where a framework's default path cannot build it (each refusal is pinned above)
FAMILY_KNOBS = {("colossalai", "tiny-glm4"): ("zero=2",)}


def _pipeline(run_bench, framework: str, preset: str) -> dict:
    record = run_bench(f"framework={framework}", f"model={preset}", "stage=pipeline", "steps=3", "warmup_steps=1",
                       "init.sft_prerequisite=true", *FAMILY_KNOBS.get((framework, preset), ()))
    assert record["status"] == "ok", {s: v.get("error") for s, v in record["stages"].items()}
    return record


# CI runs trlx's, whose hydra branch is built per family; DS-Chat's (greedy decoding), coati's (plugins and LoRA),
# TRL's and the reference's run in the slow tier with the other families, to keep a fresh clone's CI under 30
# minutes (the multi-node runs of tests/test_multinode.py took their place)
LLAMA_IN_CI = ("trlx",)


@pytest.mark.engine
@pytest.mark.parametrize("framework", [f if f in LLAMA_IN_CI else pytest.param(f, marks=pytest.mark.slow)
                                       for f in FRAMEWORKS])
def test_every_framework_runs_a_llama_pipeline(run_bench, framework: str) -> None:
    """SFT, RM and PPO of tiny-llama through each framework: each builds the causal LM of 803,968 parameters
    worked by hand above, and the memory models count the PPO roles the engines hold."""
    from adapters.colossalai import memory as coati
    from adapters.dschat import memory as dschat
    from adapters.trlx import memory as trlx
    from bench.plan.run_shape import RunShape

    record = _pipeline(run_bench, framework, "tiny-llama")
    stages = record["stages"]
    assert stages["sft"]["params"]["actor"]["total"] == 803_968
    models = {"dschat": (dschat, {"actor": "actor", "critic": "critic"}), "colossalai": (
        coati, {"actor": "actor", "critic": "critic"}), "trlx": (trlx, {"actor": "ppo"})}
    if framework in models:
        model, roles = models[framework]
        shape = RunShape.from_spec(spec_from_config(compose([f"framework={framework}", "model=tiny-llama"])), "ppo")
        for role, name in roles.items():
            counts = stages["ppo"]["params"][role]
            assert model.role_params(shape, name, 0) == (counts["total"], counts["trainable"]), role
    if framework == "dschat":
        assert any("greedy" in note for note in stages["ppo"]["notes"])


@pytest.mark.slow  # 10 pipelines, ~10 minutes: scripts/test_slow.sh
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-glm4"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_framework_runs_qwen2_and_glm4_pipelines(run_bench, framework: str, preset: str) -> None:
    record = _pipeline(run_bench, framework, preset)
    assert record["stages"]["sft"]["params"]["actor"]["total"] == 804_992  # tiny-llama + q, k, v biases 4 x 256


@pytest.mark.engine
def test_a_saved_llama_checkpoint_runs_through_model_path(run_bench, tmp_path) -> None:
    """A random tiny LlamaForCausalLM saved with save_pretrained, loaded by model=checkpoint: its own dimensions
    (hidden 64, 2 layers, 4 heads, 2 K/V heads, SwiGLU 96, vocab 128) reach the spec and the record."""
    from transformers import LlamaConfig, LlamaForCausalLM

    checkpoint = tmp_path / "local-llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                 pad_token_id=0)).save_pretrained(checkpoint)
    record = run_bench("stage=sft", "model=checkpoint", f"model.path={checkpoint}", "steps=3", "warmup_steps=1",
                       "framework.optimizer=torch_adamw")
    assert record["status"] == "ok", record["stages"]["sft"]["error"]
    # per block q, o 64 x 64 = 4,096 each; k, v 64 x 32 = 2,048 each; SwiGLU 3 x 64 x 96 = 18,432; norms 128:
    # 30,848; x 2 = 61,696; embedding and head 128 x 64 = 8,192 each; final norm 64: 78,144
    assert record["stages"]["sft"]["params"]["actor"]["total"] == 78_144
    assert record["model"]["kv_heads"] == 2 and record["model"]["arch"] == "llama"  # the checkpoint's own
