"""Model-state memory: the ZeRO paper's per-stage formulas and DeepSpeed's estimators, with values worked by
hand here, and DeepSpeed's own functions agreeing to the byte."""

from __future__ import annotations

import itertools

import pytest

from bench.plan.model_state import (
    DeviceHostBytes,
    ModelStateBytes,
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    zero_paper_bytes,
)


def test_the_zero_papers_figure_1_example():
    # Ψ = 7.5 B parameters, N_d = 64, K = 12:
    # 16 x 7.5e9 = 120e9; 4 x 7.5e9 + 12 x 7.5e9 / 64 = 30e9 + 1.40625e9; 2 x 7.5e9 + 14 x 7.5e9 / 64 = 15e9 +
    # 1.640625e9; 16 x 7.5e9 / 64 = 1.875e9 -- the paper's 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    totals = [zero_paper_bytes(7_500_000_000, stage, 64).total for stage in (0, 1, 2, 3)]
    assert totals == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9], rel=1e-12)


def test_each_stage_partitions_one_more_term():
    # Ψ = 1,000, N_d = 4: parameters 2Ψ, gradients 2Ψ, optimizer 12Ψ, each divided by 4 from its stage on
    assert zero_paper_bytes(1000, 0, 4) == ModelStateBytes(params=2000, grads=2000, optimizer=12000)
    assert zero_paper_bytes(1000, 1, 4) == ModelStateBytes(params=2000, grads=2000, optimizer=3000)
    assert zero_paper_bytes(1000, 2, 4) == ModelStateBytes(params=2000, grads=500, optimizer=3000)
    assert zero_paper_bytes(1000, 3, 4) == ModelStateBytes(params=500, grads=500, optimizer=3000)
    assert zero_paper_bytes(1000, 3, 1).total == 16000  # one rank: nothing to share with
    assert zero_paper_bytes(1000, 2, 4, k=8).optimizer == 2000  # another optimizer's K


def test_deepspeed_zero2_estimates_worked_by_hand():
    # Ψ = 1e9 on 1 node x 8 GPUs. No offload: 2Ψ + 18Ψ / 8 = 2e9 + 2.25e9 on the GPU; the host 4Ψ per GPU of
    # the node x 1.5 = 48e9. Offload: 2Ψ on the GPU; the host Ψ x max(4 x 8, 16) x 1.5 = 48e9.
    assert deepspeed_zero2_estimate(10**9, 8, 1, cpu_offload=False) == DeviceHostBytes(4_250_000_000, 48 * 10**9)
    assert deepspeed_zero2_estimate(10**9, 8, 1, cpu_offload=True) == DeviceHostBytes(2 * 10**9, 48 * 10**9)
    # one GPU, offload: the host floor of 16 bytes a parameter, x 1.5 = 24e9
    assert deepspeed_zero2_estimate(10**9, 1, 1).host == 24 * 10**9
    # before PR #5099: 4Ψ + 16Ψ / 8 = 6e9
    assert deepspeed_zero2_estimate(10**9, 8, 1, cpu_offload=False, before_pr_5099=True).device == 6 * 10**9
    # DeepSpeed truncates the partitioned part: Ψ = 7 on 4 GPUs -> 14 + int(126 / 4 = 31.5) = 45
    assert deepspeed_zero2_estimate(7, 4, 1, cpu_offload=False) == DeviceHostBytes(45, 168)


def test_deepspeed_zero3_estimates_worked_by_hand():
    # Ψ = 1e9, largest layer 1e8 (its gather: 4 x 1e8 = 4e8), 2 nodes x 8 GPUs = 16
    layer = 10**8
    both = deepspeed_zero3_estimate(10**9, layer, 8, 2, cpu_offload=True, cpu_offload_params=True)
    assert both == DeviceHostBytes(400_000_000, 13_500_000_000)  # host: 18Ψ / 2 nodes x 1.5
    cold = deepspeed_zero3_estimate(10**9, layer, 8, 2, cpu_offload=True, cpu_offload_params=True, zero_init=False)
    assert cold.host == 48 * 10**9  # Ψ x max(4 x 8, 18 / 2) x 1.5
    optimizer = deepspeed_zero3_estimate(10**9, layer, 8, 2, cpu_offload=True, cpu_offload_params=False)
    assert optimizer == DeviceHostBytes(525_000_000, 12 * 10**9)  # 4e8 + 2Ψ / 16; host 16Ψ / 2 x 1.5
    none = deepspeed_zero3_estimate(10**9, layer, 8, 2, cpu_offload=False)
    assert none == DeviceHostBytes(1_525_000_000, 4_800_000_000)  # 4e8 + 18Ψ / 16; host 4 x 1e8 x 8 x 1.5
    assert deepspeed_zero3_estimate(10**9, layer, 8, 2, cpu_offload=False, zero_init=False).host == 48 * 10**9


def test_deepspeeds_own_estimators_agree_to_the_byte():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for params, gpn, nodes, offload in itertools.product((7, 108_900_000, 9_900_000_000), (1, 3, 8), (1, 2, 5),
                                                         (True, False)):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpn, nodes, offload)
        assert deepspeed_zero2_estimate(params, gpn, nodes, offload) == DeviceHostBytes(gpu, cpu)
        for offload_params, zero_init in itertools.product((True, False), (True, False)):
            layer = params // 11
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, layer, gpn, nodes, offload, offload_params,
                                                                zero_init)  # (and the largest layer's bytes)
            ours = deepspeed_zero3_estimate(params, layer, gpn, nodes, offload, offload_params, zero_init)
            assert ours == DeviceHostBytes(gpu, cpu), (params, gpn, nodes, offload, offload_params, zero_init)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: zero_paper_bytes(10, 4, 2), "stage=4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
    (lambda: zero_paper_bytes(10, 2, 0), "data_parallel=0 must be an integer >= 1"),
    (lambda: deepspeed_zero2_estimate(-1), "params=-1 must be an integer >= 0"),
    (lambda: deepspeed_zero3_estimate(10, 2, gpus_per_node=0), "gpus_per_node=0 must be an integer >= 1"),
])
def test_bad_input_names_the_value_and_what_is_allowed(call, message):
    with pytest.raises(ValueError, match=message):
        call()
