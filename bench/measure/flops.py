"""One FLOPs formula for every framework, applied to real token counts (standard MFU accounting).

Per token and per model a phase multiplies through:
- forward: 2*N + 4*L*C*H  (weights, then attention scores and their weighted sum);
- training step (forward + backward): 6*N_t + 4*N_f + 12*L*C*H, where N_t are the parameters that train
  (their backward forms input and weight gradients: 2 + 2 + 2) and N_f the frozen ones (input gradients
  only: 2 + 2). Attention has no weights: its backward always costs twice its forward.
N excludes the tables a token only looks up (position tables; an input embedding, unless it is tied to the LM
head, where it counts once, as the head: a backbone under a value head multiplies through no embedding);
grouped-query attention's narrower K and V maps, SwiGLU's three MLP matrices and an untied head enter N as
the model has them. L = attention layers, H = hidden size (the width of Q: heads x head dim), C = the context
a token attends over (the padded sequence width of the batch; while generating, the prompt width plus half
the answer width, the mean context of a decoded token with a KV cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bench.measure.params import ParamCounts

FORMULA = (
    "per token and model: forward 2*N + 4*L*C*H; training step 6*N_trainable + 4*N_frozen + 12*L*C*H "
    "(frozen weights form input gradients only); N = parameters a token multiplies through (position "
    "tables and input embeddings excluded, a lookup, unless tied to the LM head, counted once as the head; "
    "LoRA factors counted, recomputation "
    "under gradient checkpointing not counted), L = attention layers, H = hidden size, C = context "
    "(padded sequence width; generation: prompt width + answer width / 2); T = real (non-pad) tokens; "
    "each module counted once, in the phase where it runs; generation counts each prompt and generated "
    "token once (KV cache); frozen layers below every trainable one are still counted at 4*N (an upper "
    "bound: they need no backward at all)"
)

TRAINING_PHASES = ("training",)


@dataclass(frozen=True)
class Attention:
    """The attention shape of one role's forward pass: how many layers a token crosses, at what width."""

    layers: int
    hidden: int


def token_flops(phase: str, counts: ParamCounts, attention: Attention, context: float) -> float:
    """FLOPs one token costs in one role's pass of `phase` (see the module docstring)."""
    attention_flops = attention.layers * context * attention.hidden
    if phase in TRAINING_PHASES:
        frozen = counts.compute - counts.compute_trainable
        return 6.0 * counts.compute_trainable + 4.0 * frozen + 12.0 * attention_flops
    return 2.0 * counts.compute + 4.0 * attention_flops


def phase_flops(phase: str, roles: Iterable[str], counts: Mapping[str, ParamCounts],
                attention: Mapping[str, Attention], tokens: int, context: float) -> float:
    return float(sum(token_flops(phase, counts[role], attention[role], context) for role in roles) * tokens)
