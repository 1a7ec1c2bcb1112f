"""The GPU planner: per-role memory by hand, the search on the issue's two clusters, plan files (hostile ones
too), `--check` and the claims arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from bench.plan import claims_arithmetic as arithmetic
from bench.plan import plan_file
from bench.plan.cluster import (
    GPUS,
    Cluster,
    Layout,
    Role,
    Workload,
    optimizer_step,
    phase_terms,
    resident,
    training,
    training_peak,
)
from bench.plan.physics import Arch, Terms
from bench.plan.search import GIB, plan_with_variants, search

GLM_10B = plan_file.arch_of("glm-10b")[1]
PSI = GLM_10B.total_params  # 9,876,480,000 + ... (one position table in the stand-in)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resident_bytes_by_hand():
    w = Workload()
    actor = Role("actor", GLM_10B)
    # ZeRO-2 over 8: bf16 weights whole (2 Psi), optimizer 12 Psi / 8
    assert resident(actor, Layout(dp=8, zero=2), w).params == 2 * PSI
    assert resident(actor, Layout(dp=8, zero=2), w).optimizer == pytest.approx(12 * PSI / 8)
    # tp 4 x pp 2: everything over 8 first; ZeRO-3 over dp 2 on top; its bucket of 5e8 bf16 values
    r = resident(actor, Layout(tp=4, pp=2, dp=2, zero=3), w)
    assert r.params == pytest.approx(2 * PSI / 16) and r.optimizer == pytest.approx(12 * PSI / 16)
    assert r.buffers == 2 * 5e8
    # and its gradient partition, bf16, kept from the build through every phase (stage3.py
    # grad_partitions_flat_buffer): 2 Psi / 16, so the backward adds no gradients of its own
    assert r.grads == pytest.approx(2 * PSI / 16)
    assert training(actor, Layout(tp=4, pp=2, dp=2, zero=3), w).grads == 0
    # under offload the partition lives on the host (4 bytes a parameter over dp with the states) and the
    # backward's rank gradients pass through the GPU: 2 Psi / 8 there
    off = Layout(dp=8, zero=3, offload=True)
    assert resident(actor, off, w).grads == 0 and resident(actor, off, w).host == pytest.approx(
        2 * PSI / 8 + 12 * PSI / 8 + 4 * PSI / 8)
    assert training(actor, off, w).grads == pytest.approx(2 * PSI / 8)
    assert resident(Role("reference", GLM_10B), Layout(dp=8, zero=3), w).grads == 0  # nothing trains
    # offload: the optimizer states and an fp32 gradient per parameter go to the host
    r = resident(actor, Layout(dp=8, zero=2, offload=True), w)
    assert r.optimizer == 0 and r.host == pytest.approx(12 * PSI / 8 + 4 * PSI / 8)
    # a frozen role: weights only; LoRA 8: 16 r h L factors, each with 2 + 2 + 12 bytes, partitioned as ZeRO
    # partitions every trained parameter: at ZeRO-2 over 8 the weights whole, gradients and states / 8:
    # 2 + 2/8 + 12/8 = 3.75 bytes a factor
    assert resident(Role("reference", GLM_10B), Layout(dp=8), w).device == 2 * PSI
    lora = resident(Role("actor", GLM_10B, lora=8), Layout(dp=8, zero=2), Workload(lora=8))
    assert lora.lora == GLM_10B.lora_params(8) * 3.75 and lora.optimizer == 0
    assert resident(Role("actor", GLM_10B, lora=8), Layout(), Workload(lora=8)).lora == GLM_10B.lora_params(8) * 16
    # ZeRO-3 over 64 GPUs: LoRA (frozen weights 2 Psi / 64 + factors 16 / 64 each + the bucket DeepSpeed
    # allocates whole, 2 x 5e8) stays below full fine-tuning (16 Psi / 64 + the same bucket), not above it
    full = resident(actor, Layout(dp=64, zero=3), w)
    lora = resident(Role("actor", GLM_10B, lora=8), Layout(dp=64, zero=3), Workload(lora=8))
    assert lora.lora == pytest.approx(GLM_10B.lora_params(8) * 16 / 64)
    assert lora.device == pytest.approx(2 * PSI / 64 + GLM_10B.lora_params(8) * 16 / 64 + 2 * 5e8)
    assert full.device == pytest.approx(16 * PSI / 64 + 2 * 5e8) and lora.device < full.device / 2


def test_training_terms_by_hand():
    w = Workload(micro_batch=1, prompt_len=512, answer_len=512)
    t = training(Role("critic", GLM_10B), Layout(dp=8, zero=2, recompute=True), w)
    sbh = 1024 * 4096
    # 48 layer inputs (2 s b h) + one layer rebuilt (s b h (34 + 5 a s / h) = sbh x (34 + 80))
    assert t.activations == pytest.approx(48 * 2 * sbh + sbh * (34 + 5 * 64 * 1024 / 4096))
    assert t.grads == pytest.approx(2 * PSI / 8) and t.logits == 0  # the critic has no vocabulary logits
    # ZeRO-2's reduce buckets, two under overlap_comm (DS-Chat's), each 5e8 bf16 values allocated whole, and
    # the flattened copy of a full one all-reduced: 3 x 2 x 5e8 bytes, filled and freed within the backward
    assert t.buffers == 3 * 2 * 5e8


def test_zero2_step_outweighs_a_small_backward():
    """DeepSpeed's ZeRO-2 step (stage_1_and_2.py) holds the gradient partition, its flattened copy and that copy
    in fp32: 2 + 2 + 4 bytes a trained parameter over dp in bf16, 4 + 4 in fp32. A GLM-10B critic on 8 GPUs
    at one 1,024-token micro-batch with recomputation: its backward holds 2 Psi / 8 of gradients, 3 x 1e9 of
    buckets and 0.88 GB of activations (6.35e9), its step Psi (9.88e9): the step is the phase's peak."""
    w = Workload(micro_batch=1, prompt_len=512, answer_len=512)
    layout, critic = Layout(dp=8, zero=2, recompute=True), Role("critic", GLM_10B)
    trained = PSI + 4096  # the value head: 4,096 weights, no bias
    backward = training(critic, layout, w)
    assert backward.device == pytest.approx(2 * trained / 8 + 3e9 + 880_803_840)
    assert optimizer_step(critic, layout, w) == Terms(grads=8 * trained / 8)
    assert training_peak(critic, layout, w) == Terms(grads=8 * trained / 8)
    fp32 = Workload(precision="fp32", micro_batch=1, prompt_len=512, answer_len=512)
    assert optimizer_step(critic, layout, fp32).grads == 8 * trained / 8  # the fp32 cast is the same tensor
    # without overlap_comm one bucket and the flattened copy; a model under a bucket still gets it whole
    assert training(critic, layout, Workload(micro_batch=1, overlap_comm=False)).buffers == 2 * 2 * 5e8
    small = Arch(64, 2, 4, 100, 32)
    tiny = training(Role("critic", small), Layout(dp=2, zero=2), w)
    # the small critic by hand: embeddings 100 x 64 + 32 x 64, two blocks of 49,984 (norms 2 x 128, QKV 64 x 192
    # + 192, output 64 x 64 + 64, MLP 64 x 256 + 256 and 256 x 64 + 64), the final norm 128, the value head 64
    assert tiny.buffers == 2 * (2 * 5e8 + 108_608)
    # ZeRO-3 allocates its bucket whole at build and keeps it (stage3.py), a small role too
    assert resident(Role("critic", small), Layout(dp=2, zero=3), w).buffers == 2 * 5e8
    # the other stages' steps add nothing the backward does not exceed
    assert optimizer_step(critic, Layout(dp=8, zero=3), w) == Terms()
    assert optimizer_step(critic, Layout(dp=8, zero=1), w) == Terms()


