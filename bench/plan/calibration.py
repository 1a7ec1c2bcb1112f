"""Per-framework calibration of the memory model: what the physics leaves unexplained, fitted from measured
runs and kept apart from it.

One term per framework, stage, phase and regime: the median, over the fitted runs, of measured minus predicted
growth, per 16-bit width of the run's values (an offset in bytes at 16 bits, twice that in fp32: the heap freed
tensors leave behind is as wide as they are). Regimes: `zero3` (parameters gathered and released as modules run: the
measured heap fragmentation, scripts/diagnostics/engine_buffers.py),
`zero0` where a framework's ZeRO-0 is another engine (trlx:
accelerate's DDP with fp32 weights and autocast; its memory model says so with ZERO0_OWN_ENGINE; without fitted runs
it takes `full`'s offset), `lora` (many small trained tensors: a different allocator pattern) and `full`. For each
model the fit saw, a factor per stage and phase scales the offsets of 100 MiB or more: the median ratio of that
model's residuals there to the pooled offsets (the architecture sets the sizes of the tensors a phase frees, and so
its slack); a model the fit never saw takes the pooled offsets. Offsets are stated at REFERENCE_TOKENS tokens a
micro-batch; a share per stage and phase of a run's offset grows in proportion to its micro-batch's tokens (the
slack of freed activations grows with them, build-time slack does not): fitted from runs that differ only in the
micro-batch, the median over such pairs of how their residuals grow, between none and all of it.
What an offset stands for on the CPU: allocator slack (glibc keeps freed heap that a
later phase reuses or that fragmentation pins: torch's own live bytes over a trlx RM step peak at the
activations the physics counts, 941 vs 936 MiB in bf16 and 1,342 vs 1,332 in fp32
(scripts/diagnostics/step_live_bytes.py), while RSS rises some 380 and 690 MiB further), communication buffers the
physics does not name, and build-time transients. It is fitted on named runs (`fitted_on`), stored next to the
framework's memory model (adapters/<framework>/memory_calibration.json) and applied only on the device it was
fitted on; the report shows the error with and without it, on the runs it was fitted on and on the others.

A framework keeps one fit per measurement setting (MeasurementSetting: the glibc mmap threshold the ranks ran
under and the precisions of the fitted runs): the threshold decides what every freed tensor leaves behind (at
128 KiB its pages go back, at glibc's own threshold the heap keeps them), so the offsets of one setting are not
another's slack, and `bench.plan.calibrate` refuses to pool them. A run takes the fit of its own setting, or none.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

CALIBRATION_FILE = "memory_calibration.json"
# A pooled offset this small (per 16 bits) is mostly build-time noise (the init phases): no model's ratio to it
# is taken, and no factor scales it.
FACTOR_MIN_BYTES = 100 * 2**20
# The micro-batch both CPU rungs' batch-2 configurations run (2 x (128 + 128) tokens): offsets are stated there.
REFERENCE_TOKENS = 512


@dataclass(frozen=True)
class MeasurementSetting:
    """What a fit's host peaks were measured under: runs of another setting take none of its offsets."""
    mmap_threshold: int | None  # memory_mmap_threshold of every fitted run (None: glibc's own)
    precisions: tuple[str, ...]  # the precisions of the fitted runs, sorted

    def matches(self, precision: str, mmap_threshold: int | None) -> bool:
        return mmap_threshold == self.mmap_threshold and precision in self.precisions

    def describe(self) -> str:
        threshold = ("glibc's own mmap threshold" if self.mmap_threshold is None
                     else f"memory_mmap_threshold={self.mmap_threshold}")
        return f"{'/'.join(self.precisions)} at {threshold}"


def describe_run_setting(precision: str, mmap_threshold: int | None) -> str:
    return MeasurementSetting(mmap_threshold, (precision,)).describe()


