"""The step loop's collective decisions, on two real gloo ranks with a stand-in adapter.

The adapter here is no engine: it only hands the loop a loss, finite on rank 0 and non-finite on rank 1,
which no real engine can be made to produce on one rank alone on demand. What is tested is the loop's
own control flow: both ranks must stop at the same step and agree that the stage diverged.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapters.base import Adapter, TrainOutput
from bench.measure.params import ParamCounts
from bench.measure.phases import PhaseTracker
from bench.run.config import compose
from bench.run.data import SyntheticData
from bench.run.loop import StageLoop
from bench.run.spec import spec_from_config

pytestmark = pytest.mark.engine


class NanOnRankOne(Adapter):
    def setup(self, stage, init):
        pass

    def sft_step(self, batch):
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.input_ids.shape[0])
        out.record("actor", float("nan") if self.ctx.rank == 1 else 1.0, 1.0, False, None)
        return out

    def params(self):
        return {"actor": ParamCounts(total=10, trainable=10, compute=10, compute_trainable=10)}

    def model_state(self):
        return {}

    def close(self):
        pass

    rm_step = rm_scores = generate = make_experience = ppo_train = save = None


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    spec = spec_from_config(compose(["stage=sft", "steps=20", "stability.stop_after_nonfinite=3"]))
    from adapters.base import RankContext

    adapter = NanOnRankOne(spec, RankContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu")))
    data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed, rank)
    result = StageLoop(adapter, spec, PhaseTracker(torch.device("cpu")), data).run("sft", {})
    results[rank] = (len(result["steps"]), result["diverged_any_rank"], result["stability"]["classification"])
    dist.destroy_process_group()


def test_a_rank_that_alone_sees_non_finite_losses_stops_every_rank_at_the_same_step():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, results), nprocs=2, join=True)
    assert results[0][:2] == results[1][:2] == (3, True), dict(results)
    assert (results[0][2], results[1][2]) == ("stable", "diverged")