def test_colocated_phases_add_residents_and_take_the_largest_working_set():
    w = Workload()
    roles = [(Role(n, GLM_10B), Layout(dp=8, zero=3)) for n in ("actor", "critic", "reference", "reward")]
    train = phase_terms(roles, "training", w)
    residents = sum(resident(r, lay, w).device for r, lay in roles)
    actor_work = training(*roles[0], w).device
    assert train.device == pytest.approx(residents + actor_work)  # the actor's pass is the larger (logits)


def test_glm10b_on_8x8x40_has_a_plan_and_explains_rejections():
    result = search(GLM_10B, Workload(), Cluster(nodes=8, gpus_per_node=8, gpu="A100-40GB"))
    assert result.plans and all(p.peak <= 0.9 * 39.50 * 2**30 for p in result.plans)
    best = result.best
    assert sum(lay.gpus for name, lay in best.layouts.items() if name == "actor") <= 64
    assert result.rejected, "the uniform layouts a team tries first must be shown with why they fail"
    reasons = [line for plan in result.rejected for line in plan.overflows()]
    assert any("over by" in line and "GiB" in line for line in reasons)


def test_glm10b_on_1x8x16_needs_lora_or_offload():
    results = plan_with_variants(GLM_10B, Workload(precision="fp16"), Cluster(nodes=1, gpus_per_node=8,
                                                                              gpu="V100-16GB"))
    assert not results[0].plans, "full fine-tuning of four GLM-10B roles cannot fit 8 x 16 GB"
    fitting = {r.variant: r.best for r in results[1:] if r.plans}
    assert any("LoRA" in v for v in fitting) and any("offload" in v for v in fitting)
    for plan in fitting.values():
        assert plan.peak <= 0.9 * 15.77 * 2**30


