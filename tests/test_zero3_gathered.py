"""What a DeepSpeed ZeRO-3 engine keeps gathered through a traced step (adapters/deepspeed_memory.py
zero3_kept_gathered): the memory models' figure against element counts worked by hand, and those against the
engine's own parameter states (`ds_status`) read by scripts/diagnostics/peak_moment.py in real DS-Chat and trlx runs."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import pytest

from adapters.deepspeed_memory import REUSE_DISTANCE_ELEMENTS, zero3_kept_gathered
from adapters.dschat import memory as dschat
from adapters.trlx import memory as trlx
from bench.plan.run_shape import RunShape
from bench.run.config import compose
from bench.run.spec import spec_from_config
from tests.processes import run_tree

REPO = Path(__file__).resolve().parents[1]
# tiny-llama (hidden 128, 4 layers, 2 K/V heads of 32, vocabulary 256) with an MLP of 800 so that its three MLP
# matrices (128 x 800 = 102,400 elements) pass DeepSpeed's default persistence threshold (1e5) as well as
# DS-Chat's (1e4); q and o (16,384) pass DS-Chat's only; k and v (128 x 64 = 8,192), the norms (128), the
# embedding and the untied head (256 x 128 = 32,768) pass neither's but the embedding's and head's pass DS-Chat's
MODEL = ["model=tiny-llama", "model.intermediate=800", "precision=bf16", "zero=3"]
# The engine runs are in fp32 (4 bytes an element): how long a bf16 step takes depends on the host's native bf16
# support, and what is gathered does not depend on the width beyond its bytes
ENGINE_RUN = [*MODEL, "precision=fp32", "launcher.stall_s=240"]
FP32 = 4
# elements gathered whole, worked from those sizes: DS-Chat a block 2 x 16,384 + 3 x 102,400 = 339,968
DSCHAT_LM = 4 * 339_968 + 2 * 32_768  # 1,425,408: blocks, embedding, head
DSCHAT_REWARD = 4 * 339_968 + 32_768  # 1,392,640: no LM head; the value head (128) stays whole
TRLX_MODEL = 4 * 3 * 102_400  # 1,228,800: the MLP matrices only, in the LM and in the reward model alike


def jit_libraries() -> dict[str, float]:
    """Every JIT-built library in the project's folder and in torch's per-user default, with its mtime."""
    from torch.utils.cpp_extension import get_default_build_root

    roots = {os.environ.get("TORCH_EXTENSIONS_DIR", ""), get_default_build_root()} - {""}
    return {path: os.stat(path).st_mtime for root in roots for path in glob.glob(f"{glob.escape(root)}/**/*.so",
                                                                                  recursive=True)}


def shape(framework: str, stage: str, *overrides: str) -> RunShape:
    spec = spec_from_config(compose([f"framework={framework}", f"stage={stage}", *MODEL, *overrides]))
    return RunShape.from_spec(spec, stage)


def test_tensor_counts_of_tiny_llama_by_hand():
    arch = shape("dschat", "sft", "model.intermediate=352").arch
    block = [128 * 128, 128 * 64, 128 * 64, 128 * 128, 128 * 352, 128 * 352, 352 * 128, 128, 128]
    assert arch.tensor_numels() == [256 * 128, *block * 4, 128, 256 * 128]
    assert arch.tensor_numels(lm_head=False) == [256 * 128, *block * 4, 128]
    # LoRA r=8 on all seven maps: A r x d_in and B d_out x r; a block 2 x 2,048 (q, o) + 2 x 1,536 (k, v) +
    # 3 x 3,840 (gate, up, down) = 18,688
    assert sum(arch.lora_numels(8)) == 4 * 18_688
    assert arch.lora_numels(0) == []


def test_kept_gathered_leaves_persistent_tensors_out_and_stops_at_the_reuse_distance():
    # a tensor at the threshold is persistent (DeepSpeed: ds_numel <= stage3_param_persistence_threshold)
    assert zero3_kept_gathered([10_000, 10_001, 50], 2, 10_000) == 2 * 10_001
    # a model larger than stage3_max_reuse_distance: the backward reuses only that much of it in reach
    assert zero3_kept_gathered([600_000_000] * 3, 2, 100_000) == 2 * REUSE_DISTANCE_ELEMENTS


def test_memory_models_keep_the_traced_models_gathered_at_zero3_only():
    assert dschat.kept_gathered(shape("dschat", "sft"), "actor").buffers == 2 * DSCHAT_LM
    assert dschat.kept_gathered(shape("dschat", "rm"), "reward").buffers == 2 * DSCHAT_REWARD
    assert trlx.kept_gathered(shape("trlx", "sft")).buffers == 2 * TRLX_MODEL
    assert trlx.kept_gathered(shape("trlx", "rm")).buffers == 2 * TRLX_MODEL
    assert dschat.kept_gathered(shape("dschat", "sft", "zero=2"), "actor").buffers == 0
    # DS-Chat's RM scoring keeps what its training step gathered, beside ZeRO-3's reduce bucket (on the host the
    # pages of one bf16 value per trained parameter: a block 356,608 with its norms, 4 blocks + embedding +
    # final norm + value head = 1,459,456); trlx's releases each module after use
    # in fp32, what the engine runs below hold: 4 bytes an element
    assert dschat.kept_gathered(shape("dschat", "sft", "precision=fp32"), "actor").buffers == FP32 * DSCHAT_LM
    assert dschat.kept_gathered(shape("dschat", "rm", "precision=fp32"), "reward").buffers == FP32 * DSCHAT_REWARD
    assert trlx.kept_gathered(shape("trlx", "rm", "precision=fp32")).buffers == FP32 * TRLX_MODEL
    at3, at2 = (dschat.predict(shape("dschat", "rm", f"zero={z}"))["evaluation"] for z in (3, 2))
    assert at3.buffers - at2.buffers == 2 * DSCHAT_REWARD + 2 * 1_459_456
    rm3 = trlx.predict(shape("trlx", "rm"))
    assert rm3["training"].buffers - rm3["evaluation"].buffers == 2 * TRLX_MODEL
    # GLM-10B's 9.9 G elements: 1e9 of them in reach of the backward, 2 GB in bf16
    big = RunShape.from_spec(spec_from_config(compose(["framework=dschat", "stage=sft", "model=glm-10b",
                                                       "precision=bf16", "zero=3"])), "sft")
    assert dschat.kept_gathered(big, "actor").buffers == 2e9


@pytest.mark.engine
@pytest.mark.parametrize("framework, stage, phases", [
    ("dschat", "sft", {"training": FP32 * DSCHAT_LM}),
    ("dschat", "rm", {"training": FP32 * DSCHAT_REWARD, "evaluation": FP32 * DSCHAT_REWARD}),
    ("trlx", "sft", {"training": FP32 * TRLX_MODEL}),
    ("trlx", "rm", {"training": FP32 * TRLX_MODEL}),
])
def test_engines_keep_gathered_what_the_memory_model_says(tmp_path, framework, stage, phases):
    out = tmp_path / "peaks.json"
    built = jit_libraries()
    # the ranks' watchdog (launcher.stall_s above) reports a stall before the test's timeout would
    run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
              "scripts/diagnostics/peak_moment.py", f"framework={framework}", f"stage={stage}", *ENGINE_RUN,
              f"--json={out}"],
             timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peaks = json.loads(out.read_text())
    # the script under torchrun found the ops set-up built, in the launcher's folder: none was rebuilt, and none
    # was built in torch's per-user default (the CI failure: FusedAdam built again there, killed, its lock left)
    after = jit_libraries()
    assert {path: after.get(path) for path in built} == built
    from torch.utils.cpp_extension import get_default_build_root

    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    assert not [path for path in set(after) - set(built) if not path.startswith(folder + os.sep)]
    assert {phase: peaks[phase]["most_gathered"] for phase in phases} == phases
    if (framework, stage) == ("trlx", "rm"):
        # trlx's scoring runs outside the traced step: one module at a time, here one MLP matrix (no prefetch
        # of more on one rank), where its training step held the whole reward model
        assert peaks["evaluation"]["most_gathered"] == FP32 * 102_400
