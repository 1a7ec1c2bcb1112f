"""What a newcomer sees: set-up's terminal, `--help`, the result table at 80 columns, the reward's trend.

The default run's terminal (no engine chatter, all of it in the stage logs) is checked with the README's
command itself in tests/test_dschat.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bench.measure.reward_trend import reward_trend
from bench.results.record import SETUP_PHASES
from bench.results.table import PHASE_WIDTH, print_record, result_table
from bench.run.cli_help import GROUPS, help_text, presets
from bench.run.config import CONF_DIR
from bench.run.spec import STEP_PHASES

REPO = Path(__file__).resolve().parent.parent
FILTER = REPO / "scripts" / "pip_quiet.py"
FRESH_SETUP = Path(__file__).parent / "data" / "pip-fresh-setup.txt"  # pip's output of a set-up on a fresh machine


def _filtered(text: str, log: Path) -> list[str]:
    done = subprocess.run([sys.executable, str(FILTER), str(log)], input=text, capture_output=True, text=True,
                          check=True)
    return done.stdout.splitlines()


def _summary(log: Path) -> str:
    return subprocess.run([sys.executable, str(FILTER), "--summary", str(log)], capture_output=True, text=True,
                          check=True).stdout


def test_fresh_set_ups_pip_output_shows_no_error_line_and_keeps_everything_in_the_log(tmp_path):
    raw = FRESH_SETUP.read_text()
    assert "ERROR: pip's dependency resolver" in raw and "BuildBackendWarning" in raw  # what a newcomer saw
    log = tmp_path / "setup.log"
    shown = _filtered(raw, log)
    assert not [line for line in shown if "ERROR" in line], shown
    assert not [line for line in shown if "requires" in line or "BuildBackendWarning" in line], shown
    assert log.read_text() == raw  # nothing lost: every line is in the log
    summary = _summary(log)
    assert summary.count("\n") == 1 and "colossalai 0.5.0" in summary and str(log) in summary
    for left_out in ("ray", "diffusers==0.29.0", "sentencepiece", "torch 2.13.0+cpu (it asks torch<=2.5.1,>=2.2.0)"):
        assert left_out in summary, left_out


def test_this_machines_set_up_log_through_the_filter_shows_no_error_line(tmp_path):
    log = REPO / ".venv" / "setup.log"
    if not log.exists():
        pytest.skip("no .venv/setup.log: scripts/setup.sh has not run in this checkout")
    shown = _filtered(log.read_text(), tmp_path / "again.log")
    assert not [line for line in shown if line.startswith("ERROR")], shown


def test_real_problems_still_reach_the_terminal(tmp_path):
    raw = "\n".join([
        "WARNING: Location 'file:///opt/pypi-more/simple/pip/' is ignored: it is neither a file nor a directory.",
        "ERROR: pip's dependency resolver does not currently take into account all the packages that are "
        "installed. This behaviour is the source of the following dependency conflicts.",
        "colossalai 0.5.0 requires ray, which is not installed.",
        "datasets 4.0.0 requires fsspec[http]<=2025.3.0,>=2023.1.0, but you have fsspec 2026.9.0 which is "
        "incompatible.",
        "ERROR: Could not find a version that satisfies the requirement nosuchpackage==9",
        "[notice] A new release of pip is available: 25.1 -> 26.0",
    ]) + "\n"
    shown = _filtered(raw, tmp_path / "log")
    assert shown == [
        "setup: pip reports a dependency conflict: datasets 4.0.0 requires fsspec[http]<=2025.3.0,>=2023.1.0, but "
        "you have fsspec 2026.9.0 which is incompatible.",
        "ERROR: Could not find a version that satisfies the requirement nosuchpackage==9",
    ]


def test_no_summary_line_when_pip_reported_nothing_about_colossalai(tmp_path):
    log = tmp_path / "log"
    log.write_text("Successfully installed einops-0.8.2\n")
    assert _summary(log) == ""


def _record(phases: list[str]) -> dict:
    """A record as the harness writes it, with figures as wide as a GPU run of glm-10b makes them."""
    memory = {p: {"peak_bytes": 81_234.5 * 2**20, "growth_over_baseline_bytes": 79_876.5 * 2**20} for p in phases}
    speed = {p: {"time_s_per_step": 12.345, "tokens_per_s_global": 123_456.7, "samples_per_s_global": 1_234.5,
                 "tflops_per_s_per_rank": [123.4567]} for p in phases}
    stage = {"status": "ok", "memory": {"phases": memory, "method": "torch.cuda.max_memory_allocated (reset per "
                                        "phase), per rank"},
             "throughput": {"phases": speed, "warmup_steps_excluded": 2}, "stability": {"classification": "stable"},
             "learning": {}, "notes": []}
    config = {"framework": {"name": "colossalai"}, "stage": {"name": "pipeline"}, "model": {"name": "glm-10b"},
              "precision": "bf16", "zero": 3, "lora": 128, "batch": 16, "launcher": {"nproc": 8}}
    return {"config": config, "status": "ok", "stages": {"sft": stage, "rm": stage, "ppo": stage}}


def test_the_result_table_shows_every_phase_name_whole_at_80_columns():
    phases = [*SETUP_PHASES, *STEP_PHASES, "evaluation", "checkpoint"]
    assert max(len(p) for p in phases) <= PHASE_WIDTH
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 -- closed with the console
    console.print(result_table(_record(phases)))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    rows = [line.split()[:2] for line in text.splitlines()]  # stage (its first row only), phase
    for phase in phases:
        assert sum(phase in row for row in rows) == 3, phase  # whole, once per stage
    assert "…" not in text
    assert "MiB" in text and "TFLOP/s" in text and "123,456.7" in text and "81,234.5" in text


def test_the_closing_lines_name_the_record_and_the_report_command(tmp_path):
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 -- closed with the console
    path = str(tmp_path / "runs" / "r1" / "record.json")
    print_record(_record(["init", "training"]), path, console, report_root=str(tmp_path / "runs"))
    lines = console.export_text().splitlines()
    assert lines[-2] == f"record: {path}"  # a path is never wrapped, whatever its length
    assert lines[-1] == f"report: python -m bench.report {tmp_path / 'runs'}"


def test_the_reward_trend_weighs_the_change_against_its_noise():
    # first window 1, 2, 3 (mean 2, sample variance 1); last window 5, 6, 7 (mean 6, variance 1):
    # change 4, standard error sqrt(1/3 + 1/3) = 0.8165 -> 4.9 standard errors: rose
    rose = reward_trend([1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 7.0], 3)
    assert rose["verdict"] == "rose" and rose["change"] == pytest.approx(4.0)
    assert rose["change_se"] == pytest.approx(0.81650, abs=1e-5)
    # first -1, 3 (mean 1, variance 8); last 0, 1 (mean 0.5, variance 0.5): change -0.5, se sqrt(4 + 0.25) = 2.06
    noisy = reward_trend([-1.0, 3.0, 0.0, 1.0], 2)
    assert noisy["verdict"] == "within noise" and noisy["change_se"] == pytest.approx(2.0616, abs=1e-4)
    assert reward_trend([3.0, 1.0], 1) == {"change": -2.0, "change_se": None, "verdict": "no noise estimate"}
    assert reward_trend([1.0, None, 2.0, 3.0], 2) is None


def test_help_lists_every_framework_stage_and_model_with_a_line_each():
    text = help_text()
    for group in GROUPS:
        names = sorted(f[:-5] for f in os.listdir(CONF_DIR / group) if f.endswith(".yaml"))
        described = dict(presets(group))
        assert sorted(described) == names
        for name in names:
            assert described[name] != "(no description)", f"conf/{group}/{name}.yaml lacks its '# help:' line"
            assert f"  {name}  " in text or f"  {name} " in text, name
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "[fp16]" in text  # each framework's default precision, read from its config


@pytest.mark.engine
def test_bench_run_help_prints_the_list_and_launches_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.run", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == help_text().strip()
    assert not (REPO / "outputs").exists()


def test_rank_zeros_feed_becomes_the_launchers_progress_line(tmp_path):
    from bench.run.progress import ProgressFeed, StageDisplay, feed_path

    path = feed_path(str(tmp_path))
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 -- closed with the console
    with StageDisplay(console, "ppo", path) as display:
        feed = ProgressFeed(path)
        feed.phase("imports")
        feed.jit_op("deepspeed_shm_comm")
        feed.start("ppo", 3)
        for reward in (0.5, 0.25, 1.5):
            feed.advance({"reward": reward, "loss/actor": -0.125, "kl": 0.01})
        feed.stop()
        feed.stop()  # the loop and the worker both stop it: one stop event
        with open(path, "a") as f:
            f.write('{"event": "step", "sta')  # a line rank 0 is still writing when the stage ends
        display._read()
    text = console.export_text()
    assert "ppo" in text and "3/3" in text and "reward=1.5" in text and "loss/actor=-0.125" in text
    assert "kl=" not in text  # only losses and the reward or accuracy are shown
    with open(path) as f:
        assert sum('"stop"' in line for line in f) == 1
