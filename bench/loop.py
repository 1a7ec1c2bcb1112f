"""The per-rank step loop of each stage: the core measures, the adapter does the work.

Every phase of every step runs inside PhaseTracker.phase, so memory and time are measured the same
way whatever the framework; the adapter's outputs feed the stability tracker and the learning curves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from adapters.base import Adapter, TrainOutput
from bench.data import SyntheticData
from bench.flops import phase_flops
from bench.spec import RunSpec
from bench.trackers.phases import PhaseTracker
from bench.trackers.stability import StabilityTracker


class StepObserver(Protocol):
    """Sees each step's record on rank 0: the progress bar, wandb."""

    def start(self, stage: str, total: int) -> None: ...
    def advance(self, record: dict[str, Any]) -> None: ...
    def stop(self) -> None: ...


EVAL_BATCHES = 2
MIN_SCALE_MESSAGE = "loss scale already at minimum"


def _train_values(out: TrainOutput) -> dict[str, float | None]:
    """Values checked for non-finiteness: losses always; gradient norms only of steps that were not
    skipped (an overflow-skipped fp16 step has an infinite norm by definition)."""
    values: dict[str, float | None] = {f"loss/{role}": loss for role, loss in out.losses.items()}
    for role, norm in out.grad_norms.items():
        if not out.skipped.get(role):
            values[f"grad_norm/{role}"] = norm
    return values


class StageLoop:
    def __init__(self, adapter: Adapter, spec: RunSpec, tracker: PhaseTracker, data: SyntheticData,
                 observers: Sequence[StepObserver] = ()) -> None:
        self.adapter = adapter
        self.spec = spec
        self.tracker = tracker
        self.data = data
        self.observers = observers

    def _measure(self, phase: str, step: int, roles: dict[str, tuple[str, ...]], params: dict[str, int], work):
        with self.tracker.phase(phase, step) as sample:
            result = work()
            tokens = getattr(result, "tokens", None)
            samples = getattr(result, "samples", None)
            if isinstance(result, dict):
                tokens, samples = result["tokens"], result["samples"]
            sample.update(tokens=tokens, samples=samples)
            if isinstance(result, dict) and "bytes_moved" in result:
                sample["bytes_moved"] = result["bytes_moved"]
            if hasattr(result, "generated_tokens"):
                sample["generated_tokens"] = result.generated_tokens
            flops = phase_flops(phase, roles[phase], params, tokens) if phase in roles else None
            sample["flops"] = flops / self.adapter.model_parallel_size if flops is not None else None
        return result

    def run(self, stage: str, init: dict[str, str]) -> dict[str, Any]:
        roles = self.adapter.phase_roles[stage]
        with self.tracker.phase("init"):
            self.adapter.setup(stage, init)
        counts = self.adapter.params()
        compute = {role: c.compute for role, c in counts.items()}
        stability = StabilityTracker(self.spec.stability.stop_after_nonfinite, self.spec.stability.skip_storm_len)
        steps: list[dict[str, Any]] = []
        learning: dict[str, Any] = {}
        if stage == "rm":
            learning["accuracy_start"] = self._rm_eval(roles, compute, step=-1)
        n_steps = self.spec.steps[stage]
        for observer in self.observers:
            observer.start(stage, n_steps)
        for step in range(n_steps):
            try:
                record = self._step(stage, step, roles, compute)
            except Exception as err:  # the engine giving up on fp16 is a measured outcome, not a crash
                if MIN_SCALE_MESSAGE not in str(err):
                    raise
                stability.abort(str(err), step)
                self.tracker.current_phase = None
                break
            stop = stability.observe(step, record.pop("_values"), record.pop("_skipped"), record.pop("_scales"))
            steps.append(record)
            for observer in self.observers:
                observer.advance(record)
            if stop:
                break
        for observer in self.observers:
            observer.stop()
        if stage == "rm":
            learning["accuracy_end"] = self._rm_eval(roles, compute, step=len(steps))
        return {
            "params": {role: c.as_dict() for role, c in counts.items()},
            "model_state": {role: s.as_dict() for role, s in self.adapter.model_state().items()},
            "stability": stability.summary(),
            "steps": steps,
            "learning": learning,
        }

    def _rm_eval(self, roles, compute, step: int) -> float:
        def work():
            batches = [self.data.preferences(i, stage="eval") for i in range(EVAL_BATCHES)]
            accuracy = sum(self.adapter.rm_accuracy(b) for b in batches) / len(batches)
            return {"tokens": sum(b.real_tokens for b in batches), "samples": 0, "accuracy": accuracy}

        return self._measure("evaluation", step, roles, compute, work)["accuracy"]

    def _shuttle(self, direction: str, step: int, roles, compute) -> None:
        if self.adapter.shuttles_models:
            self._measure(direction, step, roles, compute,
                          lambda: {"tokens": None, "samples": None, **self.adapter.shuttle(direction)})

    def _step(self, stage: str, step: int, roles, compute) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step}
        if stage == "sft":
            batch = self.data.sft(step)
            out = self._measure("training", step, roles, compute, lambda: self.adapter.sft_step(batch))
        elif stage == "rm":
            batch = self.data.preferences(step)
            out = self._measure("training", step, roles, compute, lambda: self.adapter.rm_step(batch))
        else:
            prompts = self.data.prompts(step)
            self._shuttle("onload", step, roles, compute)
            rollout = self._measure("generation", step, roles, compute, lambda: self.adapter.generate(prompts))
            experience = self._measure("experience", step, roles, compute,
                                       lambda: self.adapter.make_experience(rollout))
            self._shuttle("offload", step, roles, compute)
            out = self._measure("training", step, roles, compute, lambda: self.adapter.ppo_train(experience))
            answers, mask = rollout.answers
            record.update(
                reward=experience.reward, kl=experience.kl, value=experience.value,
                preferred_fraction=self.data.preferred_fraction(answers.cpu(), mask.cpu()),
                generated_tokens=rollout.generated_tokens,
            )
        values = _train_values(out)
        if stage == "ppo":
            values.update(reward=record["reward"], kl=record["kl"], value=record["value"])
        record.update({f"loss/{r}": v for r, v in out.losses.items()})
        record.update({f"grad_norm/{r}": v for r, v in out.grad_norms.items()})
        record.update({f"skipped/{r}": v for r, v in out.skipped.items()})
        record.update({f"loss_scale/{r}": v for r, v in out.loss_scales.items() if v is not None})
        record.update(out.metrics)
        record["_values"], record["_skipped"], record["_scales"] = values, out.skipped, out.loss_scales
        return record
