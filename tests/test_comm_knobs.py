"""DeepSpeed's communication knobs (ds.allgather_bucket_size, ds.reduce_bucket_size, ds.overlap_comm): what
each engine is handed and reads back, the refusals, and the memory models' reduce bucket worked by hand."""

from __future__ import annotations

import pytest

from adapters.colossalai.memory import reduce_bucket_elements
from adapters.deepspeed_memory import gradient_terms, resident_buffers, zero2_made_bytes
from adapters.dschat.ds_config import train_config
from adapters.dschat.options import DSChatOptions
from bench.plan.physics import Terms
from bench.plan.run_shape import RunShape
from bench.run.config import compose
from bench.run.spec import SpecError, UnsupportedError, spec_from_config


def _spec(*overrides: str):
    return spec_from_config(compose(list(overrides)))


@pytest.mark.parametrize("override, message", [
    ("ds.reduce_bucket_size=0", "must be >= 1"),
    ("ds.allgather_bucket_size=1.5", "must be an integer"),
    ("ds.overlap_comm=maybe", "must be true or false"),
])
def test_bad_values_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        _spec(override)


@pytest.mark.parametrize("overrides, message", [
    (["framework=trlx", "zero=0", "ds.reduce_bucket_size=1000"], "accelerate's DDP, not DeepSpeed"),
    (["framework=torch", "zero=2", "ds.overlap_comm=false"], "DDP or FSDP2, not DeepSpeed"),
    (["framework=colossalai", "zero=2", "ds.allgather_bucket_size=1000"], "no all-gather bucket"),
    (["framework=colossalai", "zero=0", "ds.reduce_bucket_size=1000"], "has a reduce bucket"),
])
def test_engines_without_the_knob_refuse_it(overrides: list[str], message: str) -> None:
    with pytest.raises(UnsupportedError, match=message):
        _spec(*overrides)


def test_bucket_sizes_may_be_written_as_deepspeed_writes_them() -> None:
    assert _spec("ds.allgather_bucket_size=5e8").ds.allgather_bucket_size == 500_000_000


def test_ds_chat_hands_only_the_set_knobs_to_zero_optimization() -> None:
    spec = _spec("framework=dschat", "zero=2", "ds.reduce_bucket_size=100000")
    options = DSChatOptions.validate(spec)
    zero = train_config(spec, options, 2, False, comm={"reduce_bucket_size": 100_000})["zero_optimization"]
    assert zero["reduce_bucket_size"] == 100_000 and "allgather_bucket_size" not in zero
    assert zero["overlap_comm"] is False


def test_the_reduce_bucket_in_the_memory_models() -> None:
    # tiny: 842,496 trained parameters in bf16; ZeRO-2 fills a bucket of min(trainable, bucket) values and
    # all-reduces a flattened copy of it: 2 x 2 B x 842,496 with DeepSpeed's 5e8 (it holds them all), 2 x 2 B x
    # 100,000 with 1e5; its step makes 2 + 2 + 4 B a parameter over the ranks, 8 x 842,496 / 8 on 8 ranks
    assert zero2_made_bytes(842_496, 2, 8) == (4 * 842_496, 842_496)
    assert zero2_made_bytes(842_496, 2, 8, 100_000) == (400_000, 842_496)
    assert gradient_terms(842_496, 2, 2, 8, "bf16")[1] == Terms(buffers=4 * 842_496)  # the reduction peaks
    assert gradient_terms(842_496, 2, 2, 8, "bf16", 100_000)[1] == Terms(grads=842_496)  # the step peaks
    # ZeRO-3 keeps its bucket; a GPU holds it whole
    assert resident_buffers(842_496, 2, 3, "cuda", 100_000).buffers == 200_000
    assert resident_buffers(842_496, 2, 3, "cuda").buffers == 2 * 500_000_000
    # coati counts in Mi values: 5e8 -> 476.84 -> 477 x 1,048,576 = 500,170,752; 1e5 rounds up to 1 Mi
    for bucket, elements in ((None, 12 * 2**20), (500_000_000, 500_170_752), (100_000, 1_048_576)):
        overrides = ["framework=colossalai", "zero=2"] + ([f"ds.reduce_bucket_size={bucket}"] if bucket else [])
        assert reduce_bucket_elements(RunShape.from_spec(_spec(*overrides), "sft")) == elements


@pytest.mark.engine
@pytest.mark.parametrize("framework, bucket, read_back", [
    # trlx hands the knobs to the same DeepSpeed config: its cell runs in the slow tier (CI's 25 minutes)
    ("dschat", 300_000, 300_000), pytest.param("trlx", 300_000, 300_000, marks=pytest.mark.slow),
    ("colossalai", 2_100_000, 2 * 2**20),  # LowLevelZero's bucket in whole Mi values
])
def test_each_engine_reads_back_the_knobs_it_was_handed(run_bench, framework: str, bucket: int,
                                                         read_back: int) -> None:
    overrides = [f"framework={framework}", "stage=sft", "steps=1", "warmup_steps=0", "zero=2", "precision=bf16",
                 f"ds.reduce_bucket_size={bucket}", "ds.overlap_comm=false"]
    if framework != "colossalai":
        overrides.append("ds.allgather_bucket_size=400000")
    record = run_bench(*overrides)
    sft = record["stages"]["sft"]
    assert record["status"] == "ok", sft.get("error")
    knobs = sft["engine_knobs"]
    assert knobs["reduce_bucket_size"] == {"actor": read_back}
    assert knobs["overlap_comm"] == {"actor": False}
    if framework != "colossalai":
        assert knobs["allgather_bucket_size"] == {"actor": 400_000}
