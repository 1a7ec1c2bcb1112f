"""One rank of one stage: `python -m bench.run.worker SPEC_JSON STAGE_DIR STAGE [--init-sft F] [--init-rm F]`.

Started by the launcher under torchrun. It never raises: every outcome, including an exception, ends in
this rank's `rank<N>.json` in STAGE_DIR, which the launcher merges into the run's record.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import torch

from adapters import registry
from adapters.base import RankContext
from bench.measure import jit_ops
from bench.measure.environment import environment
from bench.measure.memory import FLOOR_RULE
from bench.measure.native_half import emulated_half
from bench.measure.phases import PhaseTracker
from bench.results.record import write_json
from bench.run import jit_builds
from bench.run.data import SyntheticData
from bench.run.gather import NodeLink
from bench.run.loop import StageLoop, StepObserver
from bench.run.models import model_build_seconds
from bench.run.progress import ProgressFeed, feed_path
from bench.run.reward_stats import HeldoutStatistics, write_statistics
from bench.run.spec import RunSpec, UnsupportedError
from bench.run.step_log import WandbSteps
from bench.run.watchdog import RankWatchdog, stall_path

OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


# A rank told to stop (SIGTERM) has this long to write what it measured, whatever it is blocked in.
CUT_SHORT_GRACE_S = 60.0


class CutShort(BaseException):  # noqa: N818 -- not an error of the run: a signal from outside
    """SIGTERM arrived (the launcher's timeout, a cluster's pre-emption, torchrun's end): write what was
    measured, then exit."""


_watchdog: RankWatchdog | None = None
_agent_pid = os.getppid()  # torchrun's agent, this rank's parent
AGENT_GONE_WAIT_S = 2.0


def agent_ended(wait_s: float = AGENT_GONE_WAIT_S) -> bool:
    """Whether the SIGTERM that cut this rank short was the kernel's parent-death signal. It is sent when the
    thread that started the rank exits, which for a killed agent can be before the rest of its threads are gone
    and the rank is handed to a new parent, so the answer waits up to `wait_s` for that hand-over (a live agent
    stopping its ranks costs the wait, once)."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == _agent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _raise_cut_short(signum: int, _frame) -> None:
    signal.signal(signal.SIGTERM, _note_late_signal)  # a second one must not cut the record it is writing
    if _watchdog is not None:
        _watchdog.final(CUT_SHORT_GRACE_S, signal.Signals(signum).name)
    raise CutShort(f"cut short by {signal.Signals(signum).name}")


_late_signals: list[str] = []


def _note_late_signal(signum: int, _frame) -> None:
    """Once a rank is closing or already cut short, a SIGTERM (torchrun stopping the survivors of a rank that
    died, a second stop request) must not cost what it measured: it is noted, not raised."""
    _late_signals.append(signal.Signals(signum).name)


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UnsupportedError("launcher.device=cuda but torch.cuda.is_available() is False on this machine")
        if local_rank >= torch.cuda.device_count():
            raise UnsupportedError(
                f"local rank {local_rank} needs a GPU but only {torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


LOW_DISK_BYTES = 256 * 2**20


def low_disk_hint(path: str) -> str:
    """Names a nearly full disk in a failure's message: torch.save on a full disk fails with "unexpected pos
    ...", not with ENOSPC, and a sweep of large runs fills a disk with its saves."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    if free >= LOW_DISK_BYTES:
        return ""
    return f" [the disk holding {path} has {free / 2**20:.0f} MiB free: probably full]"


def classify(err: BaseException) -> str:
    if isinstance(err, UnsupportedError):
        return "unsupported"
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return "oom"
    if any(marker in str(err).lower() for marker in OOM_MARKERS):
        return "oom"
    return "error"


def run_rank(spec: RunSpec, stage: str, stage_dir: str, init: dict[str, str],
             watchdog: RankWatchdog | None = None, link: NodeLink | None = None) -> dict[str, Any]:
    """`watchdog`: told of each phase, JIT op load, the save and the close (its stall timer re-armed); `link`:
    this rank's part in gathering a run over several nodes (bench.run.gather)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(spec.launcher.threads_per_rank)
    result: dict[str, Any] = {"rank": rank, "world_size": world, "stage": stage, "status": "ok", "error": None,
                              "process_start_s": time.time() - psutil.Process().create_time()}
    tracker = None
    adapter = None
    loop = None
    observers: list[StepObserver] = []
    feed = ProgressFeed(feed_path(stage_dir)) if local_rank == 0 else None  # each node shows its progress
    try:
        if link is not None:
            link.start(rank, world, local_rank, result)
        device = resolve_device(spec.launcher.device, local_rank)
        tracker = PhaseTracker(device, spec.release_every)
        result.update(device=str(device), process_start_bytes=tracker.memory.current_bytes(),
                      memory_method=tracker.memory.method, memory_floor_rule=FLOOR_RULE,
                      time_method=tracker.time_method)
        if local_rank == 0:  # each node's host (one entry on one node)
            result["environment"] = environment(device.type, world)
        ctx = RankContext(rank=rank, world_size=world, local_rank=local_rank, device=device)
        if feed is not None:
            observers.append(feed)
        emulated = emulated_half(spec.precision, device.type)
        if emulated and feed is not None:
            feed.note(emulated)
        tracker.on_phase = _phase_listener(feed, watchdog)
        jit_ops.install(on_load=jit_listener(feed, watchdog))
        jit_builds.install(on_wait=lock_listener(feed, watchdog))
        # The engine libraries, their JIT ops and process groups: memory every run of this framework pays
        # before it builds a model. Growth is measured from here, so frameworks compare on their own work.
        with tracker.phase("imports"):
            adapter = registry.adapter_class(spec.framework)(spec, ctx)
        result["baseline_bytes"] = tracker.memory.current_bytes()
        result["data_parallel_rank"] = adapter.data_parallel_rank
        result["layout"] = adapter.layout()
        data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                             adapter.data_parallel_rank)
        if rank == 0 and spec.wandb != "off":
            observers.append(WandbSteps(spec, stage_dir, os.path.basename(os.path.dirname(stage_dir))))
        loop = StageLoop(adapter, spec, tracker, data, observers)
        result.update(loop.run(stage, init, os.path.join(stage_dir, "checkpoints")))
        _engine_facts(result, adapter, spec, stage, emulated)
        _save_or_stop(result, adapter, stage, stage_dir, rank, watchdog)
        result["outside_allocator"] = tracker.memory.outside_allocator()
    except BaseException as err:  # noqa: BLE001 -- every failure must become a record
        _record_failure(result, err, tracker, loop, stage_dir)
    finally:
        signal.signal(signal.SIGTERM, _note_late_signal)
        for observer in observers:  # after a failure too: wandb must close its run files
            observer.stop()
        if tracker is not None:
            result["phase_samples"] = tracker.samples
        result.update(model_build_s=model_build_seconds(), jit_ops_s=jit_ops.seconds())
        if adapter is not None and "cut_short" not in result:  # a cut-short rank must not wait on its peers
            _close(result, adapter, watchdog)
        if _late_signals:
            result.setdefault("notes", []).append(
                f"{', '.join(_late_signals)} arrived while the rank was closing or already stopping")
    return result


def _engine_facts(result: dict[str, Any], adapter: Any, spec: RunSpec, stage: str, emulated: str | None) -> None:
    """What the adapter reports of its engines once the stage ran: notes, upstream defects hit, dtypes, quantized
    roles and the knobs as the engines resolved them."""
    result["notes"] = adapter.notes() + ([emulated] if emulated else [])
    result["upstream_defects"] = adapter.upstream_defects()
    result["computation_dtypes"] = adapter.computation_dtypes()
    result["quantized"] = adapter.quantized_roles()
    result["engine_knobs"] = adapter.engine_knobs()
    if stage == "ppo":  # the passes over each step's rollouts, which the report's per-pass rates divide by
        result["update_passes"] = adapter.update_passes()
        # the prompt batches a step generates, scores and trains on: the samples of the step's rate
        result["rollouts_per_step"] = adapter.rollouts_per_step()
    # micro-batches and optimizer steps as the engines counted them (a PPO step's count is the framework's)
    if spec.grad_accum > 1 or stage == "ppo":
        result["engine_knobs"]["accumulation"] = adapter.accumulation()
    if spec.lora:  # which layers the built models adapt, with which alpha
        result["engine_knobs"]["lora"] = adapter.lora_knobs()
    if adapter.reward_scaling is not None:  # what PPO's make_experience did to the RM's scores
        result["engine_knobs"]["reward_normalize"] = adapter.reward_scaling.knob()


def _save_or_stop(result: dict[str, Any], adapter: Any, stage: str, stage_dir: str, rank: int,
                  watchdog: RankWatchdog | None) -> None:
    """A diverged stage is a `nan` with its reason and saves nothing; otherwise the stage's checkpoint, timed."""
    stability = result["stability"]
    if result.pop("diverged_any_rank"):  # every rank skips the save together (it is collective)
        result["status"] = "nan"
        reason = stability["aborted"] or (
            f"non-finite {stability['first_nonfinite_metric']} from step {stability['first_nonfinite_step']}"
            if stability["classification"] == "diverged" else "another rank diverged"
        )
        result["error"] = {"message": reason, "phase": "training"}
        return
    if watchdog is not None:
        watchdog.beat("the save began")
    start = time.perf_counter()
    result["checkpoint"] = adapter.save(stage, os.path.join(stage_dir, "checkpoint"))
    result["save_s"] = time.perf_counter() - start
    heldout = result["learning"].get("heldout_scores")
    if heldout is not None and result["checkpoint"] and rank == 0:  # beside the file init.rm will name
        write_statistics(HeldoutStatistics(**heldout), result["checkpoint"])


def _record_failure(result: dict[str, Any], err: BaseException, tracker: PhaseTracker | None, loop: Any,
                    stage_dir: str) -> None:
    """A failure as the record states it: its status, message, phase and traceback; a cut-short stage keeps the
    steps it finished."""
    result["status"] = classify(err)
    phase = tracker.current_phase if tracker is not None else "startup"
    result["error"] = {"message": f"{type(err).__name__}: {err}{low_disk_hint(stage_dir)}", "phase": phase,
                       "traceback": traceback.format_exc(limit=20)}
    if isinstance(err, CutShort):
        result["cut_short"] = {"signal": "SIGTERM", "phase": phase, "steps_done": len(loop.steps) if loop else 0,
                               # the kernel's parent-death signal: the node's torchrun agent died
                               "agent_ended": agent_ended()}
        if loop is not None:
            result.update(loop.partial())
    print(result["error"]["traceback"], file=sys.stderr)


def _close(result: dict[str, Any], adapter: Any, watchdog: RankWatchdog | None) -> None:
    """The adapter's close, timed; a failing close is a note, never the run's outcome."""
    if watchdog is not None:
        watchdog.beat("the close began")
    start = time.perf_counter()
    try:
        adapter.close()
    except Exception as err:  # noqa: BLE001 -- closing must not hide the run's own outcome
        result.setdefault("notes", []).append(f"close failed: {err}")
    result["close_s"] = time.perf_counter() - start


def _phase_listener(feed: ProgressFeed | None, watchdog: RankWatchdog | None) -> Callable[[str, int | None], None]:
    def started(name: str, step: int | None) -> None:
        if feed is not None:
            feed.phase(name)
        if watchdog is not None:
            watchdog.beat(f"phase {name!r}" + (f" of step {step}" if step is not None else "") + " began")

    return started


def jit_listener(feed: ProgressFeed | None, watchdog: RankWatchdog | None) -> Callable[[str], None]:
    def loading(name: str) -> None:
        if feed is not None:
            feed.jit_op(name)
        if watchdog is not None:
            watchdog.beat(f"JIT op {name} began loading")

    return loading


def lock_listener(feed: ProgressFeed | None, watchdog: RankWatchdog | None) -> Callable[[str, str], None]:
    """A wait for another process's JIT build: shown, and the watchdog re-armed with the lock named, so a wait
    that never ends is reported with the file it waits on."""
    def waiting(lock: str, why: str) -> None:
        note = jit_builds.waiting_note(lock, why)
        if feed is not None:
            feed.note(note)
        if watchdog is not None:
            watchdog.beat(note)

    return waiting


def main(argv: list[str] | None = None) -> int:
    global _watchdog
    faulthandler.enable()
    signal.signal(signal.SIGTERM, _raise_cut_short)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec")
    parser.add_argument("stage_dir")
    parser.add_argument("stage")
    parser.add_argument("--init-sft")
    parser.add_argument("--init-rm")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = RunSpec.from_dict(json.load(f))
    init = {k: v for k, v in (("sft", args.init_sft), ("rm", args.init_rm)) if v}
    _watchdog = RankWatchdog(stall_path(args.stage_dir, int(os.environ.get("RANK", 0))), int(os.environ.get("RANK", 0)),
                             spec.launcher.stall_s)
    _watchdog.watch_parent()
    link = NodeLink(spec.launcher.nnodes, spec.launcher.node, spec.launcher.stall_s)
    result = run_rank(spec, args.stage, args.stage_dir, init, _watchdog, link)
    result["lifetime_s"] = time.time() - psutil.Process().create_time()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what was measured is written whatever arrives now
    _watchdog.beat("the results of other nodes' ranks are gathered")
    link.finish(result, args.stage_dir)
    write_json(os.path.join(args.stage_dir, f"rank{result['rank']}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
