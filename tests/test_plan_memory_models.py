"""Each framework's memory model (adapters/<framework>/memory.py): its parameter counts and its model-state
bytes against what the adapters' engines hold, as the curated glm-base records measured them (the numbers in
this file are copied from those records' `params` and `model_state`), and its phases and terms."""

from __future__ import annotations

import pytest

from adapters.colossalai import memory as coati
from adapters.deepspeed_memory import gradient_terms, zero2_made_bytes
from adapters.dschat import memory as dschat
from adapters.trlx import memory as trlx
from bench.plan.physics import Terms
from bench.plan.predict import physics, record_entry
from bench.plan.run_shape import RunShape
from bench.run.config import compose
from bench.run.spec import spec_from_config

BASE = ["model=glm-base", "prompt_len=128", "answer_len=128", "batch=2", "launcher.nproc=2", "precision=bf16"]


def shape(framework: str, stage: str, *overrides: str) -> RunShape:
    spec = spec_from_config(compose([f"framework={framework}", f"stage={stage}", *BASE, *overrides]))
    return RunShape.from_spec(spec, stage)


def state_mib(terms) -> float:
    return (terms.params + terms.optimizer) / 2**20


def test_parameter_counts_match_the_records():
    s = shape("dschat", "sft", "lora=64", "zero=2")
    # DS-Chat LoRA 64: + 16 x 64 x 768 x 12 = 9,437,184; the wrapped 12 h^2 per block freeze
    assert dschat.role_params(s, "actor", 64) == (118_381_056, 33_446_400)
    assert dschat.role_params(s, "critic", 0) == (108_944_640, 108_944_640)  # + a bias-free value head
    s = shape("colossalai", "sft", "lora=64", "zero=2")
    # coati: blocks, both embeddings and the LM head get LoRA; the block linears lose their biases
    assert coati.role_params(s, "actor", 64) == (122_394_112, 13_533_184)
    assert coati.role_params(s, "critic", 64) == (120_437_056, 11_575_360)
    s = shape("trlx", "ppo", "zero=2")
    # hydra: + the top 2 blocks, final norm and an untied LM head; value head h -> 2h -> 1
    assert trlx.role_params(s, "ppo", 0) == (147_798_529, 15_753_217)
    assert trlx.role_params(s, "ppo", 64) == (112_485_889, 3_542_017)  # peft on c_attn only
    assert trlx.role_params(s, "rm", 0)[1] == 45_153_792  # the top 3 blocks, embeddings, norm, head


@pytest.mark.parametrize("framework, stage, overrides, mib", [
    # rank 0's parameter + optimizer bytes in the records (MiB), summed over the stage's roles
    ("dschat", "ppo", ("zero=2",), 2078.4),
    ("dschat", "ppo", ("zero=3",), 1662.8),
    ("dschat", "sft", ("zero=2", "lora=64"), 417.2),
    ("colossalai", "ppo", ("zero=2",), 2078.4),
    ("colossalai", "rm", ("zero=2", "lora=64"), 295.9),
    ("trlx", "sft", ("zero=0",), 1246.8),
    ("trlx", "rm", ("zero=2",), 466.5),
    # at fp32 (the engines' counters in the fp32 runs of tests/test_plan_accuracy.py's cell: 435,775,488 bytes
    # of parameters and 653,663,232 of optimizer state per rank) each ZeRO-2 engine still keeps an fp32 master
    # copy of its shard beside the fp32 weights: 4 + 12 / 2 bytes a parameter
    ("colossalai", "sft", ("zero=2", "precision=fp32"), 1039.0),
    ("dschat", "sft", ("zero=2", "precision=fp32"), 1039.0),
    ("trlx", "sft", ("zero=2", "precision=fp32"), 1039.0),
])
def test_model_state_matches_the_engines(framework, stage, overrides, mib):
    terms = physics(spec_from_config(compose([f"framework={framework}", f"stage={stage}", *BASE, *overrides])),
                    stage)
    assert state_mib(terms["training"]) == pytest.approx(mib, abs=1.0)


def test_phases_are_the_adapters_own():
    spec = spec_from_config(compose(["framework=colossalai", "stage=ppo", *BASE, "zero=2"]))
    assert list(physics(spec, "ppo")) == ["init", "onload", "generation", "experience", "offload", "training"]
    spec = spec_from_config(compose(["framework=dschat", "stage=rm", *BASE, "zero=2"]))
    assert list(physics(spec, "rm")) == ["init", "training", "evaluation"]


