"""A TRL stage run as TRL runs it, with no harness seam: `python -m torch.distributed.run --nproc-per-node N -m
adapters.hf_trl.plain SPEC_JSON STAGE OUT_JSON [--init-sft F] [--init-rm F]`.

The same trainer the adapter builds (TrlAdapter.build_trainer), its train() called directly, every step's log
kept: what the harness's run must reproduce exactly (tests/test_trl.py: the seams change no result). It has the
harness's rank watchdog (bench.run.watchdog): a run that stalls for launcher.stall_s ends with every thread's
stack in `stall-rank<N>.txt` beside OUT_JSON, and a run whose torchrun dies does not outlive it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import TrainerCallback

from adapters.base import RankContext
from adapters.hf_trl.adapter import TrlAdapter
from bench.run.spec import RunSpec
from bench.run.watchdog import RankWatchdog, stall_path
from bench.run.worker import resolve_device


class StepLogs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and ("loss" in logs or "loss/policy_avg" in logs):
            self.logs.append(dict(logs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec")
    parser.add_argument("stage")
    parser.add_argument("out")
    parser.add_argument("--init-sft")
    parser.add_argument("--init-rm")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = RunSpec.from_dict(json.load(f))
    torch.set_num_threads(spec.launcher.threads_per_rank)
    rank = int(os.environ.get("RANK", 0))
    watchdog = RankWatchdog(stall_path(os.path.dirname(os.path.abspath(args.out)), rank), rank, spec.launcher.stall_s)
    watchdog.watch_parent()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ctx = RankContext(rank=rank, world_size=int(os.environ.get("WORLD_SIZE", 1)), local_rank=local_rank,
                      device=resolve_device(spec.launcher.device, local_rank))
    adapter = TrlAdapter(spec, ctx)
    trainer = adapter.build_trainer(args.stage, {k: v for k, v in (("sft", args.init_sft), ("rm", args.init_rm)) if v})
    logs = StepLogs()
    trainer.add_callback(logs)
    watchdog.beat("train() began")
    trainer.train()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(logs.logs, f)
    watchdog.beat("the close began")
    adapter.close()


if __name__ == "__main__":
    main()
