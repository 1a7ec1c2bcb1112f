"""One FLOPs formula for every framework, applied to real token counts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

FORMULA = (
    "model FLOPs = 2*N*T for a forward pass, 6*N*T for a training step (forward + backward); "
    "N = parameters a token multiplies through (position tables excluded, tied embedding counted once "
    "as the LM head, LoRA not discounted, recomputation under gradient checkpointing not counted), "
    "T = real (non-pad) tokens; generation counts each prompt and generated token once (KV cache); "
    "attention-score FLOPs are ignored"
)

TRAINING_PHASES = ("training",)


def phase_flops(phase: str, roles: Iterable[str], compute_params: Mapping[str, int], tokens: int) -> float:
    per_token = 6 if phase in TRAINING_PHASES else 2
    return float(per_token * sum(compute_params[role] for role in roles) * tokens)
