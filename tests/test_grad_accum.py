"""grad_accum and global_batch: the spec's check (DeepSpeed's train_batch_size rule), how a step's micro-batch
outputs merge, how a step that runs a phase several times is timed, preflight's shrink keeping a stated global
batch, and (slow tier) what each framework does with the micro-batches' gradients."""

from __future__ import annotations

import pytest

from adapters.base import TrainOutput, merge_micro
from bench.plan import preflight as pf
from bench.plan.predict import physics
from bench.results.record import _throughput, batch_shape
from bench.run.config import compose
from bench.run.spec import SpecError, spec_from_config
from tests.test_preflight import GLM_BASE_SFT, _worst


def spec(*overrides: str):
    return spec_from_config(compose(["framework=dschat", "stage=sft", *overrides]))


def test_global_batch_is_checked_as_deepspeed_checks_train_batch_size() -> None:
    assert spec("batch=4", "grad_accum=8", "launcher.nproc=2").effective_global_batch == 64
    assert spec("batch=4", "grad_accum=8", "launcher.nproc=2", "global_batch=64").global_batch == 64
    # A20's recommended config: train_batch_size 32 with micro-batch 4, accumulation 4 on 8 GPUs (= 128)
    with pytest.raises(SpecError, match=r"global_batch=32 is not batch 4 x grad_accum 4 x 8 data-parallel rank\(s\) "
                                        "= 128"):
        spec("batch=4", "grad_accum=4", "launcher.nproc=8", "global_batch=32")
    for bad in ("grad_accum=0", "grad_accum=1.5", "global_batch=0"):
        with pytest.raises(SpecError, match=bad.split("=")[0]):
            spec(bad)
    assert batch_shape(4, 8, 8)["global"] == 256  # A18's plan B: micro 4 x accumulation 8 x 8 GPUs


def test_micro_batches_merge_into_one_step() -> None:
    first = TrainOutput(losses={}, tokens=10, samples=2)
    first.accumulate("actor", 2.0)
    first.metrics["accuracy"] = 0.5
    second = TrainOutput(losses={}, tokens=12, samples=2)
    second.record("actor", 4.0, 1.5, False, 1024.0)
    second.metrics["accuracy"] = 1.0
    step = merge_micro([first, second])
    assert (step.tokens, step.samples, step.losses, step.grad_norms) == (22, 4, {"actor": 3.0}, {"actor": 1.5})
    assert step.loss_scales == {"actor": 1024.0} and step.skipped == {"actor": False}
    assert step.metrics == {"accuracy": 0.75, "optimizer_steps/actor": 1, "skipped_steps/actor": 0}
    nan = TrainOutput(losses={}, tokens=1, samples=1)
    nan.accumulate("actor", float("nan"))
    assert merge_micro([nan, second]).losses["actor"] != merge_micro([nan, second]).losses["actor"]  # NaN kept


def test_a_phase_run_twice_in_a_step_counts_one_step() -> None:
    samples = [{"phase": "training", "step": s, "time_s": 0.5, "tokens": 100, "samples": 4, "flops": 0.0}
               for s in (0, 1, 1, 2, 2)]  # step 0 is warm-up; steps 1 and 2 ran two micro-batches each
    throughput = _throughput([{"rank": 0, "phase_samples": samples}], warmup=1)
    training = throughput["phases"]["training"]
    assert training["measured_steps"] == 2 and training["time_s_per_step"] == pytest.approx(1.0)
    assert throughput["step_times_s"] == [1.0, 1.0]


def test_shrink_keeps_a_stated_global_batch_by_accumulating_more() -> None:
    at8, at2 = _worst("batch=8"), _worst("batch=2")
    budget_gib = (at8 + at2) / 2 / pf.SAFETY / 2**30
    asked = spec_from_config(compose([*GLM_BASE_SFT, "batch=8", "grad_accum=1", "global_batch=16",
                                      f"memory_budget_gb={budget_gib}"]))
    shrunk, found = pf.preflight(asked, "shrink", "cpu")
    assert shrunk.batch in (2, 4) and shrunk.batch * shrunk.grad_accum == 8
    assert shrunk.effective_global_batch == 16 and found["run_grad_accum"] == shrunk.grad_accum


def _ppo_phases(framework: str, grad_accum: int) -> dict:
    return physics(spec_from_config(compose([f"framework={framework}", "stage=ppo", "model=glm-base", "batch=2",
                                             "prompt_len=128", "answer_len=128", "launcher.nproc=2", "precision=bf16",
                                             "zero=2", f"grad_accum={grad_accum}"])), "ppo")


def test_dschat_model_holds_the_gradient_partitions_through_the_next_rollout() -> None:
    # glm-base ZeRO-2 on 2 ranks: actor 108,943,872 and critic 108,944,640 trained parameters, half of each in
    # bf16 on a rank = 217,888,512 bytes (208 MiB; measured: 209 MiB more in generation)
    one, two = _ppo_phases("dschat", 1), _ppo_phases("dschat", 2)
    for phase in ("generation", "experience"):
        assert two[phase].device - one[phase].device == 217_888_512
    assert two["training"].device == one["training"].device  # the step's own gradients are there either way
    # coati: the same partitions in its ZeRO grad store (the critic's value head has a bias: h + 1);
    # measured 229-263 MiB more
    one, two = _ppo_phases("colossalai", 1), _ppo_phases("colossalai", 2)
    assert two["generation"].device - one["generation"].device == 108_943_872 + 108_944_641


@pytest.mark.slow
@pytest.mark.parametrize("framework, zero, norm_ratio, optimizer_steps", [
    # first step's gradient norm against DS-Chat's (the same seed builds the same model and batches): DS-Chat
    # and the reference average the micro-batches' losses, coati and trlx (DDP) add them up; trlx under
    # DeepSpeed steps after every micro-batch (its first norm is one micro-batch's)
    ("colossalai", "0", 2.0, 3), ("torch", "0", 1.0, 3), ("trlx", "0", 2.0, 3), ("trlx", "2", None, 6)])
def test_what_each_framework_does_with_the_micro_batches(run_bench, framework, zero, norm_ratio,
                                                         optimizer_steps) -> None:
    common = ("stage=sft", "steps=3", "warmup_steps=1", "grad_accum=2", "precision=bf16", f"zero={zero}")
    baseline = run_bench("framework=dschat", *common, name="dschat")["stages"]["sft"]
    record = run_bench(f"framework={framework}", *common, name=framework)
    sft = record["stages"]["sft"]
    assert sft["engine_knobs"]["accumulation"] == {"micro_batches": {"actor": 6},
                                                   "optimizer_steps": {"actor": optimizer_steps}}
    if norm_ratio is not None:
        ratio = sft["steps"][0]["grad_norm/actor"] / baseline["steps"][0]["grad_norm/actor"]
        assert ratio == pytest.approx(norm_ratio, rel=0.01)
    else:
        assert [d["id"] for d in sft["upstream_defects"]] == ["trlx-deepspeed-minibatch-steps-every-micro-batch"]
        assert all(step["optimizer_steps/actor"] == 2 for step in sft["steps"])
