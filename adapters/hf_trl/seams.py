"""Where the harness's phases begin and end inside TRL's own loops, and what it reads there.

Nothing here computes in TRL's place: each wrapper calls the original with the same arguments, returns its
result, and either keeps a reference to what it returned (read after the trainer paused) or hands control to
the harness (LoopDriver.seam). The wrapped names are module-level names of trl.trainer.ppo_trainer and
trl.trainer.grpo_trainer (imported there from trl's utils), and trainer callbacks; the TRL fidelity
table lists them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from transformers import TrainerCallback

from adapters.hf_trl.driver import LoopDriver


class Captured:
    """What the trainer's calls returned since the last seam the harness read."""

    def __init__(self) -> None:
        self.values: dict[str, list[Any]] = {}
        self.generated = False  # a generation ended and the update has not begun

    def add(self, key: str, value: Any) -> None:
        self.values.setdefault(key, []).append(value)

    def take(self, key: str) -> list[Any]:
        return self.values.pop(key, [])


class StepSeams(TrainerCallback):
    """HF Trainer callbacks as seams: the loop's start, each micro-batch's end, each optimizer step's end. In HF
    Trainer's loop the step's log (loss, grad_norm) comes after on_step_end, so a step ends at its on_log; TRL's
    PPO logs before its on_step_end, so there a step ends at on_step_end (`step_end_at`)."""

    def __init__(self, driver: LoopDriver, step_end_at: str) -> None:
        self.driver = driver
        self.step_end_at = step_end_at
        self.logs: dict[str, float] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.driver.seam("train_begin")

    def on_substep_end(self, args, state, control, **kwargs):
        self.driver.seam("micro_end")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and ("loss" in logs or "loss/policy_avg" in logs):  # a training step's log (not the run's summary)
            self.logs = dict(logs)
            if self.step_end_at == "on_log":
                self.driver.seam("step_end", self.logs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_end_at == "on_step_end":
            self.driver.seam("step_end", self.logs)


@contextlib.contextmanager
def patched(module: Any, name: str, wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """`module.name` replaced by wrapper(original) for the duration (the trainer's thread reads it at call time)."""
    original = getattr(module, name)
    setattr(module, name, wrapper(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def generation_seam(driver: LoopDriver, captured: Captured) -> Callable[[Callable], Callable]:
    """unwrap_model_for_generation: the generation phase ends when the context exits (after ZeRO-3 has released
    the parameters it gathered); the unwrapped model's generate() calls are captured on the way."""

    def wrap(original: Callable) -> Callable:
        @contextlib.contextmanager
        def unwrap_model_for_generation(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with original(*args, **kwargs) as unwrapped:
                generate = getattr(unwrapped, "generate", None)  # GRPO's policy (PPO's wrapper has none)
                if generate is None:
                    yield unwrapped
                else:
                    def captured_generate(*g_args: Any, **g_kwargs: Any) -> Any:
                        out = generate(*g_args, **g_kwargs)
                        captured.add("generate", (g_args, g_kwargs, out))
                        return out

                    unwrapped.generate = captured_generate
                    try:
                        yield unwrapped
                    finally:
                        del unwrapped.generate  # the instance attribute: the class's generate again
            captured.generated = True
            driver.seam("generation_end")

        return unwrap_model_for_generation

    return wrap


def capture(captured: Captured, key: str, keep: Callable[[tuple, Any], Any] = lambda args, out: (args, out),
            when: Callable[[], bool] = lambda: True) -> Callable[[Callable], Callable]:
    """Keeps keep(args, result) of every call made while `when()` holds (only what is read: a kept tensor
    lives until the harness takes it, so nothing that carries an autograd graph or a large buffer is kept)."""

    def wrap(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if when():
                captured.add(key, keep(args, out))
            return out

        return call

    return wrap


def update_seam(driver: LoopDriver, captured: Captured, trained: Callable[[], Any]) -> Callable[[Callable], Callable]:
    """PPO's `forward`: its first call on the trained model (policy and value wrapper) after a generation is the
    update's start; the reference's forward (another model, or the policy inside it) is not."""

    def wrap(original: Callable) -> Callable:
        def forward(model: Any, *args: Any, **kwargs: Any) -> Any:
            if captured.generated and model is trained():
                captured.generated = False
                driver.seam("training_begin")
            return original(model, *args, **kwargs)

        return forward

    return wrap
