"""scripts/gpu_plans.py, the GPU check of each framework's plan: its commands, the refusal without CUDA, and the
comparison it writes, on a hand-made plan and record (the GPU run itself needs a device: docs/gpus.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_plans  # noqa: E402

GIB = 2**30


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_the_dry_run_plans_then_runs_every_framework() -> None:
    done = subprocess.run([sys.executable, "scripts/gpu_plans.py", "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 10
    assert lines[0].startswith("-m bench.plan model=glm-base") and "framework=dschat" in lines[0]
    assert lines[1].startswith("-m bench.run plan=results/gpu-plans/plan-dschat.yaml")


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_without_cuda_it_refuses() -> None:
    done = subprocess.run([sys.executable, "scripts/gpu_plans.py", "--out", "/nonexistent"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "never falls back to the CPU" in done.stderr


def test_the_comparison_sets_the_plan_beside_the_growth(tmp_path) -> None:
    (tmp_path / "plan-dschat.yaml").write_text(yaml.safe_dump({
        "predicted": {"phase_gib_per_gpu": {"generation": 3.0, "training": 6.0}},
        "framework": {"layout": "--actor_zero_stage 2"}}))
    (tmp_path / "plan-dschat").mkdir()
    (tmp_path / "plan-dschat" / "record.json").write_text(json.dumps({"status": "ok", "stages": {"ppo": {"memory": {
        "phases": {"generation": {"growth_over_baseline_bytes": 2 * GIB},
                   "training": {"growth_over_baseline_bytes": 8 * GIB}}}}}}))
    found = gpu_plans.compare(str(tmp_path), "dschat")
    # 3 GiB planned against 2 measured: +50 %; 6 against 8: -25 %
    assert found["phases"] == {"generation": {"planned_gib": 3.0, "measured_gib": 2.0, "error": 0.5},
                               "training": {"planned_gib": 6.0, "measured_gib": 8.0, "error": -0.25}}
    assert gpu_plans.compare(str(tmp_path), "trlx") == {"status": "missing", "phases": {}}
    text = gpu_plans.render({"device": "H100", "total_gib": 79.11, "frameworks": {"dschat": found}})
    assert "| dschat | --actor_zero_stage 2 | generation | 3.0 | 2.0 | +50% |" in text


def test_the_device_s_card_is_named_with_its_own_memory() -> None:
    assert gpu_plans.gpu_keys("NVIDIA H200", 139.8) == ["cluster.gpu=H200-141GB", "cluster.gpu_memory_gib=139.80"]
    assert gpu_plans.gpu_keys("NVIDIA H100 80GB HBM3", 79.11)[0] == "cluster.gpu=H100-80GB"
