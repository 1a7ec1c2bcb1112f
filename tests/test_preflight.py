"""preflight=on|shrink: a run predicted not to fit is refused (or shrunk) before anything is launched."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from bench.plan import preflight as pf
from bench.run.config import compose
from bench.run.spec import SpecError, spec_from_config
from tests.processes import run_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM_BASE_SFT = ["framework=dschat", "stage=sft", "model=glm-base", "prompt_len=128", "answer_len=128", "zero=2",
                "precision=bf16", "launcher.nproc=2"]


def _worst(*overrides: str) -> float:
    spec = spec_from_config(compose([*GLM_BASE_SFT, *overrides]))
    return pf.worst(spec, "cpu", 1.0, "test").predicted_bytes


def test_on_refuses_with_the_numbers():
    spec = spec_from_config(compose([*GLM_BASE_SFT, "batch=8", "memory_budget_gb=1", "preflight=on"]))
    with pytest.raises(pf.PreflightRefusal) as err:
        pf.preflight(spec, "on", "cpu")
    message = str(err.value)
    assert "sft training is predicted to peak at" in message and "batch 8" in message
    assert "memory_budget_gb=1 per rank" in message and "preflight=shrink" in message


def test_on_lets_a_fitting_run_through_and_says_what_it_found():
    spec = spec_from_config(compose([*GLM_BASE_SFT, "batch=2", "memory_budget_gb=20", "preflight=on"]))
    same, found = pf.preflight(spec, "on", "cpu")
    assert same is spec and found["verdict"]["fits"] and found["run_batch"] == 2
    assert found["verdict"]["predicted_peak_bytes"] == pytest.approx(_worst("batch=2"), abs=1)


def test_shrink_halves_the_batch_until_it_fits():
    at8, at2 = _worst("batch=8"), _worst("batch=2")
    assert at8 > at2
    budget_gib = (at8 + at2) / 2 / pf.SAFETY / 2**30  # batch 8 does not fit, batch 2 does (4 may)
    spec = spec_from_config(compose([*GLM_BASE_SFT, "batch=8", f"memory_budget_gb={budget_gib}"]))
    shrunk, found = pf.preflight(spec, "shrink", "cpu")
    assert shrunk.batch in (2, 4) and found["asked_batch"] == 8 and found["run_batch"] == shrunk.batch
    assert not found["asked"]["fits"] and found["verdict"]["fits"]
    assert dataclasses.replace(spec, batch=shrunk.batch) == shrunk
    tiny = spec_from_config(compose([*GLM_BASE_SFT, "batch=8", "memory_budget_gb=0.3"]))
    with pytest.raises(pf.PreflightRefusal, match="still at batch 1"):
        pf.preflight(tiny, "shrink", "cpu")


def test_the_mode_is_validated():
    with pytest.raises(SpecError, match="preflight='maybe' is not allowed"):
        spec_from_config(compose(["preflight=maybe"]))


def test_trl_runs_are_checked_by_its_memory_model():
    """TRL's SFT on the tiny model: its model's prediction (adapters/hf_trl/memory.py) against a 10 MiB budget."""
    spec = spec_from_config(compose(["framework=trl", "stage=sft", "preflight=on", "memory_budget_gb=0.01"]))
    with pytest.raises(pf.PreflightRefusal, match=r"sft training is predicted to peak at"):
        pf.preflight(spec, "on", "cpu")


def test_a_framework_without_a_memory_model_is_let_through(monkeypatch):
    spec = spec_from_config(compose(["framework=trl", "stage=sft", "preflight=on", "memory_budget_gb=0.01"]))
    monkeypatch.setattr(pf, "predict_stage", lambda *a, **k: None)  # as a registry entry without `memory`
    same, found = pf.preflight(spec, "on", "cpu")
    assert same is spec and "no memory model" in found["skipped"]


@pytest.mark.engine
def test_cli_refuses_before_launch_and_keeps_a_record(tmp_path):
    proc = run_tree([sys.executable, "-m", "bench.run", *GLM_BASE_SFT, "preflight=on", "memory_budget_gb=0.5",
                     f"output_root={tmp_path}", "run_name=refused"], timeout=120, check=False, cwd=REPO, text=True)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "refused before launch" in proc.stdout
    record = json.loads((tmp_path / "runs" / "refused" / "record.json").read_text())
    assert record["status"] == "skipped" and record["error"]["phase"] == "preflight"
    assert "predicted to peak" in record["error"]["message"]


@pytest.mark.engine
def test_cli_shrinks_and_runs_at_the_smaller_batch(tmp_path):
    # the tiny model with a wide vocabulary, so that the batch moves the predicted peak (its logits)
    tiny = ["framework=dschat", "stage=sft", "model=tiny", "model.vocab=32768", "prompt_len=64", "answer_len=64",
            "steps=2", "warmup_steps=1", "framework.optimizer=torch_adamw"]
    at8 = pf.worst(spec_from_config(compose([*tiny, "batch=8"])), "cpu", 1.0, "").predicted_bytes
    at2 = pf.worst(spec_from_config(compose([*tiny, "batch=2"])), "cpu", 1.0, "").predicted_bytes
    assert at8 > at2
    budget = (at8 + at2) / 2 / pf.SAFETY / 2**30
    proc = run_tree([sys.executable, "-m", "bench.run", *tiny, "batch=8", f"memory_budget_gb={budget}",
                     "preflight=shrink", f"output_root={tmp_path}", "run_name=shrunk"], timeout=600, check=False,
                    cwd=REPO, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "runs" / "shrunk" / "record.json").read_text())
    assert record["status"] == "ok"
    assert record["config"]["batch"] in (2, 4) and record["preflight"]["asked_batch"] == 8
    assert record["stages"]["sft"]["memory"]["prediction"]["phases"]["training"]["predicted_bytes"] > 0