@dataclass(frozen=True)
class Calibration:
    framework: str
    device: str
    offsets_bytes: dict[str, float]  # "stage/phase/regime" -> bytes added to the physics at 16-bit values
    # the setting the fitted runs were measured under (None only in a fit not yet stored: tests, leave-one-out)
    setting: MeasurementSetting | None = None
    fitted_on: dict[str, Any] = field(default_factory=dict)  # what the fit read: source, selection, runs
    # what a rank holds before any model exists (interpreter, torch, the engine libraries, process groups): the
    # median of rank 0's post-import baseline over the fitted runs' stages; preflight adds it to the prediction
    runtime_bytes: float | None = None
    # "model/stage/phase" -> how a fitted model's slack in that phase stands to the pooled offsets: the median,
    # over its fitted runs there, of its residual over the offset of the run's regime (offsets of at least
    # FACTOR_MIN_BYTES). Heap slack follows the sizes of the tensors a phase frees, which the architecture sets:
    # llama-base's RM evaluation keeps 18-40 % less than glm-base's in every regime (docs/planner.md).
    model_factors: dict[str, float] = field(default_factory=dict)
    # "stage/phase" -> the share of its offset that grows in proportion to a run's tokens a micro-batch (0: none,
    # 1: all): the median over fitted pairs that differ only in the micro-batch (batch_share). On llama-base RM
    # training's slack grows 1.5-1.7x from batch 2 to 4 in every framework and regime (docs/planner.md).
    batch_shares: dict[str, float] = field(default_factory=dict)
    reference_tokens: int = REFERENCE_TOKENS
    method: str = ("per stage, phase and regime (zero3; zero0 where ZeRO-0 is another engine; lora; full): median "
                   "over the fitted runs of (measured - physics) growth over the post-import baseline, busiest rank, "
                   "per 16-bit value width (doubled in fp32); zero0 without fitted runs takes full's offset; for a "
                   "fitted model, an offset of 100 MiB or more times the model's factor for the stage and phase "
                   "(median ratio of its residuals there to the pooled offsets), other models none; stated at "
                   "reference_tokens a micro-batch, a share per stage and phase growing with the micro-batch's tokens "
                   "(median over fitted pairs differing only in the micro-batch, clamped to [0, 1])")

    def offset(self, key: str, device: str, value_bytes: int = 2, model: str | None = None,
               tokens: int | None = None) -> float:
        """Bytes added to the physics for a run of `key`'s regime whose values are `value_bytes` wide; of
        `model`, scaled by its factor where the fit saw it; at `tokens` a micro-batch (None: the reference),
        its stage and phase's share scaled with them."""
        if device != self.device:
            return 0.0
        fallback = key.removesuffix("/zero0") + "/full" if key.endswith("/zero0") else key
        per_16_bits = self.offsets_bytes.get(key, self.offsets_bytes.get(fallback, 0.0))
        if model and abs(per_16_bits) >= FACTOR_MIN_BYTES:
            per_16_bits *= self.model_factors.get(factor_key(model, key), 1.0)
        return per_16_bits * width(value_bytes) * self.batch_scale(key, tokens)

    def batch_scale(self, key: str, tokens: int | None) -> float:
        """How a run at `tokens` a micro-batch scales `key`'s offset stated at the reference."""
        if tokens is None:
            return 1.0
        return 1.0 + self.batch_shares.get(stage_phase(key), 0.0) * (tokens / self.reference_tokens - 1.0)


def width(value_bytes: int) -> float:
    """A run's value width in units of 16 bits: what an offset scales with."""
    return value_bytes / 2


def regime(zero: int, lora: int, zero0_own_engine: bool = False) -> str:
    """The calibration regime of a run: which engine path it takes."""
    return "zero3" if zero >= 3 else "zero0" if zero == 0 and zero0_own_engine else "lora" if lora else "full"


def key(stage: str, phase: str, regime_: str) -> str:
    return f"{stage}/{phase}/{regime_}"


def stage_phase(key_: str) -> str:
    """"rm/evaluation" of "rm/evaluation/lora"."""
    return key_.rsplit("/", 1)[0]


def factor_key(model: str, key_: str) -> str:
    """A model's factor is per stage and phase, shared by the regimes: "llama-base/rm/evaluation"."""
    return f"{model}/{stage_phase(key_)}"


@dataclass(frozen=True)
class Residual:
    key: str
    measured: float
    physics: float
    value_bytes: int = 2
    model: str = ""  # the run's model preset: its factor (none without)
    tokens: int = REFERENCE_TOKENS  # a micro-batch's: batch x (prompt + answer)
    # the run's configuration apart from its micro-batch (batch and lengths) and seed: runs sharing it, at other
    # tokens, make the pairs a batch share is fitted on ("": in none)
    batch_pair: str = ""

    @property
    def per_16_bits(self) -> float:
        return (self.measured - self.physics) / width(self.value_bytes)


def batch_share(low: Residual, high: Residual, reference_tokens: int = REFERENCE_TOKENS) -> float:
    """The share s of the offset that grows with the tokens, from two runs of one configuration at two micro-batch
    sizes: their residuals r stand as (1 + s (x_low - 1)) to (1 + s (x_high - 1)), x = tokens / reference; NaN
    where no share gives that ratio (residuals of opposite signs that would need the scale to pass through 0)."""
    x_low, x_high = low.tokens / reference_tokens, high.tokens / reference_tokens
    r_low, r_high = low.per_16_bits, high.per_16_bits
    denominator = r_low * (x_high - 1.0) - r_high * (x_low - 1.0)
    return (r_high - r_low) / denominator if denominator else math.nan


