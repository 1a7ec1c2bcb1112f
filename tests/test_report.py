"""The collector and the report, from a real sweep over every framework (SFT, 2 steps, per-step metrics to
wandb offline) in which half the cells fail on purpose (tp=2 on one rank is invalid)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report.__main__ import main as report_main
from bench.report.claims import CHECKS, NOT_MEASURABLE, NOT_MEASURED
from bench.report.decision import Leaf, leaf
from bench.results.collect import collect

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CELLS = 6


def cell(framework: str, tp: int) -> str:
    return f"framework={framework},stage=sft,steps=2,tp={tp},warmup_steps=1"


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, "-m", "bench.run", "-m", "framework=dschat,colossalai,trlx", "stage=sft", "steps=2",
           "warmup_steps=1", "tp=1,2", "wandb=offline", f"output_root={root}", "sweep_name=demo"]
    result = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline"),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "sweeps" / "demo"


@pytest.fixture(scope="module")
def report_dir(sweep_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert report_main([str(sweep_dir), "--out", str(out)]) == 0
    return out


# one real sweep feeds every test here (42 s on a 2-core Zen 4 host): the engine tier, so that CI opens a real
# report in a browser; the report's rules are checked on hand-made records (tests/test_report_rules.py)
pytestmark = pytest.mark.engine


def test_every_cell_of_the_sweep_has_a_record_with_its_status(sweep_dir):
    collection = collect(str(sweep_dir))
    assert not collection.problems
    statuses = {run: record["status"] for run, record in collection.records.items()}
    assert len(statuses) == CELLS, statuses
    for run, status in statuses.items():
        assert status == ("error" if "tp=2" in run else "ok"), (run, status)


def test_per_step_metrics_go_to_wandb_offline_files(sweep_dir):
    for framework in ("dschat", "colossalai", "trlx"):
        run_dir = sweep_dir / cell(framework, 1)
        files = glob.glob(str(run_dir / "sft" / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert files and os.path.getsize(files[0]) > 0, os.listdir(run_dir / "sft")


def test_report_tables_contain_every_run_with_its_status(report_dir, sweep_dir):
    import pandas as pd

    markdown = (report_dir / "report.md").read_text()
    for framework in ("dschat", "colossalai", "trlx"):
        assert re.search(rf"\| {re.escape(cell(framework, 1))} \| sft \| \w{{10}} \| ok \| stable \|", markdown)
        assert re.search(rf"\| {re.escape(cell(framework, 2))} \| sft \| \w{{10}} \| error \| - \| - \| - \| "
                         r"tp=2 x pp=1 must divide launcher.nproc=1", markdown)
    table = pd.read_parquet(report_dir / "table.parquet")
    assert len(table) == CELLS and sorted(table["status"]) == ["error"] * 3 + ["ok"] * 3
    ok = table[table["status"] == "ok"]
    assert (ok["peak_training_bytes"] > ok["baseline_bytes"]).all()
    # each figure as the run's record.json has it, read without the report's code
    records = {path.parent: json.loads(path.read_text()) for path in sweep_dir.rglob("record.json")}
    for _, row in ok.iterrows():
        (record,) = [r for path, r in records.items() if str(path).endswith(row["run"])]
        sft = record["stages"]["sft"]
        assert row["peak_training_bytes"] == sft["memory"]["phases"]["training"]["peak_bytes"]
        training = sft["throughput"]["phases"]["training"]
        assert row["tokens_per_s_training"] == pytest.approx(training["tokens_per_s_global"])
    assert len(pd.read_csv(report_dir / "table.csv")) == CELLS
    html = (report_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 1 and "src='plots/" not in html  # self-contained
    assert "Decision tree" in html and "Claims check" in html


def test_claims_check_marks_every_published_claim(report_dir):
    markdown = (report_dir / "report.md").read_text()
    for claim_id, _ in CHECKS:
        assert f"| {claim_id} |" in markdown
    assert f"| A6 | DeepSpeed-Chat's memory advantage comes from its Hybrid Engine | {NOT_MEASURABLE} |" in markdown
    assert f"| A7 | ZeRO-3 uses 15-20 % MORE memory than ZeRO-2 in PPO | {NOT_MEASURED} |" in markdown


def test_a_corrupt_record_is_reported_and_skipped(sweep_dir, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns("wandb", "checkpoint*", "report"))
    good = (copy / cell("trlx", 1) / "record.json").read_text()
    (copy / "truncated").mkdir()
    (copy / "truncated" / "record.json").write_text(good[: len(good) // 2])
    (copy / "old").mkdir()
    (copy / "old" / "record.json").write_text('{"schema_version": 0, "status": "ok"}')
    out = tmp_path / "report"
    assert report_main([str(copy), "--out", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    assert "truncated/record.json`: unreadable: JSONDecodeError" in markdown
    assert "old/record.json`: schema_version 0" in markdown
    assert f"{CELLS} runs" in markdown and "2 record files skipped" in markdown


def test_report_refuses_a_folder_without_records(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert report_main([str(tmp_path / "missing")]) == 2
    assert report_main([str(tmp_path), "--budget-gib", "-1"]) == 2


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed (scripts/setup.sh does)")
def test_html_report_renders_in_headless_chromium(report_dir):
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 2400})
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto((report_dir / "report.html").as_uri())
        shot = report_dir / "screenshot.png"
        page.screenshot(path=str(shot), full_page=True)
        widths = page.evaluate("Array.from(document.images).map(i => i.naturalWidth)")
        tables = page.locator("table").count()
        # the answer (the decision tree's measured leaves, the claims' counts) comes before any detailed table
        answer_y = page.locator("#answer").bounding_box()["y"]
        first_table_y = page.locator("table").first.bounding_box()["y"]
        # the memory table's first measured column (after the configuration label) inside the 1280 px window
        headers = page.locator("#memory ~ table").first.locator("th")
        measured = headers.nth(1).bounding_box()
        measured_name = headers.nth(1).inner_text()
        browser.close()
    assert not errors, errors
    assert answer_y < first_table_y, (answer_y, first_table_y)
    assert measured_name.startswith("peak") and measured["x"] + measured["width"] <= 1280, (measured_name, measured)
    assert widths and all(w > 0 for w in widths), widths  # every inlined figure decoded
    # every table of the markdown (a header's separator row each: memory, throughput, stability, runs, cells, ...)
    # renders as one: a second reading of what report.md holds, not a count the report's code gave
    separators = [line for line in (report_dir / "report.md").read_text().splitlines()
                  if re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", line.strip())]
    assert len(separators) >= 8 and tables == len(separators), (tables, len(separators))
    assert shot.stat().st_size > 20_000


def _row(framework: str, speed: float, status: str = "ok", stability: str = "stable", peak: float = 1e9,
         seed: int = 0, **extra) -> dict:
    return {"framework": framework, "stage": "ppo", "model": "tiny", "precision": "bf16", "zero": 2, "lora": 0,
            "batch": 4, "nproc": 1, "tp": 1, "pp": 1, "plugin": "auto", "offload": False, "grad_ckpt": False,
            "reference": None, "status": status, "stability": stability, "samples_per_s_step": speed,
            "peak_bytes": peak, "cell": f"{framework}-{status}-{stability}-{peak}-{sorted(extra)}", "seed": seed,
            **extra}


def _repeats(framework: str, speed: float, **kwargs) -> list[dict]:
    """Three repeats of one cell, 1 % apart."""
    return [_row(framework, speed * f, seed=i, **kwargs) for i, f in enumerate((0.99, 1.0, 1.01))]


def test_decision_leaf_decides_only_what_the_data_supports():
    frameworks = ["colossalai", "dschat", "trlx"]
    assert not leaf([], None, frameworks).decided
    close = leaf(_repeats("dschat", 10.0) + _repeats("trlx", 10.5), None, frameworks)
    assert not close.decided and close.verdict.startswith("too close to call")
    clear = leaf(_repeats("dschat", 10.0) + _repeats("trlx", 20.0) + _repeats("colossalai", 30.0, stability="diverged"),
                 None, frameworks)
    assert clear.decided and clear.verdict.startswith("trlx")
    assert any("colossalai: ruled out -- every finished run was numerically unstable" in e for e in clear.evidence)
    budget = leaf(_repeats("dschat", 10.0, peak=1e9) + _repeats("trlx", 20.0, peak=3e9), 2e9, frameworks)
    assert isinstance(budget, Leaf) and budget.verdict.startswith("dschat")
    assert any("trlx: ruled out -- over the budget" in e for e in budget.evidence)


def test_decision_tree_leaves_out_harness_extension_cells_unless_asked():
    from bench.report.decision import build, questions

    rows = _repeats("dschat", 10.0) + _repeats("colossalai", 20.0) + _repeats("trlx", 50.0,
                                                                                harness_extension="grad_ckpt=true")
    tree = build(rows)
    assert "3 harness-extension run(s) left out" in tree.question
    path = ("tiny", "1", "bf16", "full fine-tuning")
    bf16_full = dict(questions(tree))[path]
    assert bf16_full.verdict.startswith("colossalai")
    assert any(e.startswith("not measured in this branch: trlx") for e in bf16_full.evidence)
    counted = dict(questions(build(rows, include_extensions=True)))[path]
    assert counted.verdict.startswith("trlx")


def test_decision_tree_leads_with_the_measured_step_rate_and_states_the_one_pass_rate_apart():
    # trlx's 4 epochs make its step slower; at one pass per rollout it would be the faster one, but that rate is
    # derived, not measured: the leaf picks on the measured rate (10 against 5: 100 % ahead) and states trlx's
    # derived one-pass rate (3 x 5 = 15) beside it
    rows = ([dict(r, samples_per_s_one_pass=r["samples_per_s_step"]) for r in _repeats("dschat", 10.0)]
            + [dict(r, samples_per_s_one_pass=3 * r["samples_per_s_step"]) for r in _repeats("trlx", 5.0)])
    chosen = leaf(rows, None, ["dschat", "trlx"])
    assert chosen.verdict.startswith("dschat") and "100 % ahead of trlx" in chosen.verdict
    assert any("derived at one update pass: 15.000" in line for line in chosen.evidence)