def test_the_limit_is_the_safety_share_of_torchs_total_memory():
    # A100-40GB: torch reports 39.50 GiB (the table's figure, from a public out-of-memory message), 90 % of it
    assert Cluster(nodes=1, gpus_per_node=8).limit_bytes == pytest.approx(0.9 * 39.50 * 2**30)
    assert Cluster(nodes=1, gpus_per_node=8, gpu="H200-141GB").limit_bytes == pytest.approx(0.9 * 139.80 * 2**30)
    # a team's own reading of total_memory wins over the table, and the safety share applies to it
    own = Cluster(nodes=1, gpus_per_node=8, gpu="H100-80GB", gpu_memory_gib=79.19, safety=0.8)
    assert own.limit_bytes == pytest.approx(0.8 * 79.19 * 2**30)
    for name, gpu in GPUS.items():  # the nominal size counts GiB of HBM; the driver keeps up to ~8 % of it
        assert 0.9 * gpu.memory_gb < gpu.total_memory_gib < gpu.memory_gb, name


def test_dp_is_gpus_over_tp_times_pp():
    result = search(GLM_10B, Workload(), Cluster(nodes=2, gpus_per_node=8, gpu="A100-80GB"))
    for plan in result.plans:
        for group in plan.groups:
            for name in group.roles:
                lay = plan.layouts[name]
                assert lay.tp * lay.pp * lay.dp == group.gpus
                assert lay.tp <= 8 and GLM_10B.heads % lay.tp == 0


