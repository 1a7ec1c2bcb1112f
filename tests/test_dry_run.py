"""`bench.run --dry-run`: a sweep's cells as Hydra's basic sweeper makes them, each judged as a run is before
launch, and the exit status the real command would give; nothing written."""

from __future__ import annotations

import pytest
from rich.console import Console

from bench.run.dry_run import check_cell, dry_run, expand


def test_a_sweep_expands_into_the_product_of_its_lists_in_the_sweepers_order():
    assert expand(["framework=dschat,trlx", "zero=2,3", "precision=bf16"]) == [
        ["framework=dschat", "zero=2", "precision=bf16"], ["framework=dschat", "zero=3", "precision=bf16"],
        ["framework=trlx", "zero=2", "precision=bf16"], ["framework=trlx", "zero=3", "precision=bf16"]]


def test_each_cell_is_judged_run_unsupported_or_invalid_with_the_reason():
    ok = check_cell(["framework=trlx", "stage=sft", "lora=8", "steps=3", "launcher.nproc=2"])
    assert ok.outcome == "run"
    assert ok.detail.startswith("trlx sft · tiny · fp32 · ZeRO-0 · LoRA 8 · batch 4 x 2 rank(s)")
    assert ok.detail.endswith("steps: sft 3")
    unsupported = check_cell(["framework=trlx", "framework.reference=peft"])  # peft's reference needs LoRA
    assert unsupported.outcome == "unsupported" and "needs lora > 0" in unsupported.detail
    invalid = check_cell(["prompt_len=128", "answer_len=128"])  # the tiny model has 128 positions
    assert (invalid.outcome, invalid.detail) == ("invalid", "prompt_len + answer_len = 256 exceeds model.positions=128")


@pytest.mark.parametrize(("args", "code"), [
    (["-m", "zero=2,3"], 0),
    (["-m", "framework=trlx", "framework.reference=peft,auto"], 0),  # a sweep records its unsupported cells
    (["framework=trlx", "framework.reference=peft"], 2),  # a single run stops before launch
    (["-m", "prompt_len=16,128", "answer_len=128"], 2),  # an invalid cell
])
def test_the_exit_status_is_what_the_real_command_gives_before_launch(args, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "out.txt", "w") as out:
        assert dry_run(args, Console(file=out)) == code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # nothing else written
