"""The GPU check script: its plan (--dry-run), its refusal without CUDA, and its summary arithmetic on
hand-made CUDA-shaped records (the real run needs a GPU: see docs/gpus.md)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.report_records import MIB, config, record, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_dry_run_lists_every_run_on_cuda_most_important_first():
    done = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", "x"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    runs = [line for line in done.stdout.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert [r.split()[1].rstrip(":") for r in runs[:4]] == ["base-z2-dschat", "base-z2-colossalai", "base-z2-trlx",
                                                             "base-z2-dschat-he"]
    commands = [line for line in done.stdout.splitlines() if "-m bench.run" in line]
    assert len(commands) == len(runs) >= 13
    assert all("launcher.device=cuda" in c and "output_root=x" in c for c in commands)


def test_an_unknown_run_name_is_refused_with_the_allowed_names(capsys):
    assert _module().main(["--dry-run", "--only", "base-z2-dschat,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown run(s) nope" in err and "base-z2-trlx" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run for real")
def test_without_cuda_it_refuses_and_never_falls_back_to_the_cpu(tmp_path, capsys):
    assert _module().main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "runs")


def _cuda_record(name: str, generation_tokens_per_s: float) -> dict:
    data = record(config(stage={"name": "ppo", "stages": ["ppo"]}, **{"launcher.nproc": 1}), run_id=name,
                  step_s=2.0)
    data["environment"] = {"device": "cuda", "gpu": "NVIDIA H200", "cpu_count": 16}
    stage = data["stages"]["ppo"]
    training = stage["memory"]["phases"]["training"]
    training.update(allocated_peak_bytes=1000 * MIB, reserved_peak_bytes=1200 * MIB)
    stage["memory"]["outside_allocator_per_rank"] = [
        {"nvml_process_bytes": 1700 * MIB, "reserved_bytes": 1200 * MIB, "outside_allocator_bytes": 500 * MIB}]
    stage["memory"]["phases"]["generation"] = dict(training, allocated_peak_bytes=800 * MIB)
    stage["throughput"]["phases"]["generation"] = {"time_s_per_step": 1.0, "time_s_per_step_per_rank": [1.0],
                                                   "tokens_per_s_global": generation_tokens_per_s}
    return data


def test_the_summary_reads_allocated_reserved_nvml_mfu_and_the_hybrid_engine_speedup(tmp_path):
    module = _module()
    write(str(tmp_path / "runs"), "base-z2-dschat", _cuda_record("a", 400.0))
    write(str(tmp_path / "runs"), "base-z2-dschat-he", _cuda_record("b", 1000.0))
    summary = module.summarize(str(tmp_path), ["base-z2-dschat", "base-z2-dschat-he", "base-z3-trlx"])
    run = summary["runs"]["base-z2-dschat"]
    assert run["phases"]["training"]["allocated_peak_bytes"] == 1000 * MIB
    assert run["phases"]["training"]["reserved_peak_bytes"] == 1200 * MIB
    assert run["outside_allocator_bytes"] == 500 * MIB and run["nvml_process_bytes"] == 1700 * MIB
    # training did 0.5 TFLOP/s for 2 s, generation (1 s) counted no FLOPs: 1 TFLOP per 3 s step, of H200's 989
    assert run["tflops_per_s"] == pytest.approx(1 / 3) and run["mfu"] == pytest.approx(1 / 3 / 989.0)
    assert summary["hybrid_engine_generation_speedup"] == pytest.approx(2.5)
    assert summary["runs"]["base-z3-trlx"] == {"status": "not run"}
    text = module.render(summary)
    assert "| base-z2-dschat | ok | training | 1,000 | 1,200 |" in text and "2.50x" in text
