"""Hand-made records for the report's rules: small, complete enough for the collector, every number chosen."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from bench.results.record import SCHEMA_VERSION

MIB = 1024 * 1024
BASE_CONFIG: dict[str, Any] = {
    "framework": {"name": "dschat", "optimizer": "fused_adam"},
    "stage": {"name": "ppo", "stages": ["ppo"]},
    "model": {"name": "glm-base", "hidden": 768, "layers": 12},
    "precision": "bf16", "zero": 2, "lora": 0, "batch": 2, "prompt_len": 128, "answer_len": 128, "steps": 6,
    "warmup_steps": 1, "lr": None, "seed": 1, "grad_ckpt": False, "offload": False, "plugin": "auto", "tp": 1,
    "pp": 1, "wandb": "off", "tags": [], "init": {"sft": None, "rm": None},
    "launcher": {"nproc": 2, "threads_per_rank": 1, "timeout_s": 1800, "device": "auto"},
    "output_root": "results", "force": False, "sweep_name": "s", "run_name": "r",
}


OPTIMIZERS = {"dschat": "fused_adam", "colossalai": "hybrid_adam", "trlx": "adamw", "torch": "adamw"}


def config(**changes: Any) -> dict[str, Any]:
    """BASE_CONFIG with dotted-key changes, e.g. config(**{"framework.name": "trlx", "lr": 1e-3})."""
    out = copy.deepcopy(BASE_CONFIG)
    if "framework.name" in changes:  # each framework's own options (trlx's reference mode is resolved from them)
        out["framework"] = {"name": changes["framework.name"], "optimizer": OPTIMIZERS[changes["framework.name"]]}
    for dotted, value in changes.items():
        node = out
        *path, last = dotted.split(".")
        for key in path:
            node = node[key]
        node[last] = value
    return out


def record(cfg: dict[str, Any], *, run_id: str, growth_mib: float = 1000.0, step_s: float = 10.0,
           step_times: list[float] | None = None, status: str = "ok", stability: str = "stable",
           trainable: int = 100, total: int = 100, created: str = "2026-12-01T00:00:00Z",
           rest_mib: float | None = None) -> dict[str, Any]:
    """One PPO-or-other stage record: baseline 400 MiB per rank, one `training` phase whose growth is
    `growth_mib` (model state 60 % of it unless rest_mib says otherwise), one step of `step_s` seconds."""
    stage = cfg["stage"]["name"] if cfg["stage"]["name"] != "pipeline" else "ppo"
    nproc = cfg["launcher"]["nproc"]
    baseline = 400 * MIB
    growth = int(growth_mib * MIB)
    rest = int((rest_mib if rest_mib is not None else 0.4 * growth_mib) * MIB)
    state = growth - rest
    breakdown = {"process_start_bytes": 300 * MIB, "runtime_bytes": 100 * MIB, "model_state_bytes": state,
                 "rest_bytes": rest}
    phase = {"peak_bytes": baseline + growth, "peak_bytes_per_rank": [baseline + growth] * nproc,
             "growth_over_baseline_bytes": growth, "breakdown_bytes_per_rank": [breakdown] * nproc}
    init = {"peak_bytes": baseline + state, "peak_bytes_per_rank": [baseline + state] * nproc,
            "growth_over_baseline_bytes": state, "breakdown_bytes_per_rank": [breakdown] * nproc}
    samples = cfg["batch"] * nproc
    result = {
        "status": status, "error": None if status == "ok" else {"message": f"{status} on purpose"},
        "wall_time_s": 60.0,
        "params": {"actor": {"total": total, "trainable": trainable}},
        "model_state": {"actor": {"param_bytes_per_rank": [state // 4] * nproc,
                                  "optimizer_state_bytes_per_rank": [state - state // 4] * nproc}},
        "memory": {"method": "host RSS", "baseline_bytes_per_rank": [baseline] * nproc,
                   "phases": {"init": init, "training": phase}},
        "throughput": {"phases": {"training": {
            "time_s_per_step": step_s, "time_s_per_step_per_rank": [step_s] * nproc,
            "tokens_per_s_global": samples * 256 / step_s, "samples_per_s_global": samples / step_s,
            "tflops_per_s_per_rank": [0.5] * nproc}},
            "step_times_s": step_times if step_times is not None else [step_s]},
        "stability": {"classification": stability, "first_nonfinite_step": None if stability == "stable" else 2,
                      "overflow_skipped_steps": {}, "loss_scale_min": None},
        "learning": {"loss_curve": [1.0, 0.9]},
        "notes": [f"optimizer: {cfg['framework'].get('optimizer', 'adam')} (as upstream)"],
    }
    return {"schema_version": SCHEMA_VERSION, "run_id": run_id, "created_utc": created, "config": cfg,
            "status": status, "environment": {"device": "cpu", "cpu": "test cpu", "cpu_count": 2, "gpu": None},
            "harness_extension": [], "stages": {stage: result}}


def write(root: str, name: str, data: dict[str, Any]) -> str:
    directory = os.path.join(root, name)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "record.json"), "w") as f:
        json.dump(data, f)
    return directory
