"""What every framework adapter satisfies, parametrized over the registry: a framework added to
adapters/registry.py that passes this module is wired into the harness's light paths (the planner, preflight,
bench.run plan=, the report's fidelity pages); its engine tests (tests/test_<framework>.py) then drive its real
engines. docs/frameworks/index.md ("Adding a framework") points here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from adapters import registry
from bench.plan.cluster import ROLES
from bench.plan.framework_space import FrameworkSpace
from bench.plan.plan_file import arch_of
from bench.plan.predict import physics
from bench.run.config import compose
from bench.run.spec import SpecError, UnsupportedError, spec_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("sft", "rm", "ppo", "grpo")
FRAMEWORKS = registry.names()
HEAVY = ("torch", "deepspeed", "colossalai", "trl", "trlx", "transformers", "accelerate", "peft")


def test_the_light_paths_import_no_framework():
    """Each framework's options, layout space and memory model load without torch or any engine: the planner,
    preflight and the report run where no framework is installed (one fresh process, every framework)."""
    code = ("import json, sys\nfrom adapters import registry\n"
            "for n in registry.names():\n"
            "    registry.options_class(n); registry.plan_space(n); registry.memory_model(n)\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_stage_runs_or_is_refused_as_unsupported_naming_the_framework(framework):
    runs = []
    for stage in STAGES:
        try:
            registry.check_stages(framework, (stage,))
        except UnsupportedError as err:
            assert f"framework={framework}" in str(err) and stage in str(err), str(err)
            continue
        runs.append(stage)
    assert {"sft", "rm", "ppo"} <= set(runs), runs  # the harness's three RLHF stages, in every framework


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_its_memory_model_predicts_every_phase_of_every_stage_it_runs(framework):
    spec = spec_from_config(compose([f"framework={framework}", "stage=ppo"]), env={}, check=False)
    for stage in STAGES:
        try:
            registry.check_stages(framework, (stage,))
        except UnsupportedError:
            continue
        phases = physics(spec, stage, "cpu")
        assert phases and "init" in phases and all(t.device > 0 for t in phases.values()), (stage, phases)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_its_layout_space_lays_out_every_role_and_its_own_option_check_accepts_the_plan(framework):
    """Every point of the declared space on 2 GPUs: the four roles laid out over them, the framework's own command,
    and the execution plan expressed back as the framework's knobs (its options class's plan_knobs) without a
    refusal: one declaration, read by the search and by bench.run plan= alike."""
    space = registry.plan_space(framework)
    assert isinstance(space, FrameworkSpace) and space.framework == framework and space.axes
    options = registry.options_class(framework)
    arch = arch_of("tiny")[1]
    points = list(space.points(arch, 2, 2, 0))
    assert points, "an empty layout space"
    for point in points:
        layouts = space.roles(point, 2)
        assert set(layouts) == set(ROLES) and all(lay.gpus == 2 for lay in layouts.values()), point
        knobs = options.plan_knobs(layouts)
        for key, value in point.items():
            if key in knobs.common:
                assert knobs.common[key] == value, (point, key, knobs.common)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_option_it_does_not_have_is_refused_naming_the_framework_and_the_key(framework):
    with pytest.raises(SpecError, match=rf"framework \({framework}\).*no_such_knob"):
        spec_from_config(compose([f"framework={framework}", "stage=sft", "+framework.no_such_knob=1"]), env={})


PINNED = re.compile(r"`(test_[a-z0-9_]+)::(test_[a-z0-9_]+)")


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "torch"])
def test_its_fidelity_page_pins_every_row_to_tests_that_exist(framework):
    """docs/frameworks/<framework>.md holds a fidelity table (upstream, this adapter, match or declared deviation,
    pinned by), and every test it names exists: a row pinned to a renamed or deleted test fails here. The
    plain-PyTorch reference has no upstream to be faithful to."""
    with open(os.path.join(ROOT, "docs", "frameworks", f"{framework}.md")) as f:
        page = f.read()
    assert "## Fidelity to upstream" in page
    table = page.split("## Fidelity to upstream", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| aspect")]
    assert len(rows) >= 5, len(rows)
    for module, test in PINNED.findall(table):
        with open(os.path.join(ROOT, "tests", f"{module}.py")) as f:
            assert re.search(rf"(?m)^def {test}\(", f.read()), f"{framework}'s page pins {module}::{test}"
