"""Parameter counts of a model: the record the FLOPs formula and the records read (bench.run.models counts them).
Kept apart from bench.run.models so that the launcher's side (records, FLOPs) needs neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCounts:
    total: int  # unique parameters (tied weights once)
    trainable: int
    compute: int  # parameters a token's forward pass multiplies through: total minus position tables
    compute_trainable: int = 0  # of `compute`, those that train (their backward also forms weight gradients)

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "trainable": self.trainable, "compute": self.compute,
                "compute_trainable": self.compute_trainable}