def _plan(tmp_path, **changes) -> str:
    with open(os.path.join(ROOT, "conf", "plan", "example-8b.yaml")) as f:
        data = yaml.safe_load(f)
    for key, value in changes.items():
        if key in data["execution_plan"]:
            data["execution_plan"][key] = value
        else:
            data[key] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("change, message", [
    ({"actor": {"tp": 3, "dp": 8}}, "must divide the model's 64 attention heads"),
    ({"actor": {"tp": 1, "dp": 4, "zero": 2}}, "must span the same number"),
    ({"actor": {"dp": 4, "zero": 2, "group": "a"}}, "span 12 GPUs"),
    ({"reward": {"tp": 1, "dp": 8, "zero": 2}}, "a frozen role has no gradients"),
    ({"reference": {"tp": 1, "dp": 8, "requires_grad": True}}, "is frozen in PPO"),
    ({"critic": {"stages": ["generation"], "dp": 8}}, "runs exactly"),
    ({"actor": {"tp": "8", "dp": 1}}, "must be an integer"),
    ({"actor": {"tp": 1, "dp": 8, "offload": True, "zero": 0}}, "needs a trained role at zero >= 1"),
    ({"actor": {"dp": 8, "ram": 1}}, "unknown keys"),
    ({"cluster": {"nodes": 0, "gpus_per_node": 8}}, "cluster.nodes=0"),
    ({"cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "Z80"}}, "is not known"),
    ({"cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_mem_gb": 40}}, "cluster.gpu_memory_gib"),
    ({"model": "glm-99b"}, "is not a model in conf/model"),
    ({"judge": {"dp": 8}}, "unknown keys \\['judge'\\]"),
    ({"execution_plan": {"actor": {"dp": 8}}}, "missing"),
    ({"workload": {"cache": "paged"}}, "workload.cache"),
])
def test_hostile_plan_files_are_refused_by_name(tmp_path, change, message):
    path = _plan(tmp_path, **change)
    with pytest.raises(plan_file.PlanError, match=message):
        data = plan_file.read(path)
        name, arch = plan_file.arch_of(data["model"])
        cluster = plan_file.cluster_of(data["cluster"])
        plan_file.workload_of(data.get("workload"))
        plan_file.layouts_of(data["execution_plan"], arch, arch, cluster)


def test_unreadable_plan_files(tmp_path):
    for text, message in (("execution_plan: [", "not valid YAML"), ("- a\n- b\n", "must be a mapping"),
                          ("execution_plan: {}\nextra: 1\n", "unknown keys")):
        path = tmp_path / "p.yaml"
        path.write_text(text)
        with pytest.raises(plan_file.PlanError, match=message):
            plan_file.read(str(path))
    with pytest.raises(plan_file.PlanError, match="is not a file"):
        plan_file.read(str(tmp_path / "missing.yaml"))
    big = tmp_path / "big.yaml"
    big.write_text("#" * (plan_file.MAX_FILE_BYTES + 1))
    with pytest.raises(plan_file.PlanError, match="at most"):
        plan_file.read(str(big))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.engine
def test_cli_plans_writes_yaml_and_check_reads_it_back(tmp_path):
    out = tmp_path / "plan.yaml"
    done = _cli("model=glm-10b", "cluster.nodes=8", "cluster.gpus_per_node=8", "cluster.gpu=A100-40GB", f"out={out}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "placement(s) fit" in done.stdout and "rejected" in done.stdout
    written = yaml.safe_load(out.read_text())
    assert set(written["execution_plan"]) == {"actor", "critic", "reference", "reward"}
    assert written["predicted"]["peak_gib_per_gpu"] <= written["predicted"]["limit_gib"]
    checked = _cli("--check", f"plan={out}")
    assert checked.returncode == 0 and "fits" in checked.stdout


@pytest.mark.engine
def test_cli_check_says_what_runs_out_and_what_fixes_it():
    done = _cli("--check", "plan=conf/plan/example-8b.yaml")
    assert done.returncode == 1
    assert "does not fit" in done.stdout and "over by" in done.stdout
    assert "recomputation on" in done.stdout and "together:" in done.stdout


@pytest.mark.engine
def test_cli_small_cluster_proposes_variants():
    done = _cli("cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=V100-16GB", "workload.precision=fp16",
                "out=/dev/null")
    assert done.returncode == 0
    assert "No plan fits" in done.stdout and "LoRA" in done.stdout and "offload" in done.stdout


@pytest.mark.engine
@pytest.mark.parametrize("change, message", [
    ({"execution_plan": {"judge": {"dp": 8}}}, "unknown"),
    ({"execution_plan": {"actor": {"tp": 3, "dp": 8}}}, "must divide the model's 64 attention heads"),
    ({"cluster": {"nodes": 2}}, "span 8 GPUs"),
])
def test_cli_refuses_hostile_plan_files_with_exit_2_and_writes_nothing(tmp_path, change, message):
    with open(os.path.join(ROOT, "conf", "plan", "example-8b.yaml")) as f:
        data = yaml.safe_load(f)
    for key, value in change.items():
        for inner, v in value.items():
            data[key][inner] = {**data[key].get(inner, {}), **v} if isinstance(data[key].get(inner), dict) else v
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    done = _cli("--check", f"plan={path}")
    assert done.returncode == 2 and message in done.stdout.replace("\n", " "), done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


@pytest.mark.engine
def test_cli_refuses_bad_input():
    assert _cli("--check").returncode == 2
    assert _cli("cluster.nodes=-1").returncode == 2
    assert _cli("--frobnicate").returncode == 2
    done = _cli("cluster.gpu=V100-32GB")
    assert done.returncode == 2 and "bf16" in done.stdout


def test_claims_arithmetic_by_hand():
    # A3: four GLM-10B roles, ZeRO-2 over 8: 2 x (2 Psi + 14 Psi / 8) + 2 x 2 Psi of model states, plus the
    # actor's recomputed activations (48 x 2 s b h + one layer) and its bf16 gradient share 2 Psi / 8
    setting = arithmetic.Setting(GLM_10B, "ppo", gpus=8, zero=2, micro_batch=4, seq=512)
    sbh = 4 * 512 * 4096
    states = 2 * (2 * PSI + 12 * PSI / 8) + 2 * 2 * PSI
    working = 2 * PSI / 8 + 48 * 2 * sbh + sbh * (34 + 5 * 64 * 512 / 4096)
    assert arithmetic.lower_bound(setting) == pytest.approx(states + working)
    verdict, evidence = arithmetic.memory_figures(setting, {"DeepSpeed-Chat": 28.9})
    assert verdict == arithmetic.IMPLAUSIBLE and "ZeRO-3 + LoRA" in evidence
    assert arithmetic.memory_figures(setting, {"big": 200.0})[0] == arithmetic.CONSISTENT
    assert arithmetic.batch_arithmetic(32, 4, 4, 8)[0] == arithmetic.IMPLAUSIBLE  # 4 x 4 x 8 = 128
    assert arithmetic.batch_arithmetic(256, 4, 8, 8)[0] == arithmetic.CONSISTENT
    assert arithmetic.dtype_support("V100-32GB", "bf16")[0] == arithmetic.IMPLAUSIBLE
    assert arithmetic.dtype_support("A100-80GB", "bf16")[0] == arithmetic.CONSISTENT


def test_a_small_arch_is_accepted_inline():
    name, arch = plan_file.arch_of({"hidden": 64, "layers": 2, "heads": 4, "vocab": 100, "positions": 32})
    assert name == "custom" and arch == Arch(64, 2, 4, 100, 32)
    assert GIB == 2**30


def test_hybrid_engine_generation_gathers_the_weights_into_its_own_layout():
    w = Workload(micro_batch=2)
    actor = Role("actor", GLM_10B)
    he = Layout(dp=8, zero=3, generation_tp=4)
    assert he.generation == Layout(tp=4, pp=1, dp=2) and "gen d2p1m4" in he.notation
    from bench.plan.cluster import generation
    g = generation(actor, he, w)
    # the whole model gathered into 4 shards (2 Psi / 4); the prompts all-gathered over the 4-way group, so
    # each GPU decodes 4 x 2 sequences on a quarter of the heads: a whole micro-batch's KV cache, 2 layers'
    # K and V x 48 x 4096 x 2 bytes x 2 sequences x 1,024 tokens = 1,610,612,736 bytes (not / 4). DeepSpeed
    # keeps it as its workspace through every phase (resident) unless release_inference_cache
    kv = 2 * 48 * 4096 * 2 * 2 * 1024
    assert g.buffers == pytest.approx(2 * PSI / 4)
    assert g.cache == 0 and resident(actor, he, w).cache == pytest.approx(kv)
    released = Workload(micro_batch=2, release_inference_cache=True)
    assert generation(actor, he, released).cache == pytest.approx(kv) and resident(actor, he, released).cache == 0
    # the prefill works on the 8 gathered sequences, each GPU on a quarter of the widths: 512 x 8 x 6h / 4
    assert g.activations == pytest.approx(512 * 8 * 6 * 4096 / 4 * 2 + 2 * 8 * 64 / 4 * 512 ** 2 * 2)
    plain = generation(actor, Layout(dp=8, zero=3), w)
    assert plain.buffers == pytest.approx(2 * 2 * GLM_10B.largest_layer_params)  # a layer and its prefetch
    assert plain.cache == pytest.approx(kv) and resident(actor, Layout(dp=8, zero=3), w).cache == 0
    # a training layout that already holds the generation layout's shard whole gathers nothing: ZeRO-2 at the
    # generation tp (DS-Chat's single-GPU scripts) decodes on the trained weights; ZeRO-2 at tp 1 into tp 4
    # slices them into a quarter of the model
    assert generation(actor, Layout(dp=8, zero=2, generation_tp=1), w).buffers == 0
    assert generation(actor, Layout(dp=8, zero=2, generation_tp=4), w).buffers == pytest.approx(2 * PSI / 4)


def test_experience_caches_kept_as_each_framework_keeps_them():
    from bench.plan.cluster import experience_keep

    # one 1,024-token sequence of GLM-10B: K and V of 48 layers x 4096 x 2 bytes x 1,024 = 805,306,368 bytes
    kv = 2 * 48 * 4096 * 2 * 1024
    actor, reference = Role("actor", GLM_10B), Role("reference", GLM_10B)
    assert experience_keep(reference, Layout(dp=8), Workload()).cache == kv  # DS-Chat keeps the whole output
    assert experience_keep(actor, Layout(dp=8), Workload()).cache == kv
    # DS-Chat runs these forwards after self.train(): a recomputing actor returns no cache (transformers drops
    # it under gradient checkpointing in train mode); the reference, in eval mode, still does
    assert experience_keep(actor, Layout(dp=8, recompute=True), Workload()).cache == 0
    assert experience_keep(reference, Layout(dp=8, recompute=True), Workload()).cache == kv
    # ColossalChat takes only the logits of each forward
    coati = Workload(keep_experience_caches=False)
    assert experience_keep(reference, Layout(dp=8), coati).cache == 0 and experience_keep(actor, Layout(dp=8),
                                                                                          coati).cache == 0
    assert experience_keep(actor, Layout(dp=8), coati).logits == 1024 * 50_304 * 2


def test_plan_files_round_trip(tmp_path):
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu="A100-80GB")
    layouts = {"actor": Layout(2, 1, 4, 3, False, True, 8), "critic": Layout(2, 1, 4, 3),
               "reference": Layout(8, 1, 1), "reward": Layout(8, 1, 1)}
    groups = (("actor", "critic", "reference", "reward"),)
    doc = plan_file.document("glm-10b", None, cluster, Workload(), "colocated", layouts, groups, {})
    path = tmp_path / "p.yaml"
    plan_file.write(doc, str(path), "# test\n")
    data = plan_file.read(str(path))
    again, again_groups = plan_file.layouts_of(data["execution_plan"], GLM_10B, GLM_10B, plan_file.cluster_of(
        data["cluster"]))
    assert again == layouts and again_groups == groups
    assert "actor: {stages: [generation, inference, training]" in path.read_text()


def test_lora_styles_critic_rank_and_offloaded_frozen_roles_by_hand():
    from bench.plan.cluster import experience_keep, host_bytes
    from bench.plan.search import make_roles

    # DS-Chat's LoRA freezes only the wrapped block weights (48 x 12 x 4096^2 = 9,663,676,416): the embeddings
    # (50,304 + 1,024 positions) x 4096, biases and norms (48 x 13 x 4096) and the final norm keep training:
    # 212,803,584 dense parameters with the usual optimizer states (ZeRO-2 over 8: 12 bytes / 8)
    dense = PSI - 48 * 12 * 4096 ** 2
    assert dense == 212_803_584
    unwrapped = Role("actor", GLM_10B, lora=8, lora_trains="unwrapped")
    assert unwrapped.dense_trainable == dense and unwrapped.trainable == dense + GLM_10B.lora_params(8)
    held = resident(unwrapped, Layout(dp=8, zero=2), Workload(lora=8, lora_trains="unwrapped"))
    assert held.optimizer == pytest.approx(dense * 12 / 8) and held.lora == pytest.approx(GLM_10B.lora_params(8) * 3.75)
    # the critic's own rank: DS-Chat's --critic_lora_dim 0 leaves it fully trained
    roles = make_roles(GLM_10B, Workload(lora=8, critic_lora=0, lora_trains="unwrapped"))
    assert roles["actor"].lora == 8 and roles["critic"].lora == 0
    assert roles["critic"].trainable == GLM_10B.backbone_params + 4096
    # --offload_reference_model: the reference's weights on the host
    reference = Role("reference", GLM_10B)
    offloaded = resident(reference, Layout(dp=8), Workload(offload_reference=True))
    assert offloaded.params == 0 and offloaded.host == 2 * PSI
    # ColossalChat's offload_inference_models: reference and reward leave the GPU while the others train
    parked = Workload(offload_inference_models=True)
    pair = [(reference, Layout(dp=8)), (Role("actor", GLM_10B), Layout(dp=8, zero=3))]
    assert phase_terms(pair, "training", parked).params == pytest.approx(2 * PSI / 8)  # the actor's ZeRO-3 shard
    assert phase_terms(pair, "inference", parked).params == pytest.approx(2 * PSI + 2 * PSI / 8)
    assert host_bytes(reference, Layout(dp=8), parked) == 2 * PSI
    # parallel_output=False: each of 4 tensor-parallel ranks keeps the whole vocabulary's logits
    # (1 x 1,024 x 50,304 x 2 bytes = 103,022,592), not a quarter
    actor = Role("actor", GLM_10B)
    assert experience_keep(actor, Layout(tp=4, dp=2), Workload(parallel_output=False)).logits == 103_022_592
    assert experience_keep(actor, Layout(tp=4, dp=2), Workload()).logits == 103_022_592 / 4


def test_grouped_query_attention_and_zero_offload_on_one_gpu():
    from bench.plan.cluster import experience_keep
    from bench.plan.search import layouts_for

    llama = plan_file.arch_of("llama3-8b")[1]
    # the actor's KV cache of one 1,024-token sequence at 8 K/V heads: 2 x 32 x 1024 x 2 bytes x 1,024 tokens
    assert experience_keep(Role("actor", llama), Layout(dp=8), Workload()).cache == 2 * 32 * 1024 * 2 * 1024
    # tp must divide the K/V heads too: glm4-9b has 2, so tp 4 and 8 are never searched
    glm4 = plan_file.arch_of("glm4-9b")[1]
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu="A100-80GB")
    tps = {lay.tp for lay in layouts_for(Role("actor", glm4), 8, Workload(), cluster, offload=False)}
    assert tps == {1, 2}
    # ZeRO-Offload on one GPU: a ZeRO stage at dp = 1 is searched when it offloads
    one = Cluster(nodes=1, gpus_per_node=1, gpu="A100-80GB")
    found = set(layouts_for(Role("actor", llama), 1, Workload(), one, offload=True))
    assert Layout(dp=1, zero=2, offload=True) in found and Layout(dp=1, zero=2) not in found