def test_zero3_bucket_is_whole_on_a_gpu_and_touched_pages_on_the_host():
    spec = spec_from_config(compose(["framework=dschat", "stage=sft", *BASE, "zero=3"]))
    cpu, cuda = physics(spec, "sft", "cpu")["training"], physics(spec, "sft", "cuda")["training"]
    # 5e8 bf16 values on the GPU; on the host one value per trained parameter (108,943,872 x 2 B)
    assert cuda.buffers - cpu.buffers == pytest.approx(2 * (500_000_000 - 108_943_872))


def test_record_entry_keeps_terms_and_errors():
    spec = spec_from_config(compose(["framework=dschat", "stage=sft", *BASE, "zero=2"]))
    predicted = physics(spec, "sft")["training"].device
    memory = {"phases": {"training": {"growth_over_baseline_bytes": 2 * 10**9}, "imports": {}}}
    entry = record_entry(spec, "sft", "cpu", memory)
    training = entry["phases"]["training"]
    assert training["physics_total_bytes"] == round(predicted)
    assert training["predicted_bytes"] == training["physics_total_bytes"] + training["calibration_bytes"]
    assert training["error"] == pytest.approx((training["predicted_bytes"] - 2e9) / 2e9)
    assert "error" not in entry["phases"]["init"]  # nothing measured for it here
    assert set(training["physics_bytes"]) <= {"params", "grads", "optimizer", "activations", "logits", "cache",
                                              "buffers", "lora", "other", "host"}


def test_deepspeed_engine_build_by_hand():
    from adapters.deepspeed_memory import engine_build

    # glm-base, ZeRO-2 on 2 ranks, bf16, everything trained (109 M): weights cast in place (2 B), the flat copy
    # of the trained ones (2 B), the fp32 master and gradient partitions (8 B / 2): 2 + 2 + 4 = 8 B a
    # parameter while wrapping (832 MiB; RSS measured 838 around deepspeed.initialize), 6 B after (630)
    during, after = engine_build(108_943_872, 108_943_872, 2, 2, 2, mixed=True)
    assert during.device == 8 * 108_943_872 and after.device == 6 * 108_943_872
    # trlx's RM trains 45 M of them: 2 x 108.9 M + 2 x 45.2 M + 8 x 45.2 M / 2 = 466 MiB (measured 476)
    assert engine_build(108_944_640, 45_153_792, 2, 2, 2, True)[0].device / 2**20 == pytest.approx(466.2, abs=0.1)
    # fp32: the flat copy is the peak, no gradient partition up front: 4 + 4 B (832 MiB; measured 887)
    assert engine_build(108_943_872, 108_943_872, 4, 2, 2, mixed=False)[0].device == 8 * 108_943_872
    # freed tensors returned (a 128 KiB mmap threshold): the cast weights' own tensors are gone before the fp32
    # partitions are made, so the build peaks at the larger of the flat copy beside them (2 + 2 B) and what the
    # engine keeps (2 + 8 / 2 B): 6 B a parameter in bf16; in fp32 the flat copy (4 + 4 B) against 4 + 4 / 2
    during, after = engine_build(108_943_872, 108_943_872, 2, 2, 2, mixed=True, returned=True)
    assert during.device == after.device == 6 * 108_943_872
    assert engine_build(108_943_872, 108_943_872, 4, 2, 2, False, returned=True)[0].device == 8 * 108_943_872


def test_colossalai_rm_init_holds_weights_and_master_only():
    # the model's arithmetic (the adapter's measured 636-638 MiB is in the curated example): the RM at ZeRO-0
    # under 3d holds its bf16 weights and fp32 master at init, moments at the first step: 2 + 4 B a parameter
    spec = spec_from_config(compose(["framework=colossalai", "stage=rm", *BASE, "zero=0"]))
    assert physics(spec, "rm")["init"].device / 2**20 == pytest.approx(623.4, abs=0.5)


