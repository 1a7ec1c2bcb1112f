"""`bench.run plan=FILE`: an execution plan as each framework's knobs, refused where the framework cannot express
it, and (engine tier) a DS-Chat PPO run whose roles differ in their ZeRO stage, checked against the engines' own
tensors and the plan's prediction."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from bench.plan.cluster import Workload
from bench.plan.plan_file import PlanError
from bench.run import plan_run
from bench.run.spec import UnsupportedError

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
ROLE = {"stages": None, "tp": 1, "pp": 1, "dp": 2, "zero": 2}
STAGES = {"actor": ["generation", "inference", "training"], "critic": ["inference", "training"],
          "reference": ["inference"], "reward": ["inference"]}


def _plan(tmp_path: Path, name: str = "plan.yaml", workload: dict | None = None, **roles: dict) -> str:
    """A tiny-model plan on one node of 2 GPUs: every role at ZeRO-2 (trained) or 0 (frozen) unless `roles`
    changes it."""
    plan = {}
    for role, stages in STAGES.items():
        entry = {**ROLE, "stages": stages, "zero": 2 if role in ("actor", "critic") else 0,
                 "requires_grad": role in ("actor", "critic")}
        plan[role] = {**entry, **roles.get(role, {})}
    document = {"model": "tiny", "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "A100-40GB"},
                "workload": {"precision": "bf16", "micro_batch": 2, "global_batch": 4, "prompt_len": 16,
                             "answer_len": 16, **(workload or {})},
                "execution_plan": plan}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document))
    return str(path)


# DS-Chat's flags per model: the actor at ZeRO-3 takes the reference engine with it; critic and reward stay whole
DIFFERING = {"actor": {"zero": 3}, "reference": {"zero": 3}}


def test_every_workload_key_is_run_or_refused_by_name() -> None:
    names = {f.name for f in fields(Workload)}
    assert names == set(plan_run.RUN_WORKLOAD) | set(plan_run.NOT_RUN) | {"global_batch"}


def test_a_plan_whose_roles_differ_becomes_ds_chat_s_per_model_flags(tmp_path) -> None:
    path = _plan(tmp_path, **DIFFERING)
    args = plan_run.expand([f"plan={path}", "framework=dschat", "steps=3"], "dschat")
    # written by hand from the plan: 1 node x 2 GPUs, micro-batch 2, global batch 4 = 2 x 2 ranks (no accumulation)
    assert args == ["framework=dschat", "steps=3", "model=tiny", "stage=ppo", "launcher.nnodes=1",
                    "launcher.nproc=2", "precision=bf16", "batch=2", "prompt_len=16", "answer_len=16", "lora=0",
                    "grad_accum=1", "zero=3", "offload=false", "grad_ckpt=false", "framework.critic_zero_stage=2",
                    "framework.critic_gradient_checkpointing=false", f"plan_file={path}"]


def test_a_uniform_plan_runs_in_every_framework_and_accumulates_the_global_batch(tmp_path) -> None:
    path = _plan(tmp_path, workload={"global_batch": 8})  # 8 = micro-batch 2 x 2 GPUs x 2 accumulated
    for framework in ("dschat", "colossalai", "trlx", "trl", "torch"):
        args = plan_run.expand([f"plan={path}", f"framework={framework}"], "dschat")
        assert "grad_accum=2" in args and "zero=2" in args and "launcher.nproc=2" in args, framework


@pytest.mark.parametrize("framework, roles, said", [
    ("colossalai", DIFFERING, "execution_plan.critic.zero=2 cannot run in colossalai: one setting covers every "
                              "trained model (actor has zero=3)"),
    ("trlx", DIFFERING, "execution_plan.critic.zero=2 cannot run in trlx: the critic is the policy's value head"),
    ("trl", DIFFERING, "execution_plan.critic.zero=2 cannot run in trl"),
    ("torch", DIFFERING, "execution_plan.critic.zero=2 cannot run in torch"),
    ("dschat", {"reference": {"zero": 3}}, "execution_plan.reference.zero=3 cannot run in dschat: DS-Chat's eval "
                                           "engines follow the trained ones: with the actor at ZeRO-2 it runs at "
                                           "ZeRO-0"),
    ("dschat", {"actor": {"tp": 2, "dp": 1}, "critic": {"tp": 2, "dp": 1}, "reference": {"tp": 2, "dp": 1},
                "reward": {"tp": 2, "dp": 1}}, "execution_plan.actor.tp=2 cannot run in dschat"),
    ("dschat", {"critic": {"offload": True}}, "execution_plan.critic.offload=True cannot run in dschat: DS-Chat's "
                                              "--offload covers actor and critic"),
    ("trlx", {"reward": {"zero": 3}, "critic": {"zero": 3}, "actor": {"zero": 3}, "reference": {"zero": 3}},
     "execution_plan.reference.zero=3 cannot run in trlx: trlx keeps it outside DeepSpeed"),
])
def test_a_plan_a_framework_cannot_express_is_refused_naming_role_and_key(tmp_path, framework, roles, said) -> None:
    with pytest.raises(UnsupportedError) as err:
        plan_run.expand([f"plan={_plan(tmp_path, **roles)}", f"framework={framework}"], "dschat")
    assert said in str(err.value)


def test_roles_on_gpus_of_their_own_are_refused(tmp_path) -> None:
    one = {"dp": 1, "group": "a"}
    path = _plan(tmp_path, actor=one, critic=one, reference={"dp": 1, "group": "b"}, reward={"dp": 1, "group": "b"})
    with pytest.raises(UnsupportedError, match=r"execution_plan.reference.group='reference\+reward' cannot run in "
                                               r"dschat: every framework here places every role on every GPU"):
        plan_run.expand([f"plan={path}"], "dschat")


@pytest.mark.parametrize("args, said", [
    (["zero=3"], "zero=3: the plan sets zero"),
    (["launcher.nproc=4"], "launcher.nproc=4: the plan sets launcher.nproc"),
    (["framework=dschat,trlx"], "plan=FILE runs one framework at a time"),
])
def test_a_command_line_that_contradicts_the_plan_is_refused(tmp_path, args, said) -> None:
    with pytest.raises(PlanError, match=said):
        plan_run.expand([f"plan={_plan(tmp_path)}", *args], "dschat")


def test_workload_the_harness_cannot_run_and_uneven_batches_are_refused(tmp_path) -> None:
    with pytest.raises(UnsupportedError, match=r"workload.cache='mems' cannot be run: the harness's models decode "
                                               r"with a KV cache; allowed: 'kv'"):
        plan_run.expand([f"plan={_plan(tmp_path, workload={'cache': 'mems'})}"], "dschat")
    with pytest.raises(UnsupportedError, match=r"workload.global_batch=6 must be a multiple of micro_batch x "
                       r"data-parallel ranks = 4"):
        plan_run.expand([f"plan={_plan(tmp_path, workload={'global_batch': 6})}"], "dschat")
    with pytest.raises(PlanError, match=r"plan='no-such-plan' is neither a file nor a plan in conf/plan "
                                        r"\(example-8b, glm-base-2-ranks\)"):
        plan_run.expand(["plan=no-such-plan"], "dschat")


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_the_cli_refuses_before_launch_with_exit_2_and_writes_nothing(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.run", f"plan={_plan(tmp_path, **DIFFERING)}",
                           "framework=colossalai", f"output_root={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "execution_plan.critic.zero=2 cannot run in colossalai" in " ".join(done.stdout.split())
    assert not (tmp_path / "out").exists()


def test_ds_chat_s_critic_stage_partitions_critic_and_reward_in_the_memory_model() -> None:
    """Worked by hand: on 2 ranks in bf16, moving the critic from ZeRO-2 to ZeRO-3 halves its resident weights
    and the reward engine's (which follows it), P bytes each for P parameters of 2 bytes; the optimizer states
    stay as they were (partitioned from ZeRO-1 on either side); the actor and the reference do not move."""
    from adapters.dschat.memory import predict, role_params
    from bench.plan.run_shape import RunShape
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    def shape(*extra: str) -> RunShape:
        spec = spec_from_config(compose(["framework=dschat", "stage=ppo", "model=tiny", "launcher.nproc=2",
                                         "precision=bf16", "zero=2", *extra]))
        return RunShape.from_spec(spec, "ppo")

    both, split = predict(shape()), predict(shape("framework.critic_zero_stage=3"))
    critic = role_params(shape(), "critic", 0)[0]
    reward = role_params(shape(), "reward", 0)[0]
    assert both["generation"].params - split["generation"].params == pytest.approx(critic + reward)
    assert both["generation"].optimizer == pytest.approx(split["generation"].optimizer)


def test_ds_chat_s_configs_follow_upstream_per_model() -> None:
    from adapters.dschat import ds_config
    from adapters.dschat.options import DSChatOptions
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    spec = spec_from_config(compose(["framework=dschat", "stage=ppo", "zero=2", "offload=true",
                                     "framework.critic_zero_stage=3"]))
    options = DSChatOptions.from_dict(spec.framework_options)
    critic = ds_config.train_config(spec, options, 2, False, stage=options.critic_stage(spec.zero))
    actor = ds_config.train_config(spec, options, 2, False)
    assert (actor["zero_optimization"]["stage"], critic["zero_optimization"]["stage"]) == (2, 3)
    assert "offload_param" in critic["zero_optimization"] and "offload_param" not in actor["zero_optimization"]
    assert ds_config.eval_config(spec, options, 2)["zero_optimization"]["stage"] == 0  # the reference: actor's 2
    assert ds_config.eval_config(spec, options, 2, 3)["zero_optimization"]["stage"] == 3  # the reward: critic's 3


@pytest.mark.engine
def test_a_ds_chat_plan_with_roles_at_different_stages_runs_as_planned(tmp_path, run_bench) -> None:
    """The actor at ZeRO-3 (the reference following it), critic and reward whole, on 2 ranks. The engines report
    those stages, and their own tensors agree: a ZeRO-3 role holds half of its bf16 weights on each rank plus
    whole copies of the tensors under DS-Chat's stage3_param_persistence_threshold (1e4 elements: model=tiny's
    biases and norms, 4 x 1,664 + 256 = 6,912 elements), a ZeRO-2 or frozen ZeRO-0 role all of them. The ZeRO-3
    actor generates in lockstep on both ranks. Every role's planned model state (the ZeRO paper's formulas, as
    the planner applies them) is within 3 % of what its engine holds."""
    args = plan_run.expand([f"plan={_plan(tmp_path, **DIFFERING)}", "framework=dschat", "steps=3",
                            "warmup_steps=1", "framework.optimizer=torch_adamw"], "dschat")
    record = run_bench(*args)
    assert record["status"] == "ok", record["error"]
    ppo = record["stages"]["ppo"]
    assert ppo["engine_knobs"]["zero_stage"] == {"actor": 3, "ref": 3, "critic": 2, "reward": 0}  # the engines' own
    state, params = ppo["model_state"], ppo["params"]
    for role, zero3 in (("actor", True), ("ref", True), ("critic", False), ("reward", False)):
        expected = 2 * (params[role]["total"] // 2 + 6_912) if zero3 else 2 * params[role]["total"]
        assert state[role]["param_bytes_per_rank"] == [expected] * 2, role
    generation = ppo["throughput"]["phases"]["generation"]
    assert len(generation["tokens_per_s_per_rank"]) == 2
    assert generation["tokens_per_s_global"] > max(generation["tokens_per_s_per_rank"])
    plan = record["plan"]
    assert plan["file"].endswith("plan.yaml") and plan["document"]["execution_plan"]["actor"]["zero"] == 3
    assert record["config"]["framework"]["critic_zero_stage"] == 2 and record["config"]["zero"] == 3
    by_role = {r["role"]: r for r in plan["roles"]}
    assert by_role["critic"]["knobs"]["framework.critic_zero_stage (--critic_zero_stage)"] == 2
    for role in ("actor", "critic", "reference", "reward"):
        assert abs(by_role[role]["error"]) <= 0.03, (role, by_role[role])
    assert [p["phase"] for p in plan["phases"]] == ["generation", "experience", "training"]
    assert all(p["measured_growth_bytes"] for p in plan["phases"])


def test_a_critic_lora_rank_runs_where_the_framework_has_a_knob_for_it(tmp_path) -> None:
    """DS-Chat's --critic_lora_dim expresses a plan's own critic rank; trlx has no such knob and refuses it."""
    path = _plan(tmp_path, workload={"lora": 8, "critic_lora": 4})
    assert "framework.critic_lora_dim=4" in plan_run.expand([f"plan={path}"], "dschat")
    with pytest.raises(UnsupportedError, match=r"workload.critic_lora=4 cannot be run: the critic's LoRA rank is a "
                                               r"framework knob"):
        plan_run.expand([f"plan={path}"], "trlx")
