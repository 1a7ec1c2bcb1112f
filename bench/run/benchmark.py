"""Runs the stages of one benchmark, each in its own process tree, and keeps the record current.

`stage=pipeline` runs SFT -> RM -> PPO as DeepSpeed-Chat's steps 1-3 do: separate launches, the SFT
checkpoint initialising actor and reference, the RM checkpoint critic and reward. The record is
rewritten after every stage, so a failing stage never loses the stages before it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
from typing import Any

from rich.console import Console

from bench.measure.trend import soak_trends
from bench.results.record import ResultRecord, StageRecord, batch_shape, stage_record, utc_now, write_json
from bench.run.launcher import launch_stage, remove_torn_writes
from bench.run.spec import (
    CheckpointSpec,
    CommSpec,
    DebugSpec,
    FrozenRoleSpec,
    InitSpec,
    LauncherSpec,
    RewardSpec,
    RunSpec,
)
from bench.run.sweep import read_record

log = logging.getLogger(__name__)
RECORD_FILE = "record.json"
# A run over several nodes: node 0 writes the record (every rank's results are gathered there); node k > 0 keeps
# its own view of the run, under node<k>/ of the run directory, as node.json (no report or sweep takes it for a run)
NODE_RECORD_FILE = "node.json"


def node_run_dir(run_dir: str, node: int) -> str:
    """Where node `node` keeps its stage directories: the run directory on node 0, node<k>/ inside it elsewhere
    (a shared filesystem gives every node the same run directory)."""
    return run_dir if node == 0 else os.path.join(run_dir, f"node{node}")


def record_path(run_dir: str, node: int) -> str:
    return os.path.join(node_run_dir(run_dir, node), RECORD_FILE if node == 0 else NODE_RECORD_FILE)


PREREQUISITE_SETTINGS = "fp32, zero=0, lora=0, 1 rank"


def _prerequisite_spec(spec: RunSpec, stage: str) -> RunSpec:
    """DS-Chat's step 3 starts from a step-1 SFT model and scores with a step-2 reward model. When none is
    given, each is trained with fixed, cheap settings (PREREQUISITE_SETTINGS) so that every PPO configuration
    of a sweep starts from the same models."""
    return spec.replace(
        stage=stage, precision="fp32", zero=0, lora=0, lora_targets=None, lora_alpha=None, grad_accum=1,
        global_batch=None, offload=False,
        grad_ckpt=False, grad_clip=None, lr=None, plugin="auto", tp=1, pp=1, soak=False, debug=DebugSpec(),
        checkpoint=CheckpointSpec(), resume=False, init=InitSpec(),
        reference=FrozenRoleSpec(), reward=RewardSpec(), ds=CommSpec(),
        launcher=LauncherSpec(nproc=1, threads_per_rank=spec.launcher.threads_per_rank,
                              timeout_s=spec.launcher.timeout_s, stall_s=spec.launcher.stall_s,
                              device=spec.launcher.device),
    )


def prerequisite_cache_key(spec: RunSpec, stage: str) -> str:
    """What a prerequisite model depends on, and nothing else: the framework's options less those only PPO
    (or LoRA, offload, fp16, which it never uses) reads, the model less the other stages' learning rates, the
    data shape, the seed and the stage's steps. PPO cells that differ elsewhere share one model."""
    from adapters import registry

    ignored = registry.options_class(spec.framework).prerequisite_ignores
    model = dict(spec.to_dict()["model"], lr={stage: spec.model.lr[stage]})
    fields = {
        "framework": spec.framework,
        "framework_options": {k: v for k, v in spec.framework_options.items() if k not in ignored},
        "model": model, "batch": spec.batch, "prompt_len": spec.prompt_len, "answer_len": spec.answer_len,
        "seed": spec.seed, f"{stage}_steps": spec.steps[stage],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_summary(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def prerequisite(spec: RunSpec, stage: str, cache_dir: str, console: Console | None = None) -> dict[str, Any]:
    """The cached prerequisite model of `stage` (sft or rm), trained once. A lock per cache entry keeps
    parallel sweep cells (submitit, several shells) from training it twice in one directory and deleting
    each other's files."""
    pre_spec = _prerequisite_spec(spec, stage)
    directory = os.path.join(cache_dir, f"{spec.framework}-{stage}-{prerequisite_cache_key(pre_spec, stage)}")
    summary_path = os.path.join(directory, "summary.json")
    os.makedirs(cache_dir, exist_ok=True)
    with open(directory + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        summary = _read_summary(summary_path)
        if summary is not None:
            if console is not None:
                console.print(f"[dim]{PREREQUISITE_NAMES[stage]}: cached, {summary['checkpoint']}[/dim]",
                              soft_wrap=True)
            return dict(summary, cached=True)
        return _train_prerequisite(pre_spec, stage, directory, summary_path, console)


PREREQUISITE_NAMES = {"sft": "prerequisite SFT model (actor and reference)",
                      "rm": "prerequisite reward model (critic and reward)"}


def _train_prerequisite(pre_spec: RunSpec, stage: str, directory: str, summary_path: str,
                        console: Console | None) -> dict[str, Any]:
    log.info("stage=ppo: training the %s in %s", PREREQUISITE_NAMES[stage], directory)
    if console is not None:
        console.print(f"{PREREQUISITE_NAMES[stage]}: trained once ({PREREQUISITE_SETTINGS}, "
                      f"{pre_spec.steps[stage]} steps), then reused from {directory}", soft_wrap=True)
    outcome = launch_stage(pre_spec, stage, directory, {}, console, label=f"{stage} (prerequisite)")
    result = stage_record(stage, outcome.ranks, pre_spec.warmup_steps, outcome.wall_time_s, outcome.failure)
    summary = {
        "status": result.status,
        "checkpoint": result.checkpoint,
        "steps": pre_spec.steps[stage],
        "settings": PREREQUISITE_SETTINGS,
        "error": result.error,
    }
    if stage == "rm":
        summary.update(accuracy_end=result.learning.get("accuracy_end"),
                       heldout_scores=result.learning.get("heldout_scores"))  # what reward.normalize=zscore applies
    else:
        curve = result.learning.get("loss_curve") or [None]
        summary.update(loss_start=curve[0], loss_end=curve[-1])
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


def _ppo_prerequisites(spec: RunSpec, init: dict[str, str], record: ResultRecord, cache_dir: str,
                       console: Console | None) -> str | None:
    """Finds (or trains) the models PPO needs and was not given, into `init` and the record's prerequisites;
    returns the stage whose prerequisite failed, if one did."""
    for need in ("sft", "rm"):
        if need in init or (need == "sft" and not spec.init.sft_prerequisite):
            continue
        made = prerequisite(spec, need, cache_dir, console)
        record.prerequisites[need] = made
        if made["status"] != "ok":
            return need
        init[need] = made["checkpoint"]
    return None


def run_benchmark(spec: RunSpec, run_dir: str, config: dict[str, Any], cache_dir: str,
                  console: Console | None = None, preflight: dict[str, Any] | None = None) -> ResultRecord:
    """`console`: where each stage's progress line and the prerequisites' banners go (None: nowhere; every
    rank's output is in its stage's worker.log either way)."""
    from adapters import registry

    run_id = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    path = os.path.abspath(record_path(run_dir, spec.launcher.node))
    run_dir, cache_dir = os.path.dirname(path), os.path.abspath(cache_dir)
    os.makedirs(run_dir, exist_ok=True)
    remove_torn_writes(run_dir)
    model = {k: v for k, v in dataclasses.asdict(spec.model).items() if k != "lr"}
    record = ResultRecord(run_id=run_id, config=config, model=model,
                          harness_extension=registry.options_class(spec.framework).harness_extensions(spec),
                          preflight=preflight, batch=batch_shape(spec.batch, spec.grad_accum, spec.data_parallel))
    init = {k: v for k, v in (("sft", spec.init.sft), ("rm", spec.init.rm)) if v}
    # resume=true: stages the interrupted run finished are kept as they were; the first unfinished one
    # continues from its last complete checkpoint (the worker finds it)
    previous = read_record(path) if spec.resume else None
    kept = {name: StageRecord(**stage) for name, stage in ((previous or {}).get("stages") or {}).items()
            if stage.get("status") == "ok" and stage.get("checkpoint")}
    for stage in spec.stages:
        if stage in kept:
            record.stages[stage] = kept[stage]
            init[stage] = kept[stage].checkpoint
            log.info("stage %s: kept from the interrupted run (resume=true)", stage)
            continue
        failed = _ppo_prerequisites(spec, init, record, cache_dir, console) if stage == "ppo" else None
        if failed is not None:
            record.stages["ppo"] = StageRecord(status="error", error={
                "message": f"{PREREQUISITE_NAMES[failed]} failed: "
                           f"{(record.prerequisites[failed]['error'] or {}).get('message')}",
                "phase": "prerequisite"})
            break
        log.info("stage %s: %d rank(s), %s", stage, spec.launcher.nproc, json.dumps(init))
        outcome = launch_stage(spec, stage, os.path.join(run_dir, stage), init, console)
        result = stage_record(stage, outcome.ranks, spec.warmup_steps, outcome.wall_time_s, outcome.failure)
        record.stages[stage] = result
        environment = next((r["environment"] for r in outcome.ranks if "environment" in r), None)
        if environment and not record.environment:
            record.environment = dict(environment)  # a copy: node 0's entry below holds the rank's own
            if spec.launcher.nnodes > 1:  # where the agents met, and each node's host as its local rank 0 read it
                launcher = spec.launcher
                record.environment["rendezvous"] = {
                    "backend": "c10d", "endpoint": launcher.rdzv_endpoint, "id": launcher.rdzv_id,
                    "nnodes": launcher.nnodes, "nproc_per_node": launcher.nproc, "written_by_node": launcher.node}
                record.environment["nodes"] = sorted((
                    {"node": r["place"]["node"], "hostname": r["place"]["host"], "environment": r["environment"]}
                    for r in outcome.ranks if "environment" in r and r.get("place")), key=lambda n: n["node"])
        if result.memory.get("phases"):
            _add_prediction(spec, stage, result, record.environment.get("device", "cpu"))
        if spec.soak and result.memory.get("timeline"):
            budget, source = soak_budget(spec, record.environment)
            result.memory["trend"] = soak_trends(result.memory["timeline"], result.steps, spec.warmup_steps,
                                                 spec.steps[stage], budget, source)
        record.write(path)
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
    if config.get("plan_file"):  # plan=FILE: the plan, and what it predicted beside what ran
        from bench.run.plan_record import plan_entry

        record.plan = plan_entry(config["plan_file"], spec.framework, record)
    record.finished_utc = utc_now()
    record.write(path)
    return record
