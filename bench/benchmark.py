"""Runs the stages of one benchmark, each in its own process tree, and keeps the record current.

`stage=pipeline` runs SFT -> RM -> PPO as DeepSpeed-Chat's steps 1-3 do: separate launches, the SFT
checkpoint initialising actor and reference, the RM checkpoint critic and reward. The record is
rewritten after every stage, so a failing stage never loses the stages before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from bench.launcher import launch_stage
from bench.record import ResultRecord, StageRecord, stage_record, utc_now, write_json
from bench.spec import LauncherSpec, RunSpec

log = logging.getLogger(__name__)
RECORD_FILE = "record.json"


def _prerequisite_rm_spec(spec: RunSpec) -> RunSpec:
    """DS-Chat's step 3 needs a step-2 reward model. When none is given, one is trained with fixed,
    cheap settings so that every PPO configuration of a sweep scores against the same RM."""
    return spec.replace(
        stage="rm", precision="fp32", zero=0, lora=0, offload=False, grad_ckpt=False, lr=None,
        plugin="auto", tp=1, pp=1,
        launcher=LauncherSpec(nproc=1, threads_per_rank=spec.launcher.threads_per_rank,
                              timeout_s=spec.launcher.timeout_s, device=spec.launcher.device),
    )


def _cache_key(spec: RunSpec) -> str:
    fields = {k: v for k, v in spec.to_dict().items()
              if k in ("framework", "framework_options", "model", "batch", "prompt_len", "answer_len", "seed")}
    fields["rm_steps"] = spec.steps["rm"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def prerequisite_rm(spec: RunSpec, cache_dir: str, echo: bool) -> dict[str, Any]:
    rm_spec = _prerequisite_rm_spec(spec)
    directory = os.path.join(cache_dir, f"{spec.framework}-rm-{_cache_key(rm_spec)}")
    summary_path = os.path.join(directory, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return dict(json.load(f), cached=True)
    log.info("stage=ppo without init.rm: training the prerequisite reward model in %s", directory)
    outcome = launch_stage(rm_spec, "rm", directory, {}, echo=echo)
    result = stage_record("rm", outcome.ranks, rm_spec.warmup_steps, outcome.wall_time_s, outcome.failure)
    summary = {
        "status": result.status,
        "checkpoint": result.checkpoint,
        "steps": rm_spec.steps["rm"],
        "settings": "fp32, zero=0, lora=0, 1 rank",
        "accuracy_end": result.learning.get("accuracy_end"),
        "error": result.error,
    }
    if result.status == "ok":
        write_json(summary_path, summary)
    return dict(summary, cached=False)


def run_benchmark(spec: RunSpec, run_dir: str, config: dict[str, Any], cache_dir: str,
                  echo: bool = True) -> ResultRecord:
    run_dir, cache_dir = os.path.abspath(run_dir), os.path.abspath(cache_dir)
    os.makedirs(run_dir, exist_ok=True)
    record = ResultRecord(run_id=os.path.basename(os.path.normpath(run_dir)), config=config)
    record_path = os.path.join(run_dir, RECORD_FILE)
    init = {k: v for k, v in (("sft", spec.init.sft), ("rm", spec.init.rm)) if v}
    for stage in spec.stages:
        if stage == "ppo" and "rm" not in init:
            prerequisite = prerequisite_rm(spec, cache_dir, echo)
            record.prerequisites["rm"] = prerequisite
            if prerequisite["status"] != "ok":
                record.stages["ppo"] = StageRecord(status="error", error={
                    "message": f"prerequisite reward model failed: {prerequisite['error']}", "phase": "prerequisite"})
                break
            init["rm"] = prerequisite["checkpoint"]
        log.info("stage %s: %d rank(s), %s", stage, spec.launcher.nproc, json.dumps(init))
        outcome = launch_stage(spec, stage, os.path.join(run_dir, stage), init, echo=echo)
        result = stage_record(stage, outcome.ranks, spec.warmup_steps, outcome.wall_time_s, outcome.failure)
        record.stages[stage] = result
        environment = next((r["environment"] for r in outcome.ranks if "environment" in r), None)
        if environment and not record.environment:
            record.environment = environment
        record.write(record_path)
        if result.status != "ok":
            break
        if result.checkpoint:
            init[stage] = result.checkpoint
    for stage in spec.stages:
        if stage not in record.stages:
            record.stages[stage] = StageRecord(status="skipped", error={"message": "an earlier stage failed",
                                                                        "phase": None})
    failed = next((s for s in record.stages.values() if s.status not in ("ok", "skipped")), None)
    if failed is not None:
        record.status, record.error = failed.status, failed.error
    record.finished_utc = utc_now()
    record.write(record_path)
    return record
