"""`bench.report DIR --target KEYS`: the decision tree's branch for the user's model and GPUs, predicted per
framework by `bench.plan framework=X`, and what every leaf rests on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import decision, target
from bench.report.decision import Leaf

REPO = Path(__file__).resolve().parents[1]
KEYS = "model=glm-10b cluster.gpus_per_node=8 cluster.gpu=A100-80GB"


def _leaves(node) -> list[tuple[tuple[str, ...], Leaf]]:
    return decision.questions(node)


def test_the_target_branch_predicts_every_framework_and_names_no_winner() -> None:
    planned = target.plan_target(KEYS)
    answer, node = target.branch(planned, "the planner agrees with N of M published GPU facts")
    assert answer.startswith("glm-10b (predicted at 1 x 8 A100-80GB")
    [(path, leaf)] = _leaves(node)
    assert path == ("8 (1 x 8 A100-80GB, predicted)", "bf16", "full fine-tuning")
    assert not leaf.decided and "no winner is named" in leaf.verdict
    for framework in ("dschat", "colossalai", "trlx", "trl", "torch"):
        assert any(line.startswith(f"{framework}: predicted ") for line in leaf.evidence), framework
    # the leaf's ranking is the planner's: each fitting framework's best plan, fastest estimate first
    fitting = sorted((r[0].best.step_seconds, f) for f, r in planned.results.items() if r[0].best)
    assert leaf.verdict.index(fitting[0][1]) < leaf.verdict.index(fitting[-1][1])
    assert leaf.evidence[-1].startswith("rests on: predicted, not measured") and "N of M" in leaf.evidence[-1]


def test_measured_leaves_say_what_they_rest_on() -> None:
    rows = [{"framework": "dschat", "stage": "ppo", "model": "tiny", "nproc": 2, "precision": "bf16", "lora": 0,
             "status": "ok", "host_type": "zen4", "git_commit": "abcdef0123456", "peak_bytes": 1.0,
             "stability": "stable", "device": "cpu"}]
    tree = decision.build(rows)
    found = [leaf for _, leaf in decision.questions(tree) if leaf.evidence and "rests on" in leaf.evidence[-1]]
    assert found and found[0].evidence[-1] == "rests on: measured: 1 run(s) on zen4, commit(s) abcdef0123"


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
@pytest.mark.parametrize("keys, said", [
    ("model=glm-10b framework=dschat", "give the model, cluster.* and workload.* keys only"),
    ("model=glm-base", "exceeds the model's 512 positions"),
    ("cluster.gpu=B9000", "cluster.gpu='B9000' is not known"),
])
def test_a_bad_target_exits_2_naming_it(keys, said, tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.report", str(tmp_path), "--target", keys, "--out",
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and said in " ".join(done.stderr.split()), done.stderr
    assert not (tmp_path / "out").exists()
