"""Configuration: every bad value fails before launch, with a message naming it and what is allowed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run.config import compose
from bench.run.models import meta_param_count
from bench.run.spec import ModelSpec, SpecError, UnsupportedError, spec_from_config

REPO = Path(__file__).resolve().parent.parent


def spec(*overrides: str):
    return spec_from_config(compose(list(overrides)))


def test_default_spec_is_dschat_ppo_on_tiny():
    s = spec()
    assert (s.framework, s.stage, s.model.name, s.stages) == ("dschat", "ppo", "tiny", ("ppo",))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("zero=5", ["zero=5", "0, 1, 2, 3"]),
        ("tags=[forced_failure]", ["tags='forced_failure'", "forced-failure"]),
        ("precision=fp8", ["precision='fp8'", "fp32, bf16, fp16"]),
        ("lora=-1", ["lora=-1", ">= 0"]),
        ("batch=0", ["batch=0", ">= 1"]),
        ("launcher.nproc=0", ["launcher.nproc=0", ">= 1"]),
        ("launcher.device=tpu", ["launcher.device='tpu'", "auto, cpu, cuda"]),
        ("framework.optimizer=sgd", ["framework.optimizer='sgd'", "fused_adam, torch_adamw"]),
        ("prompt_len=120", ["exceeds model.positions=128"]),
        ("steps=2", ["leaves no measured step after warmup_steps=2"]),
        ("tp=3", ["tp=3 x pp=1 must divide launcher.nproc=1"]),
        ("pp=0", ["pp=0", ">= 1"]),
        ("plugin=3d", ["plugin='3d' is a colossalai knob"]),
        ("wandb=maybe", ["wandb='maybe'", "off, online, offline"]),
        ("model.dropout=abc", ["model.dropout='abc'", "a number in [0, 1)"]),
        ("init.sft=/no/such/sft.pt", ["init.sft='/no/such/sft.pt' is not a file"]),
        ("init.rm=/no/such/rm.pt", ["init.rm='/no/such/rm.pt' is not a file"]),
        ("stability.skip_rate_storm=2", ["stability.skip_rate_storm=2", "(0, 1]"]),
        ("framework.fix_fp16_zero0_loss_scale=maybe", ["framework.fix_fp16_zero0_loss_scale='maybe'"]),
        ("framework.critic_lora_dim=-2", ["framework.critic_lora_dim=-2", "integer >= 0"]),
        ("framework.actor_dropout=1.5", ["framework.actor_dropout=1.5", "null (keep the model's)", "[0, 1)"]),
        ("framework.compute_fp32_loss=yes", ["framework.compute_fp32_loss='yes'", "true or false"]),
        ("soak=maybe", ["soak='maybe' must be true or false"]),
        ("memory_budget_gb=0", ["memory_budget_gb=0 must be a positive number"]),
        ("memory_release_every=0", ["memory_release_every=0 is not allowed; it must be >= 1"]),
        ("memory_mmap_threshold=-1", ["memory_mmap_threshold=-1 is not allowed", "between 0 and 33554432"]),
        # above glibc's ceiling the variable would be ignored and the record would name a setting that never ran
        ("memory_mmap_threshold=33554433", ["memory_mmap_threshold=33554433", "between 0 and 33554432"]),
        ("memory_mmap_threshold=4MiB", ["memory_mmap_threshold='4MiB' must be an integer"]),
        ("debug.leak_mib_per_step=-1", ["debug.leak_mib_per_step=-1 must be a number >= 0"]),
        ("debug.leak_phase=init", ["debug.leak_phase='init'", "generation, experience, training"]),
    ],
)
def test_bad_values_are_named_with_the_allowed_ones(override, expected):
    with pytest.raises(SpecError) as err:
        spec(override)
    for text in expected:
        assert text in str(err.value)


def test_the_heap_is_released_every_run_in_a_soak_and_every_fourth_otherwise_unless_set():
    assert spec().release_every == 4
    assert spec("soak=true", "steps=20").release_every == 1
    assert spec("soak=true", "steps=20", "memory_release_every=2").release_every == 2


def test_a_soak_run_needs_enough_fitted_steps():
    with pytest.raises(SpecError, match=r"soak=true needs at least 10 fitted steps per stage; steps=12 for ppo "
                                        r"with warmup_steps=3 leaves 9"):
        spec("soak=true", "steps=12", "warmup_steps=3")
    assert spec("soak=true", "steps=12", "warmup_steps=2").soak  # fit from step max(2, 2) = 2: 10 steps


def test_unsupported_combinations_fail_before_launch():
    with pytest.raises(UnsupportedError, match="offload=true needs zero >= 1"):
        spec("offload=true", "zero=0")
    with pytest.raises(UnsupportedError, match="hybrid_engine"):
        spec("framework.hybrid_engine=true", "offload=true", "zero=2", "lora=0")
    assert spec("framework.hybrid_engine=true", "offload=true", "zero=2", "lora=8").lora == 8


CAI = "framework=colossalai"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([CAI, "plugin=zero2"], ["plugin=zero2 is ZeRO stage 2 but zero=0"]),
        ([CAI, "plugin=zero9"], ["plugin='zero9' is not allowed", "auto, ddp, zero1", "3d"]),
        ([CAI, "plugin=3d", "zero=3"], ["takes zero 0, 1 or 2"]),
        ([CAI, "plugin=ddp", "tp=2", "launcher.nproc=2"], ["need plugin=3d"]),
        ([CAI, "framework.optimizer=sgd"], ["framework.optimizer='sgd'", "hybrid_adam, torch_adamw"]),
        ([CAI, "framework.lora.train_bias=some"], ["train_bias='some'", "none, all, lora"]),
        (["framework=trlx", "framework.reference=copy"], ["framework.reference='copy'", "auto, hydra, full, peft"]),
        (["framework=trlx", "framework.num_layers_unfrozen=4"], ["num_layers_unfrozen=4", "between 1 and 3"]),
        (["framework=trlx", "framework.ppo.scale_reward=std"], ["scale_reward='std'", "ignored, running, ref"]),
        (["framework=trlx", "framework.reward_batch_size=0"], ["framework.reward_batch_size=0", "integer >= 1"]),
        (["framework=trlx", "framework.reward_device=gpu1"], ["framework.reward_device='gpu1'", "cpu or cuda:N"]),
        (["framework=trlx", "framework.rm_unfrozen_fraction=0"], ["framework.rm_unfrozen_fraction=0", "(0, 1]"]),
    ],
)
def test_framework_choices_are_validated(overrides, expected):
    with pytest.raises(SpecError) as err:
        spec(*overrides)
    assert not isinstance(err.value, UnsupportedError)
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([CAI, "stage=ppo", "pp=2", "launcher.nproc=2"], "runs a pipeline only in SFT"),
        ([CAI, "stage=sft", "tp=2", "lora=8", "launcher.nproc=2"], "supports LoRA only at tp=1"),
        ([CAI, "zero=3", "lora=8", "precision=bf16"], "LoRA is not supported in GeminiPlugin"),
        ([CAI, "plugin=3d", "zero=1", "precision=fp32"], "needs precision bf16 or fp16"),
        ([CAI, "plugin=ddp", "precision=bf16"], "would silently train fp32"),
        ([CAI, "zero=0", "offload=true", "plugin=ddp"], "offload=true needs zero >= 1"),
        (["framework=dschat", "tp=2", "launcher.nproc=2"], "dschat trains without tensor or pipeline parallelism"),
        (["framework=trlx", "tp=2", "launcher.nproc=2"], "no tensor or pipeline parallelism"),
        (["framework=trlx", "lora=8", "framework.reference=hydra"], "disables the adapters for the reference"),
        (["framework=trlx", "framework.reference=peft"], "needs lora > 0"),
    ],
)
def test_layouts_a_framework_cannot_run_are_unsupported(overrides, expected):
    with pytest.raises(UnsupportedError, match=expected):
        spec(*overrides)


def test_colossalai_auto_plugin_follows_the_config_table():
    from adapters.colossalai.options import ColossalOptions

    def plugin(*overrides: str) -> tuple[str, str]:
        s = spec(CAI, *overrides)
        choice = ColossalOptions.from_dict(s.framework_options).resolve_plugin(s)
        return choice.name, choice.cls

    assert plugin() == ("3d", "HybridParallelPlugin")  # coati's default precision is fp16
    assert plugin("precision=fp32") == ("ddp", "TorchDDPPlugin")
    assert plugin("precision=bf16") == ("3d", "HybridParallelPlugin")
    assert plugin("zero=1") == ("zero1", "LowLevelZeroPlugin")
    assert plugin("zero=2", "offload=true") == ("zero2_cpu", "LowLevelZeroPlugin")
    assert plugin("zero=3", "precision=bf16") == ("gemini", "GeminiPlugin")
    assert plugin("tp=2", "launcher.nproc=2") == ("3d", "HybridParallelPlugin")


def _checkpoint_dir(tmp_path: Path, config: str | None) -> str:
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    if config is not None:
        (directory / "config.json").write_text(config)
    return str(directory)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["framework=foo"], ["framework='foo' is not allowed", "colossalai, dschat, torch, trl, trlx"]),
        (["-m", "framework=dschat,foo"], ["framework='foo' is not allowed"]),
        (["stage=train"], ["stage='train' is not allowed", "pipeline, ppo, rm, sft"]),
        (["model=glm-99b"], ["model='glm-99b' is not allowed", "glm-10b, glm-2b, glm-base, glm-large, glm4-9b, "
                             "llama-base, llama2-7b, llama3-8b, qwen2.5-7b, tiny, tiny-glm4"]),
        (["zero=4"], ["zero=4 is not allowed", "0, 1, 2, 3"]),
        (["precision=int8"], ["precision='int8'", "fp32, bf16, fp16"]),
        (["batch=two"], ["batch='two' must be an integer"]),
        (["batch=0"], ["batch=0", ">= 1"]),
        (["steps=-3"], ["steps (ppo)=-3", ">= 1"]),
        (["answer_len=1.5"], ["answer_len=1.5 must be an integer"]),
        (["prompt_len=0"], ["prompt_len=0", ">= 2"]),
        (["launcher.nproc=many"], ["launcher.nproc='many' must be an integer"]),
        (["launcher.nproc=-2"], ["launcher.nproc=-2", ">= 1"]),
        (["lora=128"], ["lora=128 must be smaller than model.hidden=128"]),
        (["prompt_len=64", "answer_len=65"], ["prompt_len + answer_len = 129 exceeds model.positions=128"]),
        (["model.path=/no/such/checkpoint"], ["model.path='/no/such/checkpoint' is not a directory"]),
        (["model.path={checkpoint}"], ["holds no config.json"]),
        (["model.path={checkpoint:not json}"], ["config.json cannot be read as a JSON object"]),
        (['model.path={checkpoint:{"model_type": "bert"}}'], ["model_type='bert'", "support gpt2, llama, qwen2, "
                                                                                  "mistral, glm"]),
        # a preset's dimensions beside a checkpoint that has others: refused by name, never ignored
        (['model.path={checkpoint:{"model_type": "llama", "hidden_size": 64}}'],
         ["model.arch='gpt2' differs from the checkpoint's 'llama'", "use model=checkpoint"]),
        (['model=checkpoint', 'model.path={checkpoint:{"model_type": "llama", "hidden_size": 64, '
          '"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256, '
          '"max_position_embeddings": 64}}', "model.hidden=128"],
         ["model.hidden=128 differs from the checkpoint's 64"]),
        (["model=tiny-llama", "model.kv_heads=3"], ["model.kv_heads=3 must divide model.heads=4"]),
        (["model.kv_heads=1"], ["the gpt2 family has no grouped-query attention"]),
        (["model=tiny-llama", "model.dropout=0.1"], ["the llama family has no dropout in its residual stream"]),
        (["model=tiny-llama", "model.intermediate=null"], ["model.intermediate=null: the llama family has no default"]),
        (["model.arch=bert"], ["model.arch='bert' is not allowed", "gpt2, llama, qwen2, mistral, glm"]),
        (["model=checkpoint"], ["model=checkpoint needs model.path=DIR"]),
        (["output_root={file}/results"], ["cannot be created", "is a file, not a directory"]),
        (["bogus=1"], ["bogus is not a key of the configuration"]),
        (["framework.optimzer=sgd"], ["did you mean framework.optimizer"]),
        (["+bogus=1"], ["+bogus: rlhf-bench reads only the keys of its configuration"]),
        (["-m", "framework=dschat,trlx", "framework.hybrid_engine=true"],
         ["framework.hybrid_engine is not a key of the configuration with framework=trlx"]),
        (["zero"], ["Error parsing override 'zero'", "KEY=VALUE"]),
    ],
)
def test_hostile_command_lines_are_refused_naming_the_value_and_what_is_allowed(args, expected, tmp_path):
    from bench.run.cli_checks import check_command_line

    (tmp_path / "a-file").write_text("")
    filled = []
    for arg in args:
        if "{checkpoint" in arg:
            key, _, template = arg.partition("=")
            config = template[len("{checkpoint"):-1].lstrip(":") or None
            arg = f"{key}={_checkpoint_dir(tmp_path, config)}"
        filled.append(arg.replace("{file}", str(tmp_path / "a-file")))
    with pytest.raises(SpecError) as err:
        check_command_line(filled)
    for text in expected:
        assert text in str(err.value), str(err.value)


def test_a_checkpoint_directory_and_a_valid_sweep_pass_the_checks(tmp_path):
    from bench.run.cli_checks import check_command_line

    path = _checkpoint_dir(tmp_path, '{"model_type": "gpt2"}')  # transformers' GPT-2 defaults fill the rest
    check_command_line(["model=checkpoint", f"model.path={path}", f"output_root={tmp_path / 'new' / 'results'}"])
    check_command_line(["model=checkpoint", f"model.path={path}", "model.hidden=768"])  # the checkpoint's own
    check_command_line(["-m", "framework=dschat,trlx", "zero=0,2", "batch=0"])  # a sweep validates each cell
    check_command_line(["offload=true", "zero=0"])  # unsupported: the run records it
    check_command_line(["--help", "bogus=1"])  # help only prints
    assert not (tmp_path / "new").exists(), "the writability probe left a directory behind"


@pytest.mark.engine
# One value refused by the spec, one by the group choices, one unknown key; the rest of the refusals are the
# unit tests above (the same function, without a process start each).
@pytest.mark.parametrize("override", ["zero=5", "framework=foo", "bogus=1"])
def test_cli_rejects_bad_override_with_exit_2_and_writes_nothing(override, tmp_path):
    root = tmp_path / "results"
    root.mkdir()
    (root / "earlier.json").write_text("{}")  # results already there stay untouched
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", override, f"output_root={root}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "invalid configuration" in proc.stdout and override.split("=")[0] in proc.stdout
    assert [p.name for p in root.rglob("*")] == ["earlier.json"], "something was written"


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    # GLM's published sizes: ~110 M, ~335 M, 2 B, 10 B (the stand-in lacks GLM's block-position table)
    [("glm-base", 105e6, 115e6), ("glm-large", 325e6, 345e6), ("glm-2b", 1.85e9, 2.0e9), ("glm-10b", 9.80e9, 9.95e9)],
)
def test_the_glm_ladder_has_the_published_sizes(preset, low, high):
    counts = meta_param_count(ModelSpec(**compose([f"model={preset}"])["model"]))
    assert low < counts.total < high, counts
    assert counts.trainable == counts.total


def test_steps_override_applies_to_this_runs_stages_only():
    assert spec("steps=5").steps == {"sft": 20, "rm": 30, "ppo": 5, "grpo": 10}
    assert spec("steps=5", "stage=pipeline").steps == {"sft": 5, "rm": 5, "ppo": 5, "grpo": 10}


def test_stage_lr_override_applies_to_the_main_role_only():
    s = spec("lr=0.5")
    assert s.stage_lr("actor") == 0.5 and s.stage_lr("sft") == 0.5
    assert s.stage_lr("critic") == s.model.lr["critic"]


@pytest.mark.engine
def test_a_sweep_records_unsupported_cells_and_goes_on(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "-m", "stage=sft", "offload=true", "zero=0,1", "steps=3",
         "warmup_steps=1", "framework.optimizer=torch_adamw", f"output_root={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.glob("sweeps/*/*/record.json")}
    by_zero = {r["config"]["zero"]: r for r in records.values()}
    assert by_zero[0]["status"] == "unsupported" and "offload=true needs zero >= 1" in by_zero[0]["error"]["message"]
    # a refused cell carries the provenance a run does: the code's commit and dirty state, the host and its
    # native matrix instructions, beside the run's own
    refused, ran = by_zero[0]["environment"], by_zero[1]["environment"]
    assert refused["git"] == ran["git"] and refused["git"]["commit"]
    assert refused["host"] == ran["host"] and "matrix_isa" in refused["host"]
    assert by_zero[1]["status"] == "ok", by_zero[1]["error"]
    # ZeRO-1 on 1 rank partitions nothing: the fp32 master and AdamW's two fp32 moments, 12 bytes a parameter
    sft = by_zero[1]["stages"]["sft"]
    assert sft["model_state"]["actor"]["optimizer_state_bytes_per_rank"] == [
        pytest.approx(12 * sft["params"]["actor"]["trainable"], rel=0.01)]


def test_the_prerequisite_rm_cache_key_holds_only_what_the_rm_stage_uses():
    from bench.run.benchmark import prerequisite_cache_key

    def key(*overrides: str) -> str:
        return prerequisite_cache_key(spec(*overrides), "rm")

    base = key()
    for framework, ppo_only in (("dschat", "framework.ppo.kl_ctl=0.5"), ("colossalai", "framework.ppo.top_k=5"),
                                ("trlx", "framework.num_layers_unfrozen=-1")):
        mine = key(f"framework={framework}")
        assert key(f"framework={framework}", ppo_only) == mine, framework
        assert key(f"framework={framework}", "model.lr.actor=0.5") == mine
        assert key(f"framework={framework}", "model.lr.rm=0.5") != mine
    assert key("seed=7") != base and key("batch=2") != base
    assert key("framework.hybrid_engine=true") == base
    assert key("stage_steps.sft=5") == base and key("stage_steps.rm=5") != base


def test_the_prerequisite_sft_cache_key_holds_only_what_the_sft_stage_uses():
    from bench.run.benchmark import prerequisite_cache_key

    def key(*overrides: str) -> str:
        return prerequisite_cache_key(spec(*overrides), "sft")

    base = key()
    assert key("model.lr.sft=0.5") != base and key("stage_steps.sft=5") != base
    assert key("model.lr.rm=0.5") == base and key("stage_steps.rm=5") == base and key("zero=3") == base
    assert key("framework.ppo.kl_ctl=0.5") == base and key("verbose=true") == base
    assert key() != prerequisite_cache_key(spec(), "rm")


def test_the_colossalai_precision_mixin_is_found_under_each_of_its_names():
    import inspect
    from types import SimpleNamespace

    from adapters.colossalai.update import precision_mixin

    # colossalai 0.5.0's GeminiOptimizer keeps it as `mix_precision_mixin` (read from the installed source)
    gemini = pytest.importorskip("colossalai.zero.gemini.gemini_optimizer")
    assert "self.mix_precision_mixin =" in inspect.getsource(gemini.GeminiOptimizer.__init__)
    for name in ("mixed_precision_mixin", "mixed_precision", "mix_precision_mixin"):
        mixin = SimpleNamespace(loss_scale=2.0**10)
        assert precision_mixin(SimpleNamespace(**{name: mixin})) is mixin


def test_each_framework_defaults_to_its_upstream_precision():
    assert spec().precision == "fp16"  # DS-Chat step-3 --dtype
    assert spec(CAI).precision == "fp16"  # train_ppo.py --mixed_precision
    assert spec("framework=trlx").precision == "fp32"  # accelerate's mixed_precision "no"
    assert spec("framework=trlx", "precision=bf16").precision == "bf16"


@pytest.mark.parametrize(
    ("overrides", "knobs"),
    [
        ([], []),
        (["precision=fp32", "framework.optimizer=torch_adamw"], ["precision=fp32", "framework.optimizer=torch_adamw"]),
        ([CAI], []),
        ([CAI, "precision=fp32"], ["precision=fp32", "plugin=ddp"]),  # fp32 ddp: neither exists in train_ppo.py
        ([CAI, "precision=fp32", "stage=sft"], ["precision=fp32"]),  # train_sft.py offers ddp
        ([CAI, "zero=1", "precision=bf16"], ["plugin=zero1"]),
        (["framework=trlx", "grad_ckpt=true"], ["grad_ckpt=true"]),
        (["framework=trlx", "precision=fp32"], []),
    ],
)
def test_cells_only_this_harness_can_run_are_named_with_a_reason(overrides, knobs):
    from adapters import registry

    s = spec(*overrides)
    found = registry.options_class(s.framework).harness_extensions(s)
    assert [e["knob"] for e in found] == knobs
    assert all(e["reason"] for e in found)