def test_trlx_ppo_update_counts_frozen_blocks_only_under_a_trained_position_table():
    """trlx's PPO trains the top 2 blocks (hydra); the bottom 10 are frozen with the input embedding. Their
    forward records for autograd only where a gradient has to pass them: GPT-2's learned position table trains,
    a rotary family has none. Batch 2 x 256 tokens, h = 768, bf16: sbh = 393,216 values."""
    sbh = 2 * 256 * 768

    def update(model: str) -> float:
        spec = spec_from_config(compose(["framework=trlx", "stage=ppo", f"model={model}", "prompt_len=128",
                                         "answer_len=128", "batch=2", "launcher.nproc=2", "precision=bf16",
                                         "zero=2"]))
        return physics(spec, "ppo", "cpu")["training"].activations

    # llama-base (i = 2048 = 8/3 h): a trained block keeps 2 fp32 norm inputs (8 bytes), Q K V-at-full-width and
    # the attention output (4h), gate, SiLU and up (3i = 8h), the maps' inputs (q/k/v 1, o 1, gate/up 1, down
    # 8/3) and its 2 trained norms' outputs (2h), at 2 bytes: 8 + 2 (4 + 8 + 17/3 + 2) = 142/3 bytes a value;
    # two of them, the embedding and final norm outputs (3h x 2 bytes), the frozen ten nothing
    assert update("llama-base") == 2 * 142 * sbh // 3 + 6 * sbh == 39_583_744
    # glm-base (GPT-2 shaped, i = 4h): a trained block keeps (6 + 16 + 7 inputs) x 2 = 58 bytes, a frozen one
    # 22 x 2 = 44 (no inputs for weight gradients), the position table's gradient runs through all ten
    assert update("glm-base") == (2 * 58 + 10 * 44 + 6) * sbh == 220_987_392


def test_colossalai_fp32_zero2_gradients_are_the_rank_s_part_and_a_bucket_by_hand():
    """LowLevelZero at fp32: each rank keeps its half of the fp32 gradients (108,943,872 parameters / 2 x 4 bytes)
    and the step hands them to the master as they are, no fp32 copy; the reduce bucket is 12 Mi fp32 values.
    Under bf16 the step adds the fp32 copy of the rank's part (2 + 4 bytes a parameter over 2 ranks)."""
    s = shape("colossalai", "sft", "zero=2", "precision=fp32")
    grads = coati.predict(s)["training"].grads
    assert grads == 4 * 108_943_872 / 2 == 217_887_744
    bf16 = coati.predict(shape("colossalai", "sft", "zero=2"))["training"].grads
    assert bf16 == (2 + 4) * 108_943_872 / 2


def _training(framework: str, *overrides: str) -> tuple:
    """SFT training at glm-base fp32, 2 ranks: (glibc's own threshold, 128 KiB fixed) physics."""
    cell = ["precision=fp32", *overrides]
    kept = physics(spec_from_config(compose([f"framework={framework}", "stage=sft", *BASE, *cell])), "sft")
    returned = physics(spec_from_config(compose([f"framework={framework}", "stage=sft", *BASE, *cell,
                                                 "memory_mmap_threshold=131072"])), "sft")
    return kept["training"], returned["training"]


T = 108_943_872  # glm-base's trained parameters in SFT (the LM, its head tied)


@pytest.mark.parametrize("framework, zero, made", [
    # DeepSpeed ZeRO-2 at fp32: the reduce bucket (5e8 values hold all T, 4 B each) and the flattened copy of it
    # that is all-reduced, 8 B x T, outweigh the step's partition and its flattened copy (4 + 4 B x T / 2 ranks)
    ("dschat", 2, 2 * 4 * T),
    ("trlx", 2, 2 * 4 * T),
    # ZeRO-3: the fp32 gradients the step flattens (4 B x T / 2); the half partition (here fp32) stays
    ("dschat", 3, 4 * T / 2),
    # LowLevelZero: the working gradients' partition (4 B x T / 2) and its 12 Mi-value bucket
    ("colossalai", 2, 4 * T / 2 + 4 * 12 * 2**20),
])
def test_returned_heap_holds_the_activations_or_the_gradients_not_both(framework, zero, made):
    kept, returned = _training(framework, f"zero={zero}", "batch=4")
    # 128 + 128 tokens x 4 sequences: the saved activations and logits outweigh the gradients the step makes,
    # so with the freed pages returned the step peaks at the backward's start and the gradients add nothing
    work = returned.activations + returned.logits
    assert work > made
    assert kept.device - returned.device == pytest.approx(made)
    assert (returned.activations, returned.logits) == (kept.activations, kept.logits)
    # one 8 + 8-token sequence: the gradients outweigh the activations, and the step peaks at the backward's end
    kept, returned = _training(framework, f"zero={zero}", "batch=1", "prompt_len=8", "answer_len=8")
    work = kept.activations + kept.logits
    assert work < made
    assert kept.device - returned.device == pytest.approx(work)