def batch_shares(residuals: Iterable[Residual], reference_tokens: int = REFERENCE_TOKENS) -> dict[str, float]:
    """Per stage and phase, the median share over pairs of runs that differ only in the micro-batch (the smaller
    one's residual at least FACTOR_MIN_BYTES: a share of build-time noise means nothing), clamped to [0, 1]: no
    slack shrinks with the micro-batch on average, none grows faster than it."""
    groups: dict[tuple[str, str, str], list[Residual]] = {}
    for r in residuals:
        if r.batch_pair:
            groups.setdefault((r.key, r.model, r.batch_pair), []).append(r)
    shares: dict[str, list[float]] = {}
    for runs in groups.values():
        for low in runs:
            for high in runs:
                if high.tokens > low.tokens and abs(low.per_16_bits) >= FACTOR_MIN_BYTES:
                    share = batch_share(low, high, reference_tokens)
                    if math.isfinite(share):
                        shares.setdefault(stage_phase(low.key), []).append(share)
    return {k: min(1.0, max(0.0, float(statistics.median(v)))) for k, v in sorted(shares.items())}


def fit(framework: str, device: str, residuals: Iterable[Residual], fitted_on: dict[str, Any],
        runtime_samples: Iterable[float] = (), setting: MeasurementSetting | None = None) -> Calibration:
    """`runtime_samples`: rank 0's post-import baseline of each fitted stage (bytes)."""
    residuals = list(residuals)
    shares = Calibration(framework, device, {}, batch_shares=batch_shares(residuals))
    # each residual brought to the reference micro-batch before the medians
    at_reference = [(r, r.per_16_bits / shares.batch_scale(r.key, r.tokens)) for r in residuals]
    by_phase: dict[str, list[float]] = {}
    for r, value in at_reference:
        by_phase.setdefault(r.key, []).append(value)
    offsets = {phase: float(statistics.median(values)) for phase, values in sorted(by_phase.items())}
    ratios: dict[str, list[float]] = {}
    for r, value in at_reference:
        pooled = offsets[r.key]
        if r.model and abs(pooled) >= FACTOR_MIN_BYTES:
            ratios.setdefault(factor_key(r.model, r.key), []).append(value / pooled)
    runtime = list(runtime_samples)
    return Calibration(framework=framework, device=device, offsets_bytes=offsets, setting=setting, fitted_on=fitted_on,
                       runtime_bytes=float(statistics.median(runtime)) if runtime else None,
                       model_factors={k: float(statistics.median(v)) for k, v in sorted(ratios.items())},
                       batch_shares=shares.batch_shares)


def path_for(framework_package: str) -> str:
    import adapters

    return os.path.join(os.path.dirname(adapters.__file__), framework_package, CALIBRATION_FILE)


def _from_json(data: dict[str, Any]) -> Calibration:
    setting = data.pop("setting")
    return Calibration(**data, setting=MeasurementSetting(setting["mmap_threshold"], tuple(setting["precisions"])))


def load_all(framework_package: str) -> list[Calibration]:
    """Every fit the framework keeps, one per measurement setting."""
    path = path_for(framework_package)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [_from_json(data) for data in json.load(f)["fits"]]


def for_run(framework_package: str, device: str, precision: str, mmap_threshold: int | None) -> Calibration | None:
    """The fit of a run's own setting on its device (the one fitted on fewest precisions where several hold the
    run's), or None: a run of a setting no fit was measured under takes the physics alone."""
    matching = [c for c in load_all(framework_package)
                if c.device == device and c.setting is not None and c.setting.matches(precision, mmap_threshold)]
    return min(matching, key=lambda c: len(c.setting.precisions), default=None)


def save(calibration: Calibration, framework_package: str) -> str:
    """Store `calibration` in place of the framework's fit of the same device and setting; the others stay."""
    if calibration.setting is None:
        raise ValueError(f"{calibration.framework}: a calibration is stored with the setting it was fitted under")
    kept = [c for c in load_all(framework_package)
            if (c.device, c.setting) != (calibration.device, calibration.setting)]
    fits = sorted([*kept, calibration], key=lambda c: (c.device, c.setting.mmap_threshold is not None,
                                                       c.setting.mmap_threshold or 0, c.setting.precisions))
    path = path_for(framework_package)
    with open(path, "w") as f:
        json.dump({"framework": calibration.framework, "fits": [asdict(c) for c in fits]}, f, indent=1,
                  sort_keys=True)
        f.write("\n")
    return path
