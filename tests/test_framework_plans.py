"""`python -m bench.plan framework=X|all`: each framework's declared layout space (adapters/<framework>/plan_space.py)
written as plans that `bench.run plan=FILE` runs as exactly those knobs, predicted by the framework's own memory
model, and the side-by-side table."""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from adapters import registry
from bench.plan import plan_file
from bench.plan.cluster import Cluster, Workload
from bench.plan.framework_plans import FrameworkPlan, base_spec, evaluate_point, plan_document
from bench.plan.physics import Arch, Terms
from bench.plan.predict import physics
from bench.plan.run_shape import RunShape, offloaded
from bench.run import plan_run
from bench.run.config import compose
from bench.run.spec import RunSpec, spec_from_config

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
# a small model with 4 heads (tp 2 divides them) on 2 GPUs: every framework's whole space is enumerable
MODELS = {"dschat": "tiny", "colossalai": "tiny-llama", "trlx": "tiny", "trl": "tiny", "torch": "tiny"}


def _context(model: str) -> tuple[str, Arch, Arch, Cluster, Workload]:
    return plan_file.context({"model": model, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "A100-80GB"},
                              "workload": {"micro_batch": 1, "global_batch": 2, "prompt_len": 16, "answer_len": 16}})


@functools.cache
def _base(framework: str, lora: int) -> RunSpec:
    name, _, _, cluster, workload = _context(MODELS[framework])
    return base_spec(framework, [f"model={name}"], cluster, replace(workload, lora=lora))


def _written(point: dict, framework: str, tmp_path: Path, lora: int = 0) -> tuple[FrameworkPlan, str]:
    name, arch, critic, cluster, workload = _context(MODELS[framework])
    space = registry.plan_space(framework)
    # one micro-batch a data-parallel rank: no accumulation, which some plugins refuse whatever the layout
    workload = replace(workload, lora=lora, global_batch=space.roles(point, cluster.gpus)["actor"].dp)
    spec = _base(framework, lora)
    plan = evaluate_point(space, spec, point, arch, critic, cluster, workload, registry.memory_model(framework)
                          or (lambda shape: {"training": Terms()}))
    assert not isinstance(plan, str), f"{framework} {point}: {plan}"
    path = tmp_path / f"{framework}-{len(list(tmp_path.iterdir()))}.yaml"
    plan_file.write(plan_document(plan, name, None, cluster), str(path), "")
    return plan, str(path)


@pytest.mark.engine  # every declared point through bench.run's plan expansion (DS-Chat's: tens of seconds)
@pytest.mark.parametrize("framework", registry.names())
@pytest.mark.parametrize("lora", [0, 4])
def test_every_declared_layout_runs_as_its_own_knobs(framework, lora, tmp_path) -> None:
    """Every point of the space, written as a plan, is accepted by `bench.run plan=` (the framework's own option
    check included) and becomes exactly the point's knobs: the oracle is the point, not the plan's translation."""
    name, arch, _, cluster, _ = _context(MODELS[framework])
    space = registry.plan_space(framework)
    points = list(space.points(arch, cluster.gpus, cluster.gpus_per_node, lora))
    assert points, framework
    for point in points:
        _, path = _written(point, framework, tmp_path, lora)
        args = plan_run.expand([f"plan={path}"], "dschat")  # the plan names its framework
        spec = spec_from_config(compose([a for a in args if not a.startswith("plan_file=")]))
        assert spec.framework == framework and spec.lora == lora
        for key, value in point.items():
            got = spec.framework_options[key.split(".", 1)[1]] if key.startswith("framework.") else getattr(spec, key)
            assert got == value, (framework, point, key, got)


def test_the_spaces_hold_what_their_scripts_set() -> None:
    """Sizes counted by hand from each framework's flags (2 GPUs, tiny-llama's 4 heads and 2 blocks for
    ColossalChat): DS-Chat 4 actor x 4 critic stages x 2 x 2 checkpointing x offload (off: 16 x 4; on: 3 x 3 x 4
    with both stages >= 1) = 100; ColossalChat (zero 0, 2, 3) x checkpointing x offload at tp 1 and 2 (PPO runs
    no pipeline): at tp 1 3 x 2 + 2 x 2 offloaded = 10, at tp 2 zero 0, 2 only: 2 x 2 + 1 x 2 = 6 -> 16; trlx its
    three accelerate configs (0, 2, 3); TRL 4 stages; the reference 4 x 2."""
    counts = {}
    for framework in registry.names():
        _, arch, _, cluster, _ = _context(MODELS[framework])
        counts[framework] = len(list(registry.plan_space(framework).points(arch, 2, 2, 0)))
    assert counts == {"dschat": 100, "colossalai": 16, "trlx": 3, "trl": 4, "torch": 8}