@pytest.mark.engine
def test_cli_plans_an_overridden_preset_and_refuses_hostile_sizes():
    done = _cli("model=glm-10b", "model.layers=24", "out=/dev/null")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "glm-10b (model.layers=24)" in done.stdout  # planned as changed, named by the change
    for bad, words in (("model.heads=7", "heads=7 must divide hidden=4096"),
                       ("cluster.gpu_memory_gib=nan", "cluster.gpu_memory_gib=nan must be a positive finite number"),
                       ("cluster.host_mem_gb=inf", "cluster.host_mem_gb=inf must be a positive finite number"),
                       ("cluster.gpu_memory_gib=-40", "cluster.gpu_memory_gib=-40 must be a positive finite number"),
                       ("cluster.gpu=Z80", "cluster.gpu='Z80' is not known")):
        done = _cli("model=glm-10b", bad)
        assert done.returncode == 2 and words in done.stdout + done.stderr, (bad, done.stdout + done.stderr)


def test_trlx_hydra_layout_by_hand():
    from bench.plan.cluster import inference, training
    from bench.plan.search import make_roles

    h, vocab = 4096, 50_304
    layer = 12 * h * h + 13 * h  # a GPT-2-shaped block: QKV, output, MLP, their biases, two LayerNorms
    roles = make_roles(GLM_10B, Workload(hydra_layers=2))
    # the reference is trlx's branch: 2 blocks, the final LayerNorm (2h) and its own copy of the LM head
    assert roles["reference"].params == 2 * layer + 2 * h + vocab * h
    # the critic is the value head alone, Linear(h, 2h) + ReLU + Linear(2h, 1), on the actor's hidden states
    assert roles["critic"].params == (h * 2 * h + 2 * h) + (2 * h + 1) and roles["critic"].dense_trainable == \
        roles["critic"].params
    # the actor trains all but the word embedding (its tied head) and the 46 bottom blocks: 2 blocks, the final
    # norm and GPT-2's learned position table (trlx's freeze_bottom_causal_layers leaves it trainable)
    assert roles["actor"].dense_trainable == 2 * layer + 2 * h + 1024 * h
    assert roles["actor"].params == PSI and roles["reward"].params == GLM_10B.backbone_params + h
    # the 2 trained blocks keep what Korthikanti et al. count (1 x 1,024 tokens, 64 heads: 34 + 5as/h = 114 sbh
    # bytes); the position table trains under the 46 frozen ones, so the gradient runs through them and each keeps
    # all but its linear maps' inputs (QKV and MLP inputs 4, attention output input 2, GELU output 8): 100 sbh
    w, lay = Workload(hydra_layers=2), Layout(dp=8)
    sbh = 1024 * 4096
    assert training(Role("actor", GLM_10B), lay, Workload()).activations == 48 * 114 * sbh
    assert training(roles["actor"], lay, w).activations == (2 * 114 + 46 * 100) * sbh
    # a rotary family has no position table: nothing under the top blocks trains and the frozen ones keep nothing
    llama7b = plan_file.arch_of("llama2-7b")[1]
    llama_roles = make_roles(llama7b, w)
    full = training(Role("actor", llama7b), lay, Workload()).activations
    assert training(llama_roles["actor"], lay, w).activations == pytest.approx(full * 2 / llama7b.layers)
    # the branch's forward: every hidden state of the trunk returned (49 x 1 x 1,024 x h x 2 bytes) on top of
    # one block's working set
    plain = inference(Role("reference", GLM_10B), lay, Workload()).activations
    assert inference(roles["reference"], lay, w).activations == pytest.approx(plain + 49 * 1024 * h * 2)
    # the search keeps value head and branch on the actor's GPUs, sharded as the actor is
    llama = plan_file.arch_of("llama2-7b")[1]
    result = search(llama, Workload(hydra_layers=2), Cluster(nodes=1, gpus_per_node=8, gpu="A100-80GB"))
    assert result.plans and {p.placement for p in result.plans} == {"colocated"}
    for p in result.plans:
        actor = p.layouts["actor"]
        assert all((p.layouts[n].tp, p.layouts[n].pp, p.layouts[n].dp) == (actor.tp, actor.pp, actor.dp)
                   for n in ("critic", "reference"))
    # the step-time estimate, on one A100 (no communication): the 46 frozen bottom blocks run forward only,
    # the word embedding (frozen, tied: it is the head the gradient passes through) forward and input gradient,
    # the trained 2 blocks, norm and positions forward and backward; attention's backward in the top 2 blocks
    from bench.plan.cost import phase_seconds
    one = Cluster(nodes=1, gpus_per_node=1, gpu="A100-80GB")
    single = Workload(hydra_layers=2, global_batch=1)
    trained, below = 2 * layer + 2 * h + 1024 * h, 46 * layer
    attention = 4 * 48 * 1024 * h
    flops = (6 * trained + 4 * (PSI - trained - below) + 2 * below + attention + 2 * attention * 2 / 48) * 1024
    actor = make_roles(GLM_10B, single)["actor"]
    assert phase_seconds(actor, Layout(dp=1), single, one, "training") == pytest.approx(flops / (312e12 * 0.4))
    with pytest.raises(ValueError, match="hydra_layers=2 with LoRA"):
        Workload(hydra_layers=2, lora=8)
    with pytest.raises(ValueError, match="must be below the model's 48 blocks"):
        make_roles(GLM_10B, Workload(hydra_layers=48))


