"""Sweeps that survive reality: resume after a kill, the OOM back-stop, progress over the cells.

The resume test drives real runs (trlx SFT, 2 steps) in a real Hydra multirun, killed midway.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.results.record import ResultRecord, StageRecord, utc_now
from bench.run.config import compose
from bench.run.sweep import cell_key, oom_backstop
from bench.run.sweep_progress import sweep_size

REPO = Path(__file__).resolve().parent.parent
SFT = ["framework=trlx", "stage=sft", "steps=2", "warmup_steps=1"]


def sweep(root: Path, *overrides: str, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.run", "-m", *overrides, f"output_root={root}", "sweep_name=s"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def records(root: Path) -> dict[str, dict]:
    found = {}
    for path in glob.glob(str(root / "sweeps" / "s" / "*" / "record.json")):
        with open(path) as f:
            found[os.path.basename(os.path.dirname(path))] = json.load(f)
    return found


def test_sweep_size_counts_the_cartesian_product():
    assert sweep_size(["framework=dschat,trlx", "zero=0,2,3", "lora=8", "batch=range(1,5)"]) == 24


def test_cell_key_ignores_what_does_not_change_a_measurement():
    a = compose(["batch=2"])
    b = dict(compose(["batch=2", "launcher.timeout_s=5", "wandb=offline"]), run_name="x", sweep_name="y")
    assert cell_key(a) == cell_key(b)
    assert cell_key(a) != cell_key(compose(["batch=4"]))
    assert cell_key(a, ("batch",)) == cell_key(compose(["batch=4"]), ("batch",))


def processes_under(path: Path) -> list[str]:
    """Command lines of live processes that mention `path` (the runs of a sweep rooted there)."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                text = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in text and "pytest" not in text:
            found.append(text)
    return found


