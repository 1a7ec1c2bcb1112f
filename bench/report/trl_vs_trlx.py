"""TRL (the package itself) against the trlx re-creation, phase by phase: both run on accelerate (DeepSpeed's
plugin at ZeRO >= 1), so where they differ is what each codebase builds and keeps alive. For every matched set
(cells that differ only in the framework) holding both, each phase's peak growth and step time, with the
difference explained from the two codebases (trl 0.19.1 trainer/*.py; trlx accelerate_*_trainer.py)."""

from __future__ import annotations

from typing import Any

from bench.report.aggregate import stat
from bench.report.pairs import matched_sets
from bench.report.tables import Table

MIB = 1024.0 * 1024.0
Rows = list[dict[str, Any]]

# What differs between the two codebases in each phase (trlx as its defaults run it: a hydra policy whose
# top num_layers_unfrozen=2 blocks train, the reward function on rank 0; TRL: its scripts' four models).
WHY: dict[tuple[str, str], str] = {
    ("ppo", "init"): "TRL builds four whole models (policy, a reference copy, a value model with its own trunk, a "
                     "reward model on every rank) and one AdamW over policy + value model, every layer training; "
                     "trlx one policy with a value head on the shared trunk, a hydra reference (top 2 blocks + "
                     "head), Adam states for the 2 unfrozen blocks only, the reward model on rank 0 only",
    ("ppo", "generation"): "TRL's batch_generation keeps every answer token's logits (output_scores: answer x vocab "
                           "fp32 per sequence) for the log-probs; trlx keeps none and recomputes them in "
                           "make_experience",
    ("ppo", "experience"): "TRL: the reference (a whole model), the value model (its own trunk) and the reward "
                           "model each forward per chunk, log-probs from the kept generation logits; trlx: the "
                           "reward function on rank 0, one policy forward giving logits and values (hidden states "
                           "and KV kept), then the hydra branch for the reference",
    ("ppo", "training"): "TRL: 4 epochs of a joint forward through policy and the separate value trunk "
                         "(PolicyAndValueWrapper), backward through both whole models; trlx: 4 epochs of one trunk "
                         "with its value head, gradients only for the top 2 blocks (no backward below them)",
    ("sft", "training"): "both: one causal-LM loss per micro-batch through accelerate; TRL's SFTTrainer (HF Trainer) "
                         "also computes per-step entropy and token accuracy over the logits, clips at "
                         "max_grad_norm 1.0 and keeps a decay / no-decay AdamW; trlx: one AdamW group, DeepSpeed's "
                         "clipping only",
    ("rm", "training"): "TRL's RewardTrainer trains every layer of a sequence classifier (score at the last token, "
                        "chosen and rejected in two forwards); trlx's example freezes the bottom 70 % of the blocks "
                        "(no gradients or Adam states there) and scores from the first differing token",
}
PHASES = {"sft": ("init", "training"), "rm": ("init", "training"), "ppo": ("init", "generation", "experience",
                                                                          "training")}


def _fmt(values: list[Any], scale: float, digits: int) -> str:
    found = stat(values)
    return found.fmt(scale, digits) if found.median is not None else "-"


def trl_vs_trlx_table(rows: Rows, cells: dict[str, dict[str, Any]]) -> list[Table]:
    body = []
    for stage, phases in PHASES.items():
        for matched in matched_sets(rows, cells, "framework", stage):
            if not {"trl", "trlx"} <= set(matched.by_value):
                continue
            trl, trlx = matched.by_value["trl"], matched.by_value["trlx"]
            for phase in phases:
                growth, time = f"growth_{phase}_bytes", f"time_s_per_step_{phase}"
                why = WHY.get((stage, phase), "both: accelerate's prepare (DeepSpeed's engine at ZeRO >= 1) of the "
                                              "models above" if phase == "init" else "")
                body.append([stage, matched.fixed, phase, _fmt([r.get(growth) for r in trl], MIB, 0),
                             _fmt([r.get(growth) for r in trlx], MIB, 0),
                             _fmt([r.get(time) for r in trl], 1.0, 2), _fmt([r.get(time) for r in trlx], 1.0, 2), why])
    if not body:
        return []
    return [Table("trl_vs_trlx", "TRL (the package) against the trlx re-creation, phase by phase",
                  "Matched cells (the same configuration, each framework's own options). Growth: MiB over the "
                  "post-import baseline, max over ranks; time: seconds per timed step (init: once); median [range] "
                  "CI (n runs). Both run on accelerate with DeepSpeed's plugin at ZeRO >= 1, so the "
                  "differences are what each codebase builds, keeps alive and trains, explained per phase.",
                  ["stage", "configuration", "phase", "trl growth MiB", "trlx growth MiB", "trl s/step",
                   "trlx s/step", "why (from the two codebases)"], body)]