def test_lora_plans_hold_deepspeeds_whole_reduce_buckets():
    """DeepSpeed allocates its buckets whole whatever the trained values: a LoRA-8 critic of GLM-10B (no dense
    parameter trains) holds ZeRO-3's 5e8-value bucket from its build, 2 x 5e8 = 1e9 bytes (0.93 GiB) in bf16,
    and at ZeRO-2 two buckets under overlap_comm plus the flattened copy of its (tiny) trained values."""
    w = Workload(micro_batch=1, prompt_len=512, answer_len=512, lora=8)
    critic = Role("critic", GLM_10B, lora=8)
    assert critic.dense_trainable == 0 and critic.lora_params > 0
    assert resident(critic, Layout(dp=8, zero=3), w).buffers == 2 * 5e8
    assert resident(critic, Layout(dp=8, zero=2), w).buffers == 0
    assert training(critic, Layout(dp=8, zero=2), w).buffers == 2 * (2 * 5e8 + critic.lora_params)
    assert training(critic, Layout(dp=8, zero=1), w).buffers == 0


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
@pytest.mark.parametrize("args, said", [
    (("top=abc",), "top='abc' must be an integer >= 1"),
    (("top=-1",), "top=-1 must be an integer >= 1"),
    (("model=glm-base",), "workload.prompt_len + workload.answer_len = 1024 exceeds the model's 512 positions"),
    (("workload.lora=4096",), "workload.lora=4096 must be below the model's hidden size 4096"),
    (("--check", "plan=conf/plan/example-8b.yaml", "workload.global_batch=63"),
     "workload.global_batch=63 is not a whole number of micro-batches of 2 over the actor's 8 data-parallel ranks"),
    (("--check", "plan=conf/plan/example-8b.yaml", "foo=1"), "unknown override keys ['foo']"),
])
def test_bad_planner_input_exits_2_naming_the_value_and_writes_nothing(tmp_path, args, said):
    done = _cli(*args, f"out={tmp_path / 'plan.yaml'}") if args[0] != "--check" else _cli(*args)
    assert done.returncode == 2 and said in done.stdout.replace("\n", " "), done.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_binary_plan_file_is_refused_by_name(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"\xff\xfe\x00model: glm-10b\n")
    done = _cli("--check", f"plan={path}")
    assert done.returncode == 2 and "is not UTF-8 text" in done.stdout, done.stdout


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_check_overrides_a_preset_model_s_field(tmp_path):
    """`model.vocab=...` beside a plan naming a preset plans the changed preset (it was a TypeError)."""
    done = _cli("--check", "plan=conf/plan/example-8b.yaml", "model.vocab=50000")
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
    assert "model.vocab=50000" in done.stdout.replace("\n", " ")


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_no_layout_for_the_batch_says_why():
    done = _cli("cluster.nodes=100000", "top=1")
    assert done.returncode == 1
    assert "global_batch=64 prompts a step at micro-batch 1 over 800000 GPUs" in done.stdout.replace("\n", " ")
