"""DeepSpeed configs the way DS-Chat's dschat/utils/ds_utils.py builds them."""

from __future__ import annotations

from typing import Any

from adapters.dschat.options import DSChatOptions
from bench.run.spec import RunSpec

# ds_utils.py's stage3_param_persistence_threshold (1e4): tensors of at most this many elements stay whole at ZeRO-3
PERSISTENCE_THRESHOLD = 10_000


def _precision(spec: RunSpec, options: DSChatOptions) -> dict[str, Any]:
    if spec.precision == "fp16":
        # DS-Chat's fp16 block: dynamic loss scaling with DeepSpeed's defaults (initial 2**16,
        # hysteresis 2, min 1) except the window.
        return {"fp16": {"enabled": True, "loss_scale_window": options.fp16_loss_scale_window}}
    if spec.precision == "bf16":
        return {"bf16": {"enabled": True}}
    return {}


def _batch(spec: RunSpec, world_size: int) -> dict[str, Any]:
    """DS-Chat's train_batch_size = per-device batch x world size x --gradient_accumulation_steps, from which
    DeepSpeed derives its gradient_accumulation_steps (the engine steps on every grad_accum-th micro-batch)."""
    return {"train_micro_batch_size_per_gpu": spec.batch, "train_batch_size": spec.batch * world_size * spec.grad_accum}


def train_config(spec: RunSpec, options: DSChatOptions, world_size: int, overlap_comm: bool,
                 hybrid_engine: bool = False, comm: dict[str, Any] | None = None, stage: int | None = None
                 ) -> dict[str, Any]:
    """get_train_ds_config: the actor / critic / SFT / RM engines; `comm`: the ds.* knobs set; `stage`: the
    engine's ZeRO stage where it is not `zero` (the critic's --critic_zero_stage)."""
    stage = spec.zero if stage is None else stage
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": overlap_comm,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    zero.update(comm or {})
    if spec.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:  # DeepSpeed honours parameter offload only at stage 3
            zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        **_batch(spec, world_size),
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "gradient_clipping": spec.grad_clip_or(options.gradient_clipping),
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        **_precision(spec, options),
    }
    if spec.offload and options.optimizer == "torch_adamw":
        # DeepSpeed refuses a client torch optimizer with ZeRO-Offload unless told this is deliberate.
        config["zero_force_ds_cpu_optimizer"] = False
    if hybrid_engine:
        config["hybrid_engine"] = {
            "enabled": True,
            "max_out_tokens": spec.prompt_len + spec.answer_len,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        }
    return config


def eval_config(spec: RunSpec, options: DSChatOptions, world_size: int, trained_stage: int | None = None
                ) -> dict[str, Any]:
    """get_eval_ds_config: the reference follows the actor into ZeRO-3 and the reward the critic (rlhf_engine.py:
    stage 3 only when the trained one's is 3, else 0); `trained_stage`: that one's stage where it is not `zero`."""
    stage = 3 if (spec.zero if trained_stage is None else trained_stage) == 3 else 0
    return {
        **_batch(spec, world_size),
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
            "memory_efficient_linear": False,
        },
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        **_precision(spec, options),
    }
