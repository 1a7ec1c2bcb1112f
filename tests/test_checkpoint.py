"""Checkpoints: the complete-or-partial protocol, overlapped writes, and resuming a killed run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from bench.run.checkpoint import BackgroundWriter, Checkpointer, latest_complete, snapshot_saves

REPO = Path(__file__).resolve().parent.parent


def test_an_overlapped_save_writes_a_snapshot_taken_at_the_call(tmp_path):
    writer = BackgroundWriter()
    weights = torch.zeros(4)
    buffer = io.BytesIO()
    with snapshot_saves(writer):
        torch.save({"w": weights, "steps": [1, (2, 3)]}, tmp_path / "state.pt")
        torch.save({"now": 1}, buffer)  # a buffer is written at once
    weights += 7  # training goes on while the writer works
    writer.close()
    assert torch.load(tmp_path / "state.pt")["w"].tolist() == [0, 0, 0, 0]
    assert torch.load(tmp_path / "state.pt")["steps"] == [1, (2, 3)]
    assert buffer.getbuffer().nbytes > 0
    assert torch.save.__module__ == "torch.serialization"  # restored after the block


def test_a_failed_background_write_is_raised_in_the_training_thread(tmp_path):
    writer = BackgroundWriter()
    with snapshot_saves(writer):
        torch.save({"w": torch.ones(1)}, tmp_path / "missing-dir" / "state.pt")
    with pytest.raises(RuntimeError, match="a background checkpoint write failed"):
        writer.wait()
    writer.close()


def _save_into(directory: str) -> None:
    torch.save({"w": torch.arange(3)}, os.path.join(directory, "model.pt"))


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_is_complete_only_after_its_writes_and_replaces_the_one_before(tmp_path, background):
    root = str(tmp_path / "checkpoints")
    checkpointer = Checkpointer(root, every=2, background=background, rank=0, save=_save_into)
    assert [checkpointer.due(n) for n in (1, 2, 3, 4)] == [False, True, False, True]
    checkpointer.save(2)
    assert latest_complete(root) == (None if background else (2, os.path.join(root, "step-2")))
    checkpointer.save(4)  # completes step 2 first (async), then removes it once step 4 is complete
    checkpointer.close()
    assert latest_complete(root) == (4, os.path.join(root, "step-4"))
    assert sorted(os.listdir(root)) == ["step-4"]
    assert sorted(os.listdir(os.path.join(root, "step-4"))) == ["meta.json", "model.pt", "rng-rank0.pt"]
    assert json.loads(Path(root, "step-4", "meta.json").read_text()) == {
        "steps_done": 4, "mode": "async" if background else "sync"}
    saves = checkpointer.saves
    assert [s["steps_done"] for s in saves] == [2, 4] and all(s["bytes_written"] > 0 for s in saves)
    assert ("background_write_s" in saves[0]) == background


def test_a_partial_checkpoint_is_never_the_one_resumed_from(tmp_path):
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "meta.json").write_text("{}")
    (tmp_path / "step-8.partial").mkdir()  # killed while writing
    (tmp_path / "step-12").mkdir()  # no meta.json: incomplete
    assert latest_complete(str(tmp_path)) == (4, str(tmp_path / "step-4"))
    assert latest_complete(str(tmp_path / "none")) is None


# --- real engines ---------------------------------------------------------------------------------------------

TORCH_ADAMW = "framework.optimizer=torch_adamw"


@pytest.mark.engine
@pytest.mark.parametrize("framework", ["dschat", "colossalai", "trlx"])
def test_an_interrupted_sft_resumes_from_its_overlapped_checkpoint(run_bench, tmp_path, framework):
    """Each framework's own save and load, overlapped: 2 steps and a save, the record lost as in a kill, then
    resume=true continues at step 2 and saves again."""
    common = (f"framework={framework}", "stage=sft", "precision=fp32", "warmup_steps=0", "checkpoint.every=2",
              "checkpoint.async=true") + ((TORCH_ADAMW,) if framework != "trlx" else ())
    first = run_bench(*common, "steps=2", name="run")
    assert first["stages"]["sft"]["status"] == "ok", first["stages"]["sft"]["error"]
    (tmp_path / "run" / "record.json").unlink()  # killed before the record was written
    second = run_bench(*common, "steps=4", "resume=true", name="run")
    sft = second["stages"]["sft"]
    assert sft["status"] == "ok", sft["error"]
    assert sft["resumed_from_step"] == 2
    assert [s["step"] for s in sft["steps"]] == [2, 3]
    assert [s["steps_done"] for s in sft["checkpoints"]["saves"]] == [4]
    # what a resumable fp32 SFT checkpoint must hold: the weights and AdamW's two moments, 12 bytes a parameter
    # (beside them only random states, step counters and metadata: within 5 % and 2 MiB)
    trained, written = sft["params"]["actor"]["trainable"], sft["checkpoints"]["saves"][0]["bytes_written"]
    assert 12 * trained <= written <= 1.05 * 12 * trained + 2 * 2**20, (written, 12 * trained)
    assert os.listdir(tmp_path / "run" / "sft" / "checkpoints") == ["step-4"]
    knobs = [e["knob"] for e in second["harness_extension"]]
    assert "checkpoint.async=true" in knobs
    assert ("checkpoint.every / resume" in knobs) == (framework == "dschat")  # the others save mid-run upstream


def _bench(root: Path, name: str, *overrides: str) -> subprocess.Popen:
    # DS-Chat: its step 3 keeps no running statistics outside the engines (trlx's resume loses its reward
    # scaling, an upstream defect the record marks), so a resumed run can match an uninterrupted one
    cmd = [sys.executable, "-m", "bench.run", "stage=ppo", "steps=24", "warmup_steps=1", "precision=fp32",
           TORCH_ADAMW, "checkpoint.every=4", "init.sft_prerequisite=false", f"output_root={root}",
           f"run_name={name}", *overrides]
    with open(root / f"{name}.log", "a") as log:  # a file, not a pipe: nobody reads while it runs
        return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _finished(proc: subprocess.Popen, root: Path, name: str) -> dict:
    proc.wait(timeout=600)
    assert proc.returncode == 0, (root / f"{name}.log").read_text()[-3000:]
    return json.loads((root / "runs" / name / "record.json").read_text())


@pytest.mark.engine
def test_a_ppo_run_killed_after_its_first_checkpoint_resumes_and_matches_an_uninterrupted_run(tmp_path):
    # the uninterrupted run and the one to kill run side by side (one rank each); the first to need the
    # prerequisite RM trains it, the other waits on its lock and shares it
    whole = _bench(tmp_path, "whole")
    killed = _bench(tmp_path, "killed")
    first = tmp_path / "runs" / "killed" / "ppo" / "checkpoints" / "step-4" / "meta.json"
    deadline = time.monotonic() + 300
    while not first.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.exists(), "no complete checkpoint before the deadline"
    # SIGKILL to the whole tree at once: bench.run, torchrun (its own session) and the rank
    tree = psutil.Process(killed.pid)
    for process in [*tree.children(recursive=True), tree]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    record_path = tmp_path / "runs" / "killed" / "record.json"
    assert not record_path.exists() or not json.loads(record_path.read_text()).get("finished_utc"), \
        "the run finished before the kill: nothing was tested"
    whole = _finished(whole, tmp_path, "whole")
    ppo = _finished(_bench(tmp_path, "killed", "resume=true"), tmp_path, "killed")["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    start = ppo["resumed_from_step"]
    assert start is not None and start % 4 == 0 and 4 <= start < 24
    assert [s["step"] for s in ppo["steps"]] == list(range(start, 24))
    reference = {s["step"]: s for s in whole["stages"]["ppo"]["steps"]}
    for step in ppo["steps"]:
        for key in ("loss/actor", "loss/critic", "reward", "kl"):
            assert step[key] == pytest.approx(reference[step["step"]][key], rel=1e-4, abs=1e-6), (step["step"], key)


@pytest.mark.slow  # trains trlx's prerequisite RM; trlx's save and load are in CI above
def test_a_resumed_trlx_ppo_run_is_marked_with_the_upstream_defect_it_hits(run_bench, tmp_path):
    from adapters.trlx.adapter import RESUME_DEFECT

    common = ("framework=trlx", "stage=ppo", "precision=fp32", "warmup_steps=0", "checkpoint.every=2")
    first = run_bench(*common, "steps=2", name="run")
    assert first["stages"]["ppo"]["upstream_defects"] == []
    (tmp_path / "run" / "record.json").unlink()
    ppo = run_bench(*common, "steps=3", "resume=true", name="run")["stages"]["ppo"]
    assert ppo["status"] == "ok" and ppo["resumed_from_step"] == 2, ppo["error"]
    assert [d["id"] for d in ppo["upstream_defects"]] == [RESUME_DEFECT]
