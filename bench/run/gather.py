"""How every rank's result reaches node 0 when a run spans nodes, with or without a shared filesystem.

Each rank writes its result into its own node's stage directory, as on one node. Over several nodes the ranks
also use torchrun's key-value store, the TCP store the agents share with the ranks (MASTER_ADDR:MASTER_PORT,
hosted by the agent of the rendezvous's first node, alive until every agent has ended):

- at start every rank posts where it runs (node, host, local rank, torchrun's group rank), and the collecting
  rank (node 0's local rank 0) reads them all, so a record can name the node of a rank that never reports;
- at the end every rank of another node posts its finished result, and the collecting rank waits for them
  (90 % of launcher.stall_s while its own run went well, COLLECT_AFTER_FAILURE_S after a failure, when the other
  nodes may be gone) and writes them beside its node's own rank files, where the launcher merges them.

Node 0's ranks write their files themselves: the collector waits only for other nodes' ranks.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bench.results.record import write_json

PREFIX = "rlhf_bench"
LAYOUT_WAIT_S = 120.0  # the ranks start together after the rendezvous; one that posts nothing by then is lost
COLLECT_AFTER_FAILURE_S = 30.0
POLL_S = 0.5
CONNECT_S = 30.0


def place(rank: int, local_rank: int, node: int) -> dict[str, Any]:
    """Where this rank runs (its entry in the record's node list)."""
    return {"rank": rank, "node": node, "host": socket.gethostname(), "local_rank": local_rank,
            "group_rank": int(os.environ.get("GROUP_RANK", node))}


class NodeStore:
    """The ranks' side of torchrun's store for one stage (keys under rlhf_bench/)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=CONNECT_S))

    def _ready(self, key: str) -> bool:
        return self.store.check([f"{PREFIX}/{key}"])

    def _read(self, key: str) -> dict[str, Any]:
        return json.loads(self.store.get(f"{PREFIX}/{key}").decode())

    def post(self, key: str, value: dict[str, Any]) -> None:
        self.store.set(f"{PREFIX}/{key}", json.dumps(value, default=str).encode())

    def wait_for(self, keys: list[str], seconds: float) -> dict[str, dict[str, Any]]:
        """Those of `keys` posted within `seconds` (the others are left out, not waited for longer)."""
        found: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + seconds
        while True:
            for key in keys:
                if key not in found and self._ready(key):
                    found[key] = self._read(key)
            if len(found) == len(keys) or time.monotonic() >= deadline:
                return found
            time.sleep(POLL_S)


def is_collector(node: int, local_rank: int) -> bool:
    return node == 0 and local_rank == 0


def post_place(store: NodeStore, entry: dict[str, Any]) -> None:
    store.post(f"place/{entry['rank']}", entry)


def read_places(store: NodeStore) -> list[dict[str, Any]]:
    """Every rank's place, by rank (ranks that posted none within LAYOUT_WAIT_S left out)."""
    found = store.wait_for([f"place/{r}" for r in range(store.world)], LAYOUT_WAIT_S)
    return sorted(found.values(), key=lambda e: e["rank"])


def post_result(store: NodeStore, result: dict[str, Any]) -> None:
    store.post(f"result/{result['rank']}", result)


def collect_results(store: NodeStore, places: list[dict[str, Any]], stage_dir: str, seconds: float) -> list[int]:
    """The results of other nodes' ranks, written into this node's stage directory as rank<N>.json; returns the
    remote ranks that posted none within `seconds`."""
    local = {e["rank"] for e in places if e["node"] == 0}
    remote = [r for r in range(store.world) if r not in local]
    found = store.wait_for([f"result/{r}" for r in remote], seconds)
    for result in found.values():
        write_json(os.path.join(stage_dir, f"rank{result['rank']}.json"), result)
    return [r for r in remote if f"result/{r}" not in found]


class NodeLink:
    """One rank's part in gathering a run over several nodes (nothing on one node)."""

    def __init__(self, nnodes: int, node: int, stall_s: float) -> None:
        self.nnodes, self.node, self.stall_s = nnodes, node, stall_s
        self.store: NodeStore | None = None
        self.entry: dict[str, Any] | None = None
        self.places: list[dict[str, Any]] = []

    def start(self, rank: int, world: int, local_rank: int, result: dict[str, Any]) -> None:
        """Posts this rank's place (in `result` too); the collector reads every rank's into result["places"].
        Raises where the store cannot be reached: the rank's run fails with the reason."""
        if self.nnodes == 1:
            return
        self.entry = place(rank, local_rank, self.node)
        result["place"] = self.entry
        self.store = NodeStore(world)
        post_place(self.store, self.entry)
        if is_collector(self.node, local_rank):
            self.places = read_places(self.store)
            result["places"] = self.places

    def finish(self, result: dict[str, Any], stage_dir: str) -> None:
        """Another node's rank posts its result; the collector waits for theirs and writes them here. A store
        that is gone (its agent's node died) costs those results, never this rank's own."""
        if self.store is None or self.entry is None:
            return
        try:
            if not is_collector(self.node, self.entry["local_rank"]):
                if self.node != 0:
                    post_result(self.store, result)
                return
            # within the rank's own stall watchdog (armed for stall_s just before)
            seconds = 0.9 * self.stall_s if result.get("status") == "ok" else COLLECT_AFTER_FAILURE_S
            missing = collect_results(self.store, self.places, stage_dir, seconds)
        except Exception as err:  # noqa: BLE001 -- the store died with a node; this rank's result still counts
            result.setdefault("notes", []).append(
                f"torchrun's store was unreachable when results were gathered ({type(err).__name__}: {err})")
            return
        if missing:
            result["unreported_ranks"] = missing