@pytest.mark.engine
def test_a_killed_sweep_resumes_with_only_the_missing_runs(tmp_path):
    proc = sweep(tmp_path, *SFT, "batch=1,2,3", wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not any(r.get("finished_utc") for r in records(tmp_path).values()):
        time.sleep(0.2)
    time.sleep(3)  # the second cell's ranks are up and training when the sweep dies
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while processes_under(tmp_path) and time.time() < deadline:  # the running cell's ranks die with the sweep
        time.sleep(0.5)
    assert not processes_under(tmp_path), processes_under(tmp_path)
    before = {cell: r for cell, r in records(tmp_path).items() if r.get("finished_utc")}
    assert len(before) == 1, records(tmp_path)

    again = sweep(tmp_path, *SFT, "batch=1,2,3")
    assert again.returncode == 0, again.stderr[-3000:]
    after = records(tmp_path)
    assert len(after) == 3 and all(r["finished_utc"] and r["status"] == "ok" for r in after.values()), after
    (done_cell, done), = before.items()
    assert after[done_cell]["created_utc"] == done["created_utc"]  # kept, not run again
    assert again.stdout.count("already done (ok)") == 1
    assert "3/3 · ok 3 · failed 0 · skipped 0 · kept 1" in again.stderr


@pytest.mark.engine
def test_force_runs_a_finished_cell_again(tmp_path):
    first = sweep(tmp_path, "framework=trlx", "tp=2")  # invalid on 1 rank: a finished record, nothing launched
    assert first.returncode == 0
    (cell, record), = records(tmp_path).items()
    time.sleep(1.1)
    assert "already done (error)" in sweep(tmp_path, "framework=trlx", "tp=2").stdout
    assert records(tmp_path)[cell]["created_utc"] == record["created_utc"]
    sweep(tmp_path, "framework=trlx", "tp=2", "force=true")
    assert records(tmp_path)[cell]["created_utc"] != record["created_utc"]


@pytest.mark.engine
def test_oom_at_a_batch_skips_the_larger_batches_of_that_configuration(tmp_path):
    # The sweep holds a finished record that ran out of memory at batch 2 (as a worker writes it); the larger
    # batches of the same configuration are recorded as skipped without launching, smaller ones and other
    # configurations are untouched (validated here without running them: tp=2 is invalid on 1 rank).
    cell = tmp_path / "sweeps" / "s" / "batch=2,framework=trlx,stage=sft,steps=2,warmup_steps=1"
    oom = ResultRecord(run_id=cell.name, config=compose([*SFT, "batch=2"]), status="oom",
                       error={"message": "CUDA out of memory", "phase": "training"})
    oom.stages["sft"] = StageRecord(status="oom", error=oom.error)
    oom.finished_utc = utc_now()
    oom.write(str(cell / "record.json"))
    result = sweep(tmp_path, *SFT, "batch=2,4,8")
    assert result.returncode == 0, result.stderr[-3000:]
    found = records(tmp_path)
    for batch in (4, 8):
        record = found[f"batch={batch},framework=trlx,stage=sft,steps=2,warmup_steps=1"]
        assert record["status"] == "skipped" and record["error"]["message"] == "skipped (oom at batch 2)"
        assert record["stages"]["sft"]["status"] == "skipped"
        assert not (cell.parent / f"batch={batch},framework=trlx,stage=sft,steps=2,warmup_steps=1" / "sft").exists()
    assert found[cell.name]["status"] == "oom"
    assert oom_backstop(compose([*SFT, "batch=1"]), str(cell.parent), "/elsewhere") is None
    assert oom_backstop(compose([*SFT, "batch=4", "zero=2"]), str(cell.parent), "/elsewhere") is None


@pytest.mark.engine
@pytest.mark.slow  # CI runs hydra's submitit launcher on a real SLURM instead (tests/test_multinode.py)
def test_a_sweep_runs_through_the_submitit_local_launcher(tmp_path):
    # The path a SLURM sweep takes (hydra/launcher=submitit_slurm), with submitit's local executor: the
    # cell is pickled, run in a submitit job process, and launches its own torchrun tree from there.
    result = sweep(tmp_path, "hydra/launcher=submitit_local", "framework=trlx", "stage=sft", "steps=2",
                   "warmup_steps=1", "tp=1,2")
    assert result.returncode == 0, result.stderr[-3000:]
    found = records(tmp_path)
    assert found["framework=trlx,stage=sft,steps=2,tp=1,warmup_steps=1"]["status"] == "ok"
    assert found["framework=trlx,stage=sft,steps=2,tp=2,warmup_steps=1"]["status"] == "error"  # tp=2 on 1 rank
    assert glob.glob(str(tmp_path / "sweeps" / "s" / ".submitit" / "*" / "*_log.out"))


@pytest.mark.engine
def test_parallel_cells_train_the_prerequisite_reward_model_once(tmp_path):
    """Two sweep cells that need the same prerequisite RM at once: one trains it, the other waits on the lock
    and reads it (without the lock both trained in one directory, deleting each other's rank files)."""
    import threading

    from bench.run.benchmark import prerequisite
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    specs = [spec_from_config(compose(["framework.optimizer=torch_adamw", "stage_steps.rm=3", "warmup_steps=1",
                                       f"framework.ppo.kl_ctl={kl}"])) for kl in (0.1, 0.2)]
    results: list[dict] = []
    threads = [threading.Thread(target=lambda s=s: results.append(prerequisite(s, "rm", str(tmp_path))))
               for s in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(r["cached"] for r in results) == [False, True], results
    assert all(r["status"] == "ok" for r in results) and results[0]["checkpoint"] == results[1]["checkpoint"]


@pytest.mark.engine
def test_two_sweeps_over_one_directory_run_each_cell_once(tmp_path):
    """Two processes sweep the same cells into the same directory at once: every record parses, every cell
    has run exactly once (the other sweep found it claimed or done), nothing is lost."""
    cmd = [sys.executable, "-m", "bench.run", "-m", *SFT, "seed=1,2,3", f"output_root={tmp_path}", "sweep_name=s"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    found = records(tmp_path)
    assert sorted(r["config"]["seed"] for r in found.values()) == [1, 2, 3]
    assert all(r["status"] == "ok" for r in found.values()), {k: r["error"] for k, r in found.items()}
    left = sum(out.count("running in another process") + out.count("already done") for out in outputs)
    assert left == 3, "each cell must be run by one sweep and left by the other"
