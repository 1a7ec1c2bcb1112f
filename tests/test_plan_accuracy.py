"""The memory model against real runs on every CI run: short glm-base cells of each framework, each phase's
calibrated prediction within the issue's 15 % of the measured growth (the full check over the curated sweep
is the report's predicted-vs-measured table and `python -m bench.plan.calibrate`)."""

from __future__ import annotations

import pytest

TOLERANCE = 0.15
CELL = ["model=glm-base", "prompt_len=128", "answer_len=128", "batch=2", "launcher.nproc=2", "precision=bf16",
        "zero=2", "steps=2", "warmup_steps=1"]


@pytest.mark.engine
# coati's RM cell (~1 min) and trlx's SFT cell (~45 s) run in the slow tier: CI keeps its 25 minutes with
# DS-Chat's (the claims knobs' engine tests took their place)
@pytest.mark.parametrize("framework, stage", [("dschat", "sft"),
                                              pytest.param("trlx", "sft", marks=pytest.mark.slow),
                                              pytest.param("colossalai", "rm", marks=pytest.mark.slow)])
def test_predicted_phase_growth_is_within_15_percent(run_bench, framework, stage):
    record = run_bench(f"framework={framework}", f"stage={stage}", *CELL)
    assert record["status"] == "ok", record["error"]
    memory = record["stages"][stage]["memory"]
    prediction = memory["prediction"]
    assert prediction["device"] == "cpu"
    checked = []
    for phase, entry in prediction["phases"].items():
        measured = memory["phases"][phase].get("growth_over_baseline_bytes")
        if measured is None:  # a phase the tracker bounded without measuring (memory_release_every)
            continue
        assert entry["measured_growth_bytes"] == measured
        checked.append((phase, entry["error"], entry["predicted_bytes"] / 2**20, measured / 2**20))
    assert {"init", "training"} <= {c[0] for c in checked}
    for phase, error, predicted, measured in checked:
        assert abs(error) <= TOLERANCE, f"{framework} {stage} {phase}: {predicted:.0f} MiB predicted, " \
                                        f"{measured:.0f} measured ({error:+.1%})"