def test_which_thresholds_return_freed_tensors():
    spec = spec_from_config(compose(["framework=dschat", "stage=sft", *BASE]))
    assert not RunShape.from_spec(spec, "sft").freed_returned  # glibc's own threshold keeps the freed heap
    for threshold, returned in ((0, True), (131_072, True), (131_073, False), (4_194_304, False)):
        spec = spec_from_config(compose(["framework=dschat", "stage=sft", *BASE, f"memory_mmap_threshold={threshold}"]))
        assert RunShape.from_spec(spec, "sft").freed_returned is returned
        assert not RunShape.from_spec(spec, "sft", "cuda").freed_returned  # the host's allocator only


@pytest.mark.parametrize("value_bytes, dp, reduction, step", [
    # 1,000 trained parameters, DeepSpeed's 5e8 bucket holding them all: the reduction holds the bucket and the
    # flattened copy it all-reduces (2 x value bytes each); the step the rank's partition, its flattened copy and,
    # in bf16, that copy cast to fp32 ((2 + 2 + 4) / dp bytes; fp32 (4 + 4) / dp, the cast being the same tensor)
    (2, 2, 4_000, 4_000),
    (4, 2, 8_000, 4_000),
    (2, 1, 4_000, 8_000),
    (4, 1, 8_000, 8_000),
])
def test_deepspeed_zero2_makes_the_larger_of_its_reduction_and_its_step(value_bytes, dp, reduction, step):
    assert zero2_made_bytes(1_000, value_bytes, dp) == (reduction, step)
    precision = "bf16" if value_bytes == 2 else "fp32"
    kept, made = gradient_terms(1_000, value_bytes, 2, dp, precision)
    assert kept == Terms()
    assert made == (Terms(buffers=reduction) if reduction >= step else Terms(grads=step))


def test_zero3_gradient_partition_stays_through_every_phase():
    """DeepSpeed's ZeRO-3 makes each trained engine's gradient partition (stage3.py grad_partitions_flat_buffer,
    the model's dtype, a rank's share) at the end of its build and keeps it; measured resident after the build
    and through generation, experience and update (DS-Chat PPO, llama-base with 2 layers, fp32, 2 ranks: 117.8
    and 70.9 MiB for actor and critic). glm-base bf16 on 2 ranks: DS-Chat's actor 108,943,872 and critic
    108,944,640 trained parameters, 2 bytes each over 2 ranks; trlx's one model 15,753,217."""
    def grads(framework: str, stage: str, *overrides: str) -> dict[str, float]:
        spec = spec_from_config(compose([f"framework={framework}", f"stage={stage}", *BASE, *overrides]))
        return {phase: terms.grads for phase, terms in physics(spec, stage).items()}

    both = 108_943_872 + 108_944_640
    z3 = grads("dschat", "ppo", "zero=3")
    assert z3["generation"] == z3["experience"] == both
    assert z3["training"] >= both  # the step's own fp32 gradients come on top
    assert grads("dschat", "ppo", "zero=2")["generation"] == 0
    assert grads("trlx", "ppo", "zero=3")["experience"] == 15_753_217
    # at ZeRO-0 trlx's kept terms are DDP's buckets and autocast's copies, which live through an update only
    assert grads("trlx", "ppo", "zero=0")["generation"] == 0
    assert grads("dschat", "rm", "zero=3")["evaluation"] == 108_944_640


LLAMA_FP32 = ["model=llama-base", "prompt_len=128", "answer_len=128", "batch=2", "launcher.nproc=2", "precision=fp32",
              "memory_mmap_threshold=131072"]


def reference_shape(stage: str, *overrides: str) -> RunShape:
    spec = spec_from_config(compose(["framework=torch", f"stage={stage}", *LLAMA_FP32, *overrides]))
    return RunShape.from_spec(spec, stage)


def test_the_reference_s_lora_counts_by_hand():
    """peft r=64 on llama-base's seven block maps: q and o 64 x (768 + 768), k and v 64 x (768 + 256) (4 kv heads
    of 64), gate, up and down 64 x (768 + 2048): 868,352 a block, 10,420,224 over 12; the value head (768, no
    bias) trains beside them."""
    from adapters.reference import memory as reference

    s = reference_shape("ppo", "lora=64", "zero=2")
    assert reference.role_params(s, "actor", 64) == (124_668_672 + 10_420_224, 10_420_224)
    assert reference.role_params(s, "critic", 64) == (100_092_672 + 768 + 10_420_224, 10_420_992)
    assert reference.role_params(s, "reward", 0) == (100_093_440, 100_093_440)


