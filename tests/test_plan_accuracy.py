"""The memory model against real runs on every CI run, out of sample: per framework a glm-base cell whose shape
(batch 3, 64 + 96 tokens) no calibration offset was fitted on, each phase's calibrated prediction within 15 % of
the measured growth. The full check over the curated sweep is the report's predicted-vs-measured table and
`python -m bench.plan.calibrate`.

Each framework's cell runs under both measurement settings it keeps a fit for (bench.plan.calibration), so each
fit is checked on a model and a shape it never saw:
- bf16 at glibc's own mmap threshold: the pool of the curated CPU rungs' seed-1 runs (glm-base's all at batch 2
  with 128 + 128 tokens, llama-base's at batch 2 and 4; at 480 tokens the batch shares scale them by 1 - s/16).
  bf16 runs only where the CPU has native bf16 matrix instructions: elsewhere torch's bf16 path made the cell's
  step 15-19x fp32's (an AVX2-only AMD EPYC, 2 ranks), 324-464 s a cell, which would put CI past its 30
  minutes; memory and the prediction are the same there.
- fp32 at a 128 KiB mmap threshold: the fp32 llama-base rung's fit (results/examples/llama-base-fp32), which
  never saw glm-base, so its pooled offsets apply unscaled by any model factor. trlx's fp32 cell is checked here
  too: at glibc's own threshold the bf16 pool's doubled SFT offset had put it 20-30 % over (docs/planner.md,
  "Value width"), and the 128 KiB fit is an fp32 fit of its own.
The plain-PyTorch reference's cell is not here: its fit (results/examples/llama-base-fp32-torch) predicts this
glm-base cell's SFT init at -14.7 % (438 MiB against 513 measured, physics -19.0 %; 2026-12-07, one run), too close
to the tolerance to be a stable check, a build-time term of the GPT-2 shape the Llama rung does not show
(docs/planner.md, "The plain-PyTorch reference's memory model")."""

from __future__ import annotations

import pytest

from bench.measure.native_half import emulated_half

TOLERANCE = 0.15
CELL = ["model=glm-base", "prompt_len=64", "answer_len=96", "batch=3", "launcher.nproc=2", "zero=2", "steps=2",
        "warmup_steps=1"]
# the settings the shipped calibrations were fitted under (adapters/<framework>/memory_calibration.json)
POOLED = ("precision=bf16", "memory_mmap_threshold=null")
FP32_128K = ("precision=fp32", "memory_mmap_threshold=131072")
# the worker's own test of the host (the note an emulated run carries), so the flags are named in one place
EMULATED_BF16 = pytest.mark.skipif(emulated_half("bf16", "cpu") is not None,
                                   reason="CI time: no native bf16 matrix instructions on this CPU, where a bf16 "
                                   "cell takes 5-8 minutes (torch's emulated bf16 products)")


@pytest.mark.engine
@pytest.mark.parametrize("framework, stage, setting", [
    pytest.param("dschat", "sft", POOLED, marks=EMULATED_BF16),
    pytest.param("trlx", "sft", POOLED, marks=EMULATED_BF16),
    pytest.param("colossalai", "sft", POOLED, marks=EMULATED_BF16),
    # CI time: RM's held-out scoring (2 x 8 batches per rank) made this the suite's longest test, 161 s
    pytest.param("colossalai", "rm", POOLED, marks=[EMULATED_BF16, pytest.mark.slow]),
    ("dschat", "sft", FP32_128K), ("colossalai", "sft", FP32_128K), ("trlx", "sft", FP32_128K)],
    ids=lambda v: {POOLED: "bf16-glibc", FP32_128K: "fp32-128KiB"}.get(v) if isinstance(v, tuple) else None)
def test_predicted_phase_growth_is_within_15_percent(run_bench, framework, stage, setting):
    record = run_bench(f"framework={framework}", f"stage={stage}", *setting, *CELL)
    assert record["status"] == "ok", record["error"]
    memory = record["stages"][stage]["memory"]
    prediction = memory["prediction"]
    assert prediction["device"] == "cpu"
    # the fit of the cell's own setting, fitted on the rung the setting names (read from the file by hand)
    rung = "results/examples/llama-base-fp32" if setting == FP32_128K else "results/examples/glm-base"
    assert prediction["calibration"].startswith("the fit for ") and rung in prediction["calibration"]
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


@pytest.mark.engine
@pytest.mark.slow  # CI time: about 2 minutes a cell; the arithmetic is pinned by hand in test_plan_memory_models.py
@pytest.mark.parametrize("framework", ["dschat", "colossalai"])
def test_returned_heap_peaks_at_what_is_alive_at_once(run_bench, framework):
    """With glibc's mmap threshold fixed at 128 KiB every freed tensor gives its pages back, so the backward's
    gradients and buckets land while the activations they replace are returned: the measured training peak
    stands at or above the physics of what is alive at once (run_shape.step_transient, the allocator adding a
    little) and below the sum the physics keeps for a heap that stays resident. Measured on the AVX2 host in fp32
    (docs/performance.md "What 128 KiB shows of the physics"): DS-Chat 1,996 MiB against 1,870 and 2,675 (the
    physics with ZeRO-2's all-reduced copy of its bucket), ColossalChat 1,874 against 1,844 and 2,100."""
    from dataclasses import replace

    from bench.plan.predict import physics
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    overrides = [f"framework={framework}", "stage=sft", "precision=fp32", *CELL, "memory_mmap_threshold=131072"]
    record = run_bench(*overrides)
    assert record["status"] == "ok", record["error"]
    memory = record["stages"]["sft"]["memory"]
    measured = memory["phases"]["training"]["growth_over_baseline_bytes"]
    alive = memory["prediction"]["phases"]["training"]["physics_total_bytes"]
    summed = physics(replace(spec_from_config(compose(overrides)), memory_mmap_threshold=None), "sft")["training"]
    assert alive <= measured < summed.device, (alive / 2**20, measured / 2**20, summed.device / 2**20)
    assert measured - alive <= 0.10 * measured, f"{(measured - alive) / 2**20:.0f} MiB beyond what is alive at once"
