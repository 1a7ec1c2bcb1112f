"""DeepSpeed 0.19.8 with fp16 at ZeRO-0 never scales the loss: an upstream defect a DS-Chat user gets.

`DeepSpeedEngine.backward` (runtime/engine.py) scales the loss only for a `ZeROOptimizer`
(`scale_if_loss`) or torch autocast's ZeRO-0 grad scaler. fp16 at ZeRO-0 wraps the optimizer in
`FP16_Optimizer` (FusedAdam, DS-Chat's default) or `FP16_UnfusedOptimizer` (others), which are neither:
their own `backward()` would multiply the loss by the loss scale, but the engine never calls it. Their
`step()` still divides by the scale. So small fp16 gradients underflow as if loss scaling were off; the
norm FP16_Optimizer reports, and clips on, is the true norm divided by the scale; and gradient clipping
never fires. Adam's scale invariance hides most of it in the loss curve.

The harness runs it as upstream does and marks the record. `framework.fix_fp16_zero0_loss_scale=true`
multiplies the loss by the optimizer's current scale before `engine.backward`, the arithmetic of the
optimizer's own `backward()`, kept inside the engine's backward so ZeRO-0's gradient all-reduce still runs.
"""

from __future__ import annotations

from typing import Any

import torch

DEFECT_ID = "deepspeed-0.19.8-fp16-zero0-unscaled-loss"
WHERE = "deepspeed 0.19.8 runtime/engine.py DeepSpeedEngine.backward (scales only ZeROOptimizer losses)"
EFFECT = ("fp16 at ZeRO-0: the loss is never multiplied by the loss scale, yet FP16_Optimizer.step divides the "
          "gradients by it: small gradients underflow as if unscaled, the engine's gradient norm is off by the "
          "scale and gradient clipping never fires")


def affected(engine: Any) -> bool:
    """True when this engine's backward skips loss scaling although its optimizer unscales."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = engine.optimizer
    return (engine.fp16_enabled() and optimizer is not None and not isinstance(optimizer, ZeROOptimizer)
            and getattr(engine, "torch_autocast_z0_gradscaler", None) is None
            and getattr(optimizer, "loss_scale", None) is not None)


def scaled_loss(loss: torch.Tensor, optimizer: Any) -> tuple[torch.Tensor, float]:
    """The loss as FP16_Optimizer.backward scales it (in fp32), and the scale used."""
    scale = float(optimizer.loss_scale)
    return loss.float() * scale, scale


class ClipWatch:
    """The clipping factor the optimizer's own `unscale_and_clip_grads` applied on its last step: 1.0 when
    clipping did not fire, the factor the gradients were divided by (beyond the loss scale) when it did."""

    def __init__(self, optimizer: Any) -> None:
        self.coefficient: float | None = None
        original = optimizer.unscale_and_clip_grads

        def watched(*args: Any, **kwargs: Any) -> Any:
            combined = original(*args, **kwargs)
            self.coefficient = float(combined) / float(optimizer.loss_scale)
            return combined

        optimizer.unscale_and_clip_grads = watched

    def take(self) -> float | None:
        coefficient, self.coefficient = self.coefficient, None
        return coefficient


def record_entry(fixed: bool) -> dict[str, str]:
    return {"id": DEFECT_ID, "where": WHERE, "effect": EFFECT,
            "handling": ("fixed by framework.fix_fp16_zero0_loss_scale=true (a deviation from upstream)" if fixed
                         else "run as upstream (framework.fix_fp16_zero0_loss_scale=true fixes it)")}
