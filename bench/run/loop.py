"""The per-rank step loop of each stage: the core measures, the adapter does the work.

Every phase of every step runs inside PhaseTracker.phase, so memory and time are measured the same
way whatever the framework; the adapter's outputs feed the stability tracker and the learning curves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist

from adapters.base import Adapter, Experience, Rollout, TrainOutput, merge_micro
from bench.measure.flops import Attention, phase_flops
from bench.measure.live_tensors import LiveTensorProbe
from bench.measure.memory import long_lived_frozen
from bench.measure.params import ParamCounts
from bench.measure.phases import PhaseTracker
from bench.measure.stability import StabilityTracker
from bench.run.checkpoint import Checkpointer, latest_complete, set_rng_state
from bench.run.data import SyntheticData
from bench.run.reward_stats import STAT_BATCHES, Moments, heldout_statistics
from bench.run.spec import ROLLOUT_STAGES, RunSpec


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


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is True on any: decisions that end a stage (stop, diverged, skip the
    save) must be taken together, or a rank left alone in a collective waits until the timeout."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    flags = torch.tensor([int(flag)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags.item())


def _generation_context(rollout: Rollout) -> float:
    """Mean context of a token while generating with a KV cache: the prompt width plus half the answer."""
    return rollout.prompt_len + (rollout.sequences.shape[1] - rollout.prompt_len) / 2


class StageLoop:
    def __init__(self, adapter: Adapter, spec: RunSpec, tracker: PhaseTracker, data: SyntheticData,
                 observers: Sequence[StepObserver] = ()) -> None:
        self.adapter = adapter
        self.spec = spec
        self.tracker = tracker
        self.data = data
        self.observers = observers
        self.steps: list[dict[str, Any]] = []
        self.learning: dict[str, Any] = {}
        self.stability: StabilityTracker | None = None
        self._roles: dict[str, tuple[str, ...]] = {}
        self._counts: dict[str, ParamCounts] = {}
        self._attention: dict[str, Attention] = {}
        self._leak: list[torch.Tensor] = []
        self.resumed_from: int | None = None  # steps done by the checkpoint this stage resumed from

    def _measure(self, phase: str, step: int, work: Callable[[], Any],
                 context: float | Callable[[Any], float] | None = None):
        """Runs `work` as one measured phase; `context` (or a function of the result) is the sequence width
        its tokens attend over, for the FLOPs formula."""
        with self.tracker.phase(phase, step) as sample:
            result = work()
            leak = self.spec.debug.leak_mib_per_step
            if leak and phase == self.spec.debug.leak_phase:  # test only: a planted leak that soak runs must find
                self._leak.append(torch.ones(int(leak * 2**20), dtype=torch.uint8, device=self.tracker.device))
            tokens = getattr(result, "tokens", None)
            samples = getattr(result, "samples", None)
            if isinstance(result, dict):
                tokens, samples = result["tokens"], result["samples"]
            sample.update(tokens=tokens, samples=samples)
            if isinstance(result, dict) and "bytes_moved" in result:
                sample["bytes_moved"] = result["bytes_moved"]
            if hasattr(result, "generated_tokens"):
                sample["generated_tokens"] = result.generated_tokens
            flops = None
            if phase in self._roles and context is not None:
                width = context(result) if callable(context) else context
                flops = phase_flops(phase, self._roles[phase], self._counts, self._attention, tokens, width)
                sample["context_tokens"] = width
            sample["flops"] = flops / self.adapter.model_parallel_size if flops is not None else None
        return result

    def partial(self) -> dict[str, Any]:
        """What the stage measured so far (a run cut short keeps it)."""
        partial: dict[str, Any] = {"steps": self.steps, "learning": self.learning}
        if self.stability is not None:
            partial["stability"] = self.stability.summary()
        return partial

    def _resume(self, stage: str, checkpoints: str) -> int:
        """Load the last complete checkpoint and this rank's random states; the steps it had done."""
        found = latest_complete(checkpoints)
        if found is None:
            return 0
        steps_done, directory = found
        self.adapter.load_checkpoint(stage, directory)
        rng = os.path.join(directory, f"rng-rank{self.adapter.ctx.rank}.pt")
        if not os.path.isfile(rng):
            raise RuntimeError(f"{directory} holds no random states of rank {self.adapter.ctx.rank}: it was "
                               "written by fewer ranks; resume with the launcher.nproc it ran with")
        set_rng_state(torch.load(rng, weights_only=False))
        self.resumed_from = steps_done
        return steps_done

    def run(self, stage: str, init: dict[str, str], checkpoints: str | None = None) -> dict[str, Any]:
        """`checkpoints`: the directory of this stage's checkpoints (saved every checkpoint.every steps,
        resumed from with spec.resume)."""
        self._roles = self.adapter.phase_roles[stage]
        with self.tracker.phase("init"):
            self.adapter.setup(stage, init)
            if stage == "ppo":  # GRPO's reward is a function of the answer: nothing to scale
                self.adapter.set_reward_scaling(init)
            first = self._resume(stage, checkpoints) if self.spec.resume and checkpoints else 0
        every = self.spec.checkpoint.every if checkpoints else 0
        checkpointer = Checkpointer(checkpoints, every, self.spec.checkpoint.background, self.adapter.ctx.rank,
                                    lambda directory: self.adapter.save_checkpoint(stage, directory)) if every else None
        self._counts = self.adapter.params()
        self._attention = self.adapter.attention()
        # What is alive at the moments that set the experience peak (first step only; armed after setup).
        probe = LiveTensorProbe(self.adapter.probe_points()) if stage in ROLLOUT_STAGES else None
        self.stability = StabilityTracker(self.spec.stability.stop_after_nonfinite,
                                          self.spec.stability.skip_storm_len, self.spec.stability.skip_rate_storm)
        if stage == "rm":  # a resumed RM has trained already: no "before training" accuracy
            self.learning["accuracy_start"] = self._rm_eval(step=-1) if not first else None
        n_steps = self.spec.steps[stage]
        for observer in self.observers:
            observer.start(stage, n_steps)
        device = self.tracker.device
        with long_lived_frozen():  # the collection before each phase walks only what the steps make
            for step in range(first, n_steps):
                try:
                    record = self._step(stage, step)
                except Exception as err:  # the engine giving up on fp16 is a measured outcome, not a crash
                    if MIN_SCALE_MESSAGE not in str(err):
                        raise
                    self.stability.abort(str(err), step)
                    self.tracker.current_phase = None
                    record = None
                stop = True
                if record is not None:
                    stop = self.stability.observe(step, record.pop("_values"), record.pop("_skipped"),
                                                  record.pop("_scales"))
                    self.steps.append(record)
                    for observer in self.observers:
                        observer.advance(record)
                if any_rank(stop, device):
                    break
                if checkpointer is not None and checkpointer.due(step + 1):
                    with self.tracker.phase("checkpoint", step):
                        checkpointer.save(step + 1)
        if checkpointer is not None:
            checkpointer.close()  # the last overlapped writes: their wait is in the last save's entry
        for observer in self.observers:
            observer.stop()
        if stage == "rm":
            self.learning["accuracy_end"] = self._rm_eval(step=len(self.steps), statistics=True)
        summary = self.stability.summary()
        live = probe.close() if probe is not None else {}
        return {
            "live_tensors": live,
            "params": {role: c.as_dict() for role, c in self._counts.items()},
            "model_state": {role: s.as_dict() for role, s in self.adapter.model_state().items()},
            "stability": summary,
            "diverged_any_rank": any_rank(summary["classification"] == "diverged", device),
            "steps": self.steps,
            "learning": self.learning,
            "resumed_from_step": self.resumed_from,
            "checkpoints": checkpointer.saves if checkpointer is not None else [],
        }

    def _pooled(self, moments: Moments) -> Moments:
        """`moments` pooled over the data-parallel ranks (every one scores its own held-out batches; the ranks
        of one model-parallel group score the same, so their sum is divided by the group's size)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return moments
        # float64 on the host: gloo reduces it, and a sum of squares keeps its digits (nccl: on the device)
        device = self.tracker.device if self.tracker.device.type == "cuda" else torch.device("cpu")
        values = torch.tensor([moments.count, moments.total, moments.squares], dtype=torch.float64, device=device)
        dist.all_reduce(values)
        return Moments(*(values / self.adapter.model_parallel_size).tolist())

    def _rm_eval(self, step: int, statistics: bool = False) -> float:
        """Held-out accuracy over EVAL_BATCHES preference batches; with `statistics` (the stage's end) the
        scores of 2 x STAT_BATCHES batches more (the first EVAL_BATCHES among them) become the held-out score
        statistics that reward.normalize=zscore applies in PPO (bench.run.reward_stats), in self.learning."""
        def work():
            count = 2 * STAT_BATCHES if statistics else EVAL_BATCHES
            batches = [self.data.preferences(i, stage="eval") for i in range(count)]
            scores = [self.adapter.rm_scores(b) for b in batches]
            accuracy = sum(float((chosen > rejected).float().mean())
                           for chosen, rejected in scores[:EVAL_BATCHES]) / EVAL_BATCHES
            if statistics:
                splits = [[float(v) for pair in scores[part] for side in pair for v in side]
                          for part in (slice(0, STAT_BATCHES), slice(STAT_BATCHES, None))]
                fit, check = (self._pooled(Moments.of(split)) for split in splits)
                self.learning["heldout_scores"] = heldout_statistics(fit, check, (
                    f"chosen and rejected end scores of {STAT_BATCHES} held-out preference batches of "
                    f"{batches[0].chosen_ids.shape[0]} pairs per data-parallel rank; the check: {STAT_BATCHES} "
                    "batches more")).as_dict()
            return {"tokens": sum(b.real_tokens for b in batches), "samples": 0, "accuracy": accuracy,
                    "width": batches[0].chosen_ids.shape[1]}

        return self._measure("evaluation", step, work, lambda result: result["width"])["accuracy"]

    def _shuttle(self, direction: str, step: int) -> None:
        if self.adapter.shuttles_models:
            self._measure(direction, step, lambda: {"tokens": None, "samples": None, **self.adapter.shuttle(direction)})

    def _rollout(self, step: int, index: int, figures: dict[str, float], k: int) -> tuple[Experience, int]:
        """One rollout of a PPO step (the `index`th prompt batch): generation and experience making, measured;
        its reward, KL, value and preferred-token share added to `figures` as its share (1/k) of the step's mean."""
        prompts = self.data.prompts(index)
        self._shuttle("onload", step)
        rollout = self._measure("generation", step, lambda: self.adapter.generate(prompts), _generation_context)
        width = rollout.sequences.shape[1]
        experience = self._measure("experience", step, lambda: self.adapter.make_experience(rollout), width)
        self._shuttle("offload", step)
        answers, mask = rollout.answers
        figures["preferred_fraction"] += self.data.preferred_fraction(answers.cpu(), mask.cpu()) / k
        figures["generated_tokens"] += rollout.generated_tokens
        for key in ("reward", "kl", "value"):
            value = getattr(experience, key)
            figures[key] = None if value is None or figures[key] is None else figures[key] + value / k
        return experience, width

    def _step(self, stage: str, step: int) -> dict[str, Any]:
        """One optimizer step: grad_accum micro-batches (PPO: rollouts), each its own measured phase(s)."""
        # the rates this step's optimizer steps apply (a scheduler moves them after each optimizer step)
        record: dict[str, Any] = {"step": step}
        record.update({f"lr/{role}": lr for role, lr in self.adapter.learning_rates().items()})
        k = self.spec.grad_accum if stage not in ROLLOUT_STAGES else self.adapter.rollouts_per_step()
        micro = [step * k + i for i in range(k)]  # every micro-batch (rollout) draws its own data
        if stage == "sft":
            def sft(i: int):
                batch = self.data.sft(i)
                return self._measure("training", step, lambda: self.adapter.sft_step(batch), batch.input_ids.shape[1])
            out = merge_micro([sft(i) for i in micro])
        elif stage == "rm":
            def rm(i: int):
                batch = self.data.preferences(i)
                return self._measure("training", step, lambda: self.adapter.rm_step(batch), batch.chosen_ids.shape[1])
            out = merge_micro([rm(i) for i in micro])
        else:
            # what each rollout leaves for the record; trlx and coati keep a step's experiences for one update
            figures = dict.fromkeys(("reward", "kl", "value", "preferred_fraction", "generated_tokens"), 0.0)
            held, outs = [], []
            for i in micro:
                experience, width = self._rollout(step, i, figures, k)
                if self.adapter.updates_after_all_rollouts:
                    held.append((experience, width))
                else:
                    outs.append(self._measure("training", step, partial(self.adapter.ppo_train, [experience]), width))
            if held:
                outs.append(self._measure("training", step, partial(self.adapter.ppo_train, [e for e, _ in held]),
                                          max(w for _, w in held)))
            out = merge_micro(outs)
            record.update(figures, generated_tokens=int(figures["generated_tokens"]))
        values = _train_values(out)
        if stage in ROLLOUT_STAGES:
            values.update({key: record[key] for key in ("reward", "kl", "value") if record[key] is not None})
        record.update({f"loss/{r}": v for r, v in out.losses.items()})
        record.update({f"grad_norm/{r}": v for r, v in out.grad_norms.items()})
        record.update({f"skipped/{r}": v for r, v in out.skipped.items()})
        record.update({f"loss_scale/{r}": v for r, v in out.loss_scales.items() if v is not None})
        record.update(out.metrics)
        record["_values"], record["_skipped"], record["_scales"] = values, out.skipped, out.loss_scales
        return record
