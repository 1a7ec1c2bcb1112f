"""Published GPU facts (conf/facts/) against the planner: every verdict agrees or says why not, and the docs page
shows the table the planner produces now."""

from __future__ import annotations

import os

import pytest

from bench.plan import facts, plan_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def verdicts() -> list[facts.Verdict]:
    return facts.judge_all()


def test_at_least_ten_sourced_facts_each_agreeing_or_saying_why_not(verdicts):
    assert len(verdicts) >= 10
    assert {v.fact.framework for v in verdicts} >= {"dschat", "colossalai"}
    assert any(not v.fact.fits for v in verdicts), "facts of runs that failed test the planner's 'does not fit'"
    for v in verdicts:
        assert v.fact.url.startswith("https://") and v.fact.quote and v.fact.source, v.fact.name
        # a declared disagreement must still be one: a fix that makes it agree removes the declaration
        assert v.agrees != bool(v.fact.disagreement), (v.fact.name, v.fits, v.peak_bytes / 2**30)


def test_published_figures_are_compared_per_gpu_in_mib(verdicts):
    # ColossalChat's PPO tp=8, bs=1: 18,485.19 MB as rank 0's max_memory_allocated / 2**20
    v = next(v for v in verdicts if v.fact.name == "coati-ppo-llama2-7b-tp8-bs01")
    assert v.fact.per_gpu_mib == 18485.19
    assert v.error == pytest.approx(v.peak_bytes / (18485.19 * 2**20) - 1)
    # the limit is 90 % of an H800's total_memory as torch reports it (the H100 SXM's 79.11 GiB)
    assert v.limit_bytes == pytest.approx(0.9 * 79.11 * 2**30)


def test_the_docs_page_shows_the_table_as_the_planner_gives_it_now(verdicts):
    with open(os.path.join(ROOT, "docs", "published-facts.md")) as f:
        page = f.read()
    assert facts.markdown(verdicts) in page, "regenerate with: python -m bench.plan.facts --markdown"
    assert facts.gpu_markdown() in page


def test_a_file_without_its_fact_is_refused_by_name(tmp_path):
    path = tmp_path / "bare.yaml"
    path.write_text("model: llama2-7b\n")
    with pytest.raises(plan_file.PlanError, match="bare.yaml: a fact file needs a `fact:` mapping"):
        facts.read(str(path))
    (tmp_path / "bare.yaml").write_text("fact: {framework: X, source: S, url: https://x, quote: q, published: {}}\n")
    with pytest.raises(plan_file.PlanError, match="published.fits"):
        facts.read(str(path))
    assert facts.main(["--dir", str(tmp_path / "none")]) == 2
    path.write_text("fact: {framework: X: Y}\n")
    assert facts.main(["--dir", str(tmp_path)]) == 2  # not YAML: named, no traceback


def test_a_published_figure_agrees_only_within_the_tolerance():
    """A run that fits on both sides still disagrees when the planner's peak is more than 25 % off the published
    per-GPU figure: 1,000 MiB published, 1,240 planned agrees (+24 %), 1,260 does not (+26 %), nor 740 (-26 %)."""
    fact = facts.Fact("f", "X", "s", "https://x", "q", True, 1000.0, "max_memory_allocated", None)
    mib = 2**20

    def verdict(planned_mib: float) -> facts.Verdict:
        return facts.Verdict(fact, "setting", True, planned_mib * mib, 80 * 2**30)

    assert verdict(1240).agrees and not verdict(1260).agrees and not verdict(740).agrees
    assert not facts.Verdict(fact, "setting", False, 1000 * mib, 500 * mib).agrees  # the verdict first


def test_ds_chat_s_step_3_times_cite_the_examples_readme_and_its_opt_30b_40gb_row(verdicts):
    table = [v for v in verdicts if "Table 1" in v.fact.source and v.fact.framework == "dschat"]
    assert table and all(v.fact.url.endswith("DeepSpeedExamples/blob/master/applications/DeepSpeed-Chat/README.md")
                         for v in table)
    row = next(v for v in verdicts if v.fact.name == "dschat-ppo-opt-30b-8xa100-40gb")
    assert row.fact.quote == "8x A100 40G: OPT-30B, 1.85 days" and row.fact.fits


def test_each_fact_is_planned_in_its_own_framework_s_flags(verdicts):
    """The setting is the framework's own command line for the plan (its declaration's terms), and what the
    declaration does not count is said: DS-Chat's ZeRO stages apart, ColossalChat's 3d plugin with its tp."""
    by_name = {v.fact.name: v for v in verdicts}
    assert "--actor_zero_stage 3" in by_name["dschat-ppo-opt-30b-8xa100-40gb"].setting
    assert "(--inference_tp_size 2 not counted)" in by_name["dschat-ppo-opt-13b-8xa100-40gb"].setting
    assert "--plugin 3d --tp 8" in by_name["coati-ppo-llama2-7b-tp8-bs01"].setting


def test_a_fact_is_refused_when_its_framework_is_unknown_or_cannot_run_it(tmp_path):
    source = os.path.join(facts.FACTS_DIR, "coati-ppo-llama2-7b-tp4-bs01.yaml")
    with open(source) as f:
        text = f.read()
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(text.replace("framework: colossalai", "framework: ColossalChat"))
    with pytest.raises(plan_file.PlanError, match="fact.framework='ColossalChat'.*allowed: .*colossalai"):
        facts.read(str(unknown))
    # DS-Chat trains without tensor parallelism: its own plan_knobs refuses the tp=4 plan, by key
    foreign = tmp_path / "foreign.yaml"
    foreign.write_text(text.replace("framework: colossalai", "framework: dschat"))
    with pytest.raises(plan_file.PlanError, match="execution_plan.actor.tp=4 cannot run in dschat"):
        facts.judge(str(foreign))
