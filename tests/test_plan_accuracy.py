"""The memory model against real runs on every CI run, out of sample: per framework a glm-base cell whose shape
(batch 3, 64 + 96 tokens) no calibration offset was fitted on (the offsets come from the curated CPU rungs'
seed-1 runs, glm-base's all at batch 2 with 128 + 128 tokens, llama-base's at batch 2 and 4; at 480 tokens the
batch shares scale them by 1 - s/16), each phase's calibrated prediction within 15 % of the measured
growth. The full check over the curated sweep is the report's predicted-vs-measured table and
`python -m bench.plan.calibrate`."""

from __future__ import annotations

import pytest

TOLERANCE = 0.15
CELL = ["model=glm-base", "prompt_len=64", "answer_len=96", "batch=3", "launcher.nproc=2", "precision=bf16",
        "zero=2", "steps=2", "warmup_steps=1"]


@pytest.mark.engine
@pytest.mark.parametrize("framework, stage", [
    ("dschat", "sft"), ("trlx", "sft"), ("colossalai", "sft"),
    # CI time: RM's held-out scoring (2 x 8 batches per rank) made this the suite's longest test, 161 s
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
