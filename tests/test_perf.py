"""bench.perf: the interleaved plan, its refusals, and one real CPU run of a framework against the reference."""

from __future__ import annotations

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


def test_ratios_need_the_reference(capsys):
    with pytest.raises(SystemExit):
        perf.main(["--frameworks", "dschat,trlx", "--dry-run"])
    assert "ratios need the reference 'torch'" in capsys.readouterr().err


@pytest.mark.slow  # CI time (38 s, two runs); the ratio arithmetic is in CI (tests/test_report_rules.py)
def test_a_cpu_run_prints_the_ratio_table(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # results/perf/<name> lands under the test's folder
    code = perf.main(["--frameworks", "dschat,torch", "--rounds", "1", "--name", "t", "model=tiny",
                      "launcher.nproc=1", "stage=sft", "prompt_len=8", "answer_len=8", "steps=3"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Each framework against the plain-PyTorch reference" in printed
    assert "| sft | " in printed and "| dschat | training |" in printed
    assert (tmp_path / "results" / "perf" / "t" / "perf.md").exists()
