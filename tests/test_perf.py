"""bench.perf: the interleaved plan, its refusals, and one real CPU run of a framework against the reference."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench import perf


def test_the_plan_interleaves_every_framework_once_per_round():
    assert perf.plan(["dschat", "trlx", "torch"], 2) == [(1, "dschat"), (1, "trlx"), (1, "torch"),
                                                         (2, "dschat"), (2, "trlx"), (2, "torch")]


def test_user_overrides_replace_the_defaults_and_its_own_keys_are_refused():
    merged = perf.overrides(["model=tiny", "steps=3"])
    assert merged["model"] == "tiny" and merged["steps"] == "3" and merged["zero"] == "2"
    with pytest.raises(SystemExit, match="sets framework, seed"):
        perf.overrides(["seed=4"])
    with pytest.raises(SystemExit, match="not key=value"):
        perf.overrides(["steps"])


def test_glm_base_gets_the_benchmark_shape_and_other_models_bench_runs_own():
    glm = perf.overrides([])  # the default model, glm-base: scripts/glm_sweep.sh's 128 + 128 tokens, batch 2
    assert (glm["model"], glm["prompt_len"], glm["answer_len"], glm["batch"], glm["steps"]) == \
        ("glm-base", "128", "128", "2", "4")
    tiny = perf.overrides(["model=tiny"])  # conf/config.yaml's lengths and steps: bench.perf sets none
    assert not {"prompt_len", "answer_len", "batch", "steps", "warmup_steps"} & set(tiny)
    assert perf.overrides(["prompt_len=64"])["prompt_len"] == "64"  # the user's value wins over the shape


def test_a_command_line_bench_run_refuses_stops_the_plan_before_anything_runs_or_is_written(tmp_path, capsys):
    code = perf.main(["--rounds", "1", "--frameworks", "dschat,torch", "--name", "x", f"output_root={tmp_path}",
                      "model=tiny", "prompt_len=128", "answer_len=128"])
    err = capsys.readouterr().err
    assert code == 2
    assert "framework=dschat,torch: prompt_len + answer_len = 256 exceeds model.positions=128" in err
    assert not (tmp_path / "perf").exists()


def test_failed_runs_are_named_with_their_records_reason_and_the_exit_is_not_zero(tmp_path, monkeypatch, capsys):
    def failing_run(command, check, cwd):  # stands in for bench.run: each run leaves an `oom` record
        del check, cwd
        args = dict(a.split("=", 1) for a in command[3:])
        run_dir = os.path.join(args["output_root"], "runs", args["run_name"])
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "record.json"), "w") as f:
            json.dump({"status": "oom", "error": {"message": "rank 1 killed by SIGKILL\nmore"}}, f)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(perf.subprocess, "run", failing_run)
    code = perf.main(["--rounds", "1", "--frameworks", "dschat,torch", "--name", "f", f"output_root={tmp_path}",
                      "model=tiny"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Runs that did not finish: 2 of 2" in out
    assert "| 1 | dschat | oom | 0 | rank 1 killed by SIGKILL |" in out
    written = (tmp_path / "perf" / "f" / "perf.md").read_text()
    assert "No cell holds both the reference" in written and "| 1 | torch | oom |" in written


def test_an_interrupt_keeps_the_table_of_the_runs_before_it(tmp_path, monkeypatch, capsys):
    calls = []

    def interrupted_run(command, check, cwd):  # the first run leaves a record, Ctrl-C comes in the second
        del check, cwd
        calls.append(command)
        if len(calls) == 2:
            raise KeyboardInterrupt
        args = dict(a.split("=", 1) for a in command[3:])
        os.makedirs(os.path.join(args["output_root"], "runs", args["run_name"]))
        with open(os.path.join(args["output_root"], "runs", args["run_name"], "record.json"), "w") as f:
            json.dump({"status": "error", "error": {"message": "stopped"}}, f)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(perf.subprocess, "run", interrupted_run)
    code = perf.main(["--rounds", "1", "--frameworks", "dschat,torch", "--name", "i", f"output_root={tmp_path}",
                      "model=tiny"])
    assert code == 130 and len(calls) == 2
    assert "interrupted in run 2 of 2" in capsys.readouterr().out
    written = (tmp_path / "perf" / "i" / "perf.md").read_text()
    assert "Interrupted after 1 of 2 runs." in written and "| 1 | dschat | error | 1 | stopped |" in written


def test_ratios_need_the_reference(capsys):
    with pytest.raises(SystemExit):
        perf.main(["--frameworks", "dschat,trlx", "--dry-run"])
    assert "ratios need the reference 'torch'" in capsys.readouterr().err


@pytest.mark.slow  # CI time (38 s, two runs); the ratio arithmetic is in CI (tests/test_report_rules.py)
def test_a_cpu_run_prints_the_ratio_table(tmp_path, capsys):
    code = perf.main(["--frameworks", "dschat,torch", "--rounds", "1", "--name", "t", "model=tiny",
                      "launcher.nproc=1", "stage=sft", "prompt_len=8", "answer_len=8", "steps=3",
                      f"output_root={tmp_path / 'results'}"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Each framework against the plain-PyTorch reference" in printed
    assert "| sft | " in printed and "| dschat | training |" in printed
    assert (tmp_path / "results" / "perf" / "t" / "perf.md").exists()
