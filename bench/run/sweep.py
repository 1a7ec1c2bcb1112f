"""What a sweep adds around one run: skip-if-done, the out-of-memory back-stop, and never aborting.

A sweep directory holds one sub-directory per cell (Hydra's override_dirname), each with its
record.json. Re-running the same sweep (`sweep_name=<dir>`) skips every cell whose record is finished;
`force=true` re-runs them. Two sweeps over one directory at once run each cell once: a cell is claimed
while it runs, and the other sweep leaves it. When a cell ran out of memory at batch N, the cells that
differ from it only by a larger batch are recorded as skipped instead of run.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.results.collect import BOOKKEEPING_KEYS, flatten

# Keys that do not change what a run measures: two configs that differ only here are the same cell.
NOT_MEASURED = tuple(k for k in BOOKKEEPING_KEYS if k != "seed")


def cell_key(config: dict[str, Any], without: tuple[str, ...] = ()) -> str:
    """A canonical string of everything a run measures, less `without`."""
    flat = {k: v for k, v in flatten(config).items() if k not in NOT_MEASURED + without}
    return json.dumps(flat, sort_keys=True, default=str)


# What a cell returns to the sweep when another process holds it (two sweeps over one directory).
ELSEWHERE = "running-elsewhere"
CLAIM_FILE = ".claim.lock"


@contextmanager
def claim_cell(run_dir: str, node: int = 0) -> Iterator[bool]:
    """Hold a cell for the duration of its run; yields False when another process holds it. Two sweeps
    over the same directory then run each cell once. flock, so the claim dies with its holder (SIGKILL too).
    A run over several nodes claims a cell once per node: each node's process runs its part."""
    os.makedirs(run_dir, exist_ok=True)
    name = CLAIM_FILE if node == 0 else CLAIM_FILE.replace(".lock", f"-node{node}.lock")
    with open(os.path.join(run_dir, name), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def read_record(path: str) -> dict[str, Any] | None:
    """The record at `path`, or None when it is missing or unreadable (a sweep re-runs such a cell)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def finished(path: str) -> dict[str, Any] | None:
    """The record at `path` if its run finished (the last write sets finished_utc), else None."""
    record = read_record(path)
    return record if record is not None and record.get("finished_utc") else None


def oom_backstop(config: dict[str, Any], sweep_dir: str, own_dir: str) -> int | None:
    """The smallest batch at which this cell's configuration ran out of memory, if smaller than its own."""
    mine = cell_key(config, ("batch",))
    smallest = None
    for path in glob.glob(os.path.join(glob.escape(sweep_dir), "**", "record.json"), recursive=True):
        if os.path.abspath(os.path.dirname(path)) == os.path.abspath(own_dir):
            continue
        record = read_record(path)
        if record is None or record.get("status") != "oom" or not isinstance(record.get("config"), dict):
            continue
        batch = record["config"].get("batch")
        if isinstance(batch, int) and batch < config["batch"] and cell_key(record["config"], ("batch",)) == mine:
            smallest = batch if smallest is None else min(smallest, batch)
    return smallest