@pytest.mark.parametrize("zero, params, optimizer, buffers", [
    # llama-base's 124,668,672 parameters P in fp32 on 2 ranks, after the first step
    (0, 4, 8, 4),      # DDP: whole weights and moments, the reducer's fp32 buckets over every gradient
    (1, 4, 4, 4),      # ZeroRedundancyOptimizer: the moments split
    (2, 2, 4, 4),      # FSDP2: fp32 shards, the whole model gathered from forward to backward's end
    (3, 2, 4, 4 * 61_738_752 / 124_668_672)])  # resharded: the root unit (2 x 24,576,000 + 768) and 2 blocks
def test_the_reference_s_sft_state_per_layout_by_hand(zero, params, optimizer, buffers):
    from adapters.reference import memory as reference

    p = 124_668_672
    training = reference.predict(reference_shape("sft", f"zero={zero}"))["training"]
    assert training.params == params * p and training.optimizer == optimizer * p
    assert training.buffers == pytest.approx(buffers * p)


def test_the_reference_s_ppo_holds_frozen_roles_in_the_run_s_precision():
    """Reference (the LM) and reward (backbone + value head) frozen: whole in fp32 at ZeRO-2, split at ZeRO-3;
    the trained actor and critic as fp32 shards with their moments (8 B a parameter over 2 ranks)."""
    from adapters.reference import memory as reference

    actor, value = 124_668_672, 100_093_440
    z2 = reference.predict(reference_shape("ppo", "zero=2"))["generation"]
    assert z2.params == 4 * (actor + value) / 2 + 4 * (actor + value)
    assert z2.optimizer == 8 * (actor + value) / 2
    z3 = reference.predict(reference_shape("ppo", "zero=3"))["generation"]
    assert z3.params == 4 * (actor + value) / 2 + 4 * (actor + value) / 2


FSDP2_STATES = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
for reshard in (False, True):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for block in list(model)[:2]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    kinds = lambda: sorted({type(p).__name__ for p in model.parameters()})
    with torch.no_grad():
        model(torch.randn(2, 8))
    after_scoring = kinds()
    model(torch.randn(2, 8)).sum().backward()
    print(reshard, after_scoring, kinds())
dist.destroy_process_group()
"""


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_fsdp2_keeps_what_a_forward_without_autograd_gathered_until_the_next_backward():
    """The reference's _held rule, read from FSDP2 itself: its registered parameters are plain tensors while
    gathered and DTensors while sharded. Without resharding after the forward (the reference's ZeRO-2) a forward
    under no_grad leaves every unit gathered, root and blocks, and the backward reshards them; with it (ZeRO-3)
    nothing stays gathered after the forward."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FSDP2_STATES], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["False ['Parameter'] ['DTensor']", "True ['DTensor'] ['DTensor']"]


def test_the_reference_s_model_state_matches_its_engines_counters():
    """Each run of the reference's curated fp32 rung: the bytes of parameters and optimizer state its engines
    hold on rank 0 after the last step (the record's `model_state`, counted from the tensors themselves), summed
    over the roles, against the memory model's weights and moments. RM reads them after its last scoring, which
    at ZeRO-2 leaves the reward gathered whole beside its shards (4 B a parameter more: FSDP2's unsharded
    parameters are what the counter sees then, with the trained ones' fp32 shards as their master copies)."""
    import json
    from pathlib import Path

    from adapters.reference import memory as reference

    rung = Path(__file__).resolve().parents[1] / "results/examples/llama-base-fp32-torch"
    checked = 0
    for path in sorted(rung.rglob("record.json")):
        record = json.loads(path.read_text())
        if record["status"] != "ok":
            continue
        config = record["config"]
        spec = spec_from_config({**config, "init": {}})
        ((stage, result),) = record["stages"].items()
        counted = sum(role["param_bytes_per_rank"][0] + role["optimizer_state_bytes_per_rank"][0]
                      for name, role in result["model_state"].items() if name != "method")
        phases = reference.predict(RunShape.from_spec(spec, stage))
        terms = phases["evaluation" if stage == "rm" else "generation" if stage == "ppo" else "training"]
        modelled = terms.params + terms.optimizer
        if stage == "rm" and spec.zero == 2:  # the counter then sees the unsharded weights, and as master copies
            # the shards of the trained ones only: the frozen ones' shards (LoRA's base weights) are not in it
            params, trainable = reference.role_params(RunShape.from_spec(spec, stage), "reward", spec.lora)
            modelled += 4 * params - 4 * (params - trainable) / spec.data_parallel
        assert counted == pytest.approx(modelled, abs=2**20), (path.parent.name, counted, modelled)
        checked += 1
    assert checked == 18