def test_offload_moves_the_optimizer_and_zero3_weights_to_the_host_on_a_gpu_only() -> None:
    state = Terms(params=10.0, optimizer=60.0)
    cfg = compose(["framework=dschat", "model=tiny", "offload=true", "zero=2"])
    shape = RunShape.from_spec(spec_from_config(cfg), "ppo", "cuda")
    assert offloaded(shape, state) == Terms(params=10.0, host=60.0)
    assert offloaded(shape.__class__(**{**shape.__dict__, "zero": 3}), state) == Terms(host=70.0)
    assert offloaded(RunShape.from_spec(spec_from_config(cfg), "ppo", "cpu"), state) == state


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.plan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_all_prints_every_framework_beside_the_role_by_role_search(tmp_path) -> None:
    done = _cli("model=glm-10b", "cluster.gpus_per_node=8", "cluster.gpu=A100-80GB", "framework=all",
                f"out={tmp_path / 'x.yaml'}")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("│")[1].strip() for line in done.stdout.splitlines() if line.startswith("│ ")]
    assert {"dschat", "colossalai", "trlx", "trl", "torch", "any"} <= set(rows)
    assert not list(tmp_path.iterdir())  # the table writes no plan


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_framework_x_writes_a_plan_that_names_its_framework_and_commands(tmp_path) -> None:
    out = tmp_path / "p.yaml"
    done = _cli("model=glm-base", "cluster.gpus_per_node=2", "cluster.gpu=A100-80GB", "framework=dschat",
                "workload.global_batch=4", "workload.prompt_len=128", "workload.answer_len=128", f"out={out}")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = yaml.safe_load(out.read_text())
    assert doc["framework"]["name"] == "dschat"
    assert doc["framework"]["upstream_command"].startswith("deepspeed --num_nodes 1 --num_gpus 2 ")
    assert f"python -m bench.run plan={out} framework=dschat" in done.stdout
    assert plan_run.expand([f"plan={out}"], "torch")[0] == "framework=dschat"


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
@pytest.mark.parametrize("value", ["nope", "dschat,trlx"])
def test_an_unknown_framework_is_refused_by_name(value, tmp_path) -> None:
    done = _cli(f"framework={value}", f"out={tmp_path / 'x.yaml'}")
    assert done.returncode == 2 and f"framework={value!r}" in done.stdout and "allowed: any, all" in done.stdout
    assert not list(tmp_path.iterdir())


def _config_value(config: dict, key: str):
    head, _, tail = key.partition(".")
    return config[head][tail] if tail else config[head]


TINY_PLAN = ("model=tiny", "cluster.gpus_per_node=2", "cluster.gpu=A100-80GB", "workload.global_batch=4",
             "workload.micro_batch=2", "workload.prompt_len=16", "workload.answer_len=16")


@pytest.mark.engine
@pytest.mark.parametrize("framework", registry.names())
def test_a_plan_bench_plan_wrote_runs_in_its_framework(framework, tmp_path, run_bench) -> None:
    """`bench.plan framework=X` writes a tiny plan for 2 GPUs; `bench.run plan=FILE` runs it on 2 CPU ranks with the
    plan's knobs; the record keeps X's prediction beside every phase's measured growth, and X's memory model holds
    what X's engines held (their own counters: parameters and optimizer states, rank 0) to 0.1 %. At this size a
    phase's growth is mostly the runtime's allocations, so its error is recorded, not judged here (glm-base, slow
    tier, judges it)."""
    out = tmp_path / "plan.yaml"
    done = _cli(*TINY_PLAN, f"framework={framework}", f"out={out}")
    assert done.returncode == 0, done.stdout + done.stderr
    knobs = yaml.safe_load(out.read_text())["framework"]["knobs"]
    record = run_bench(*plan_run.expand([f"plan={out}", "steps=2", "warmup_steps=1"], "dschat"))
    assert record["status"] == "ok", record["error"]
    for knob in knobs:
        key, value = knob.split("=", 1)
        assert _config_value(record["config"], key) == yaml.safe_load(value), knob
    ppo = record["stages"]["ppo"]
    rows = record["plan"]["framework_phases"]["phases"]
    assert {r["phase"] for r in rows} == set(ppo["memory"]["phases"]) - {"imports"}
    assert all(r["measured_growth_bytes"] > 0 and r["error"] is not None for r in rows)
    held = sum(role["param_bytes_per_rank"][0] + role["optimizer_state_bytes_per_rank"][0]
               for name, role in ppo["model_state"].items() if name != "method")
    training = physics(spec_from_config(record["config"]), "ppo", "cpu")["training"]
    assert training.params + training.optimizer == pytest.approx(held, rel=1e-3)


GLM_BASE_PLAN = ("model=glm-base", "cluster.gpus_per_node=2", "cluster.gpu=A100-80GB", "workload.global_batch=4",
                 "workload.micro_batch=2", "workload.prompt_len=128", "workload.answer_len=128")
PHASE_BAND = 0.30  # each phase's physics error on glm-base, 2 CPU ranks, bf16, one run each: with the heap handed back
# before every phase ColossalChat -16 to -3 %, trlx -28 to +4 %, TRL -29 to +16 %; at the default release DS-Chat
# -13 to -8 %, the reference -14 to -3 %
# Every run hands the freed heap back before each phase (memory_release_every=1), so every step's host peak is
# recorded: without it a 2-step run records the phases after the first optimizer step as bounds only, and
# ColossalChat's onload to experience (1.3-1.5 GiB, before HybridAdam makes its moments) stood 44-60 % under its
# model, which counts the moments from the first step on


@pytest.mark.slow  # 5 glm-base PPO runs with their RM prerequisites, 2-4.5 minutes each
@pytest.mark.parametrize("framework", registry.names())
def test_a_glm_base_plan_predicts_each_phase_of_its_run(framework, tmp_path, run_bench) -> None:
    """The plan `bench.plan framework=X` writes for glm-base on 2 GPUs, run on 2 CPU ranks: X's memory model for
    that run (physics, no calibration) within PHASE_BAND of every phase's measured growth."""
    out = tmp_path / "plan.yaml"
    done = _cli(*GLM_BASE_PLAN, f"framework={framework}", f"out={out}")
    assert done.returncode == 0, done.stdout + done.stderr
    record = run_bench(*plan_run.expand([f"plan={out}", "steps=2", "warmup_steps=1", "stage_steps.rm=5",
                                         "memory_release_every=1"], "dschat"))
    assert record["status"] == "ok", record["error"]
    for row in record["plan"]["framework_phases"]["phases"]:
        assert abs(row["error"]) <= PHASE_BAND, row
