"""Runs the stages of one benchmark, each in its own process tree, and keeps the record current.

`stage=pipeline` runs SFT -> RM -> PPO as DeepSpeed-Chat's steps 1-3 do: separate launches, the SFT
checkpoint initialising actor and reference, the RM checkpoint critic and reward. The record is
rewritten after every stage, so a failing stage never loses the stages before it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from typing import Any

from bench.measure.trend import soak_trends
from bench.results.record import ResultRecord, StageRecord, batch_shape, stage_record, utc_now, write_json
from bench.run.launcher import launch_stage, remove_torn_writes
from bench.run.spec import (
    CheckpointSpec,
    CommSpec,
    DebugSpec,
    FrozenRoleSpec,
    LauncherSpec,
    RewardSpec,
    RunSpec,
)
from bench.run.sweep import read_record

log = logging.getLogger(__name__)
RECORD_FILE = "record.json"


def _prerequisite_rm_spec(spec: RunSpec) -> RunSpec:
    """DS-Chat's step 3 needs a step-2 reward model. When none is given, one is trained with fixed,
    cheap settings so that every PPO configuration of a sweep scores against the same RM."""
    return spec.replace(
        stage="rm", precision="fp32", zero=0, lora=0, lora_targets=None, lora_alpha=None, grad_accum=1,
        global_batch=None, offload=False,
        grad_ckpt=False, grad_clip=None, lr=None, plugin="auto", tp=1, pp=1, soak=False, debug=DebugSpec(),
        checkpoint=CheckpointSpec(), resume=False,
        reference=FrozenRoleSpec(), reward=RewardSpec(), ds=CommSpec(),
        launcher=LauncherSpec(nproc=1, threads_per_rank=spec.launcher.threads_per_rank,
                              timeout_s=spec.launcher.timeout_s, device=spec.launcher.device),
    )


def rm_cache_key(spec: RunSpec) -> str:
    """What the prerequisite reward model depends on, and nothing else: the framework's options less those
    only PPO (or LoRA, offload, fp16, which it never uses) reads, the model less the other stages' learning
    rates, the data shape, the seed and the RM's steps. PPO cells that differ elsewhere share one RM."""
    from adapters import registry

    ignored = registry.options_class(spec.framework).prerequisite_rm_ignores
    model = dict(spec.to_dict()["model"], lr={"rm": spec.model.lr["rm"]})
    fields = {
        "framework": spec.framework,
        "framework_options": {k: v for k, v in spec.framework_options.items() if k not in ignored},
        "model": model, "batch": spec.batch, "prompt_len": spec.prompt_len, "answer_len": spec.answer_len,
        "seed": spec.seed, "rm_steps": spec.steps["rm"],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_summary(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def prerequisite_rm(spec: RunSpec, cache_dir: str, echo: bool) -> dict[str, Any]:
    """The cached prerequisite RM, trained once. A lock per cache entry keeps parallel sweep cells (submitit,
    several shells) from training it twice in one directory and deleting each other's files."""
    rm_spec = _prerequisite_rm_spec(spec)
    directory = os.path.join(cache_dir, f"{spec.framework}-rm-{rm_cache_key(rm_spec)}")
    summary_path = os.path.join(directory, "summary.json")
    os.makedirs(cache_dir, exist_ok=True)
    with open(directory + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        summary = _read_summary(summary_path)
        if summary is not None:
            return dict(summary, cached=True)
        return _train_prerequisite_rm(rm_spec, directory, summary_path, echo)


def _train_prerequisite_rm(rm_spec: RunSpec, directory: str, summary_path: str, echo: bool) -> dict[str, Any]:
    log.info("stage=ppo without init.rm: training the prerequisite reward model in %s", directory)
    outcome = launch_stage(rm_spec, "rm", directory, {}, echo=echo)
    result = stage_record("rm", outcome.ranks, rm_spec.warmup_steps, outcome.wall_time_s, outcome.failure)
    summary = {
        "status": result.status,
        "checkpoint": result.checkpoint,
        "steps": rm_spec.steps["rm"],
        "settings": "fp32, zero=0, lora=0, 1 rank",
        "accuracy_end": result.learning.get("accuracy_end"),
        "heldout_scores": result.learning.get("heldout_scores"),  # what reward.normalize=zscore applies
        "error": result.error,
    }
    if result.status == "ok":
        write_json(summary_path, summary)
    return dict(summary, cached=False)


def soak_budget(spec: RunSpec, environment: dict[str, Any]) -> tuple[float | None, str]:
    """The per-rank memory a soak run's growth is projected against, and where the figure comes from."""
    if spec.memory_budget_gb is not None:
        return spec.memory_budget_gb * 2**30, f"memory_budget_gb={spec.memory_budget_gb:g} per rank"
    gpu = environment.get("gpu")
    if gpu:
        return float(gpu["memory_bytes"]), f"{gpu['name']} memory (per GPU)"
    host = environment.get("host_memory_bytes")
    if host:
        return host / spec.launcher.nproc, f"host RAM / {spec.launcher.nproc} rank(s) sharing it"
    return None, "unknown: no budget given and the device's memory was not recorded"


def _add_prediction(spec: RunSpec, stage: str, result: StageRecord, device: str) -> None:
    """The memory model's prediction beside the measurement. A fault in the model is logged and recorded,
    never allowed to cost the measured record."""
    from bench.plan.predict import record_entry

    try:
        entry = record_entry(spec, stage, device, result.memory)
    except Exception as err:  # noqa: BLE001 - the measurement matters more than the prediction
        log.warning("stage %s: the memory model failed: %r", stage, err)
        entry = {"error": repr(err)}
    if entry is not None:
        result.memory["prediction"] = entry


def run_benchmark(spec: RunSpec, run_dir: str, config: dict[str, Any], cache_dir: str,
                  echo: bool = True, preflight: dict[str, Any] | None = None) -> ResultRecord:
    from adapters import registry

    run_dir, cache_dir = os.path.abspath(run_dir), os.path.abspath(cache_dir)
    os.makedirs(run_dir, exist_ok=True)
    remove_torn_writes(run_dir)
    record = ResultRecord(run_id=os.path.basename(os.path.normpath(run_dir)), config=config,
                          harness_extension=registry.options_class(spec.framework).harness_extensions(spec),
                          preflight=preflight, batch=batch_shape(spec.batch, spec.grad_accum, spec.data_parallel))
    record_path = os.path.join(run_dir, RECORD_FILE)
    init = {k: v for k, v in (("sft", spec.init.sft), ("rm", spec.init.rm)) if v}
    # resume=true: stages the interrupted run finished are kept as they were; the first unfinished one
    # continues from its last complete checkpoint (the worker finds it)
    previous = read_record(record_path) if spec.resume else None
    kept = {name: StageRecord(**stage) for name, stage in ((previous or {}).get("stages") or {}).items()
            if stage.get("status") == "ok" and stage.get("checkpoint")}
    for stage in spec.stages:
        if stage in kept:
            record.stages[stage] = kept[stage]
            init[stage] = kept[stage].checkpoint
            log.info("stage %s: kept from the interrupted run (resume=true)", stage)
            continue
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
        if result.memory.get("phases"):
            _add_prediction(spec, stage, result, record.environment.get("device", "cpu"))
        if spec.soak and result.memory.get("timeline"):
            budget, source = soak_budget(spec, record.environment)
            result.memory["trend"] = soak_trends(result.memory["timeline"], result.steps, spec.warmup_steps,
                                                 spec.steps[stage], budget, source)
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
