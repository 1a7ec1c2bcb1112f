"""Where this process stands in a run over several nodes: its node rank, the rendezvous endpoint and id.

One node runs one `bench.run`, which starts one torchrun agent; the agents meet through torchrun's c10d
rendezvous. The three figures come from the command line (`launcher.node_rank`, `launcher.rdzv_endpoint`,
`launcher.rdzv_id`) or, under SLURM, from the job: one agent per SLURM task (SLURM_PROCID is the node rank,
SLURM_NTASKS must equal launcher.nnodes), the job's first host as endpoint, `slurm-<job id>` as id. A value given
on the command line wins over SLURM's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.run.spec import SpecError

# torch's own default rendezvous port; under SLURM the job id moves it (two jobs whose first node is the same
# host must not meet in one store)
RDZV_PORT = 29400
SLURM_PORT_SPREAD = 1000


@dataclass(frozen=True)
class NodePlace:
    node_rank: int
    rdzv_endpoint: str  # host:port
    rdzv_id: str
    source: str  # "command line" or "SLURM (...)": said in the record and in errors


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (`SLURM_JOB_NODELIST`): "gpu[07-09,12],cpu1" -> "gpu07", as
    `scontrol show hostnames` lists it (a range keeps its zero padding)."""
    text = nodelist.strip()
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", text)
    if not text or match is None or not match.group(0):
        raise SpecError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    if not first.isdigit():
        raise SpecError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read the range [{ranges}]")
    return prefix + first + suffix


def parse_endpoint(value: str) -> tuple[str, int]:
    """host:port (a bracketed IPv6 host allowed), with the port between 1 and 65535."""
    match = re.fullmatch(r"(\[[^\]]+\]|[^:\s]+):(\d+)", value.strip()) if isinstance(value, str) else None
    if match is None:
        raise SpecError(f"launcher.rdzv_endpoint={value!r} must be HOST:PORT, e.g. node01:29400")
    port = int(match.group(2))
    if not 1 <= port <= 65535:
        raise SpecError(f"launcher.rdzv_endpoint={value!r}: port {port} is not between 1 and 65535")
    return match.group(1), port


def _slurm_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise SpecError(f"{key}={env.get(key)!r}: SLURM set no integer there") from None


def place(nnodes: int, node_rank: int | None, endpoint: str | None, rdzv_id: str | None,
          env: Mapping[str, str]) -> NodePlace | None:
    """This node's place in a run over `nnodes` nodes (None for one node: torchrun --standalone)."""
    if nnodes == 1:
        for key, value in (("node_rank", node_rank), ("rdzv_endpoint", endpoint), ("rdzv_id", rdzv_id)):
            if value is not None and not (key == "node_rank" and value == 0):
                raise SpecError(f"launcher.{key}={value!r} places a node in a run over several nodes; "
                                "launcher.nnodes=1 runs on this node alone (set launcher.nnodes, or leave it null)")
        return None
    slurm = "SLURM_JOB_ID" in env and "SLURM_PROCID" in env
    if slurm:
        tasks = _slurm_int(env, "SLURM_NTASKS")
        if tasks != nnodes:
            raise SpecError(
                f"launcher.nnodes={nnodes} but this SLURM step runs SLURM_NTASKS={tasks} task(s): a run over nodes "
                "starts one torchrun agent per task (submitit: hydra.launcher.nodes=N with tasks_per_node=1; srun: "
                "--ntasks-per-node=1), each with launcher.nproc ranks")
    source = "command line"
    if node_rank is None:
        if not slurm:
            raise SpecError(f"launcher.nnodes={nnodes} needs launcher.node_rank (0 .. {nnodes - 1}) on each node "
                            "(SLURM sets it by itself: SLURM_PROCID)")
        node_rank, source = _slurm_int(env, "SLURM_PROCID"), "SLURM"
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise SpecError(f"launcher.node_rank={node_rank!r} must be an integer from 0 to {nnodes - 1} "
                        f"(launcher.nnodes={nnodes})")
    if endpoint is None:
        if not slurm:
            raise SpecError(f"launcher.nnodes={nnodes} needs launcher.rdzv_endpoint=HOST:PORT, the same on every "
                            "node (node 0's address is the usual choice)")
        job = _slurm_int(env, "SLURM_JOB_ID")
        endpoint = f"{first_host(env.get('SLURM_JOB_NODELIST', ''))}:{RDZV_PORT + job % SLURM_PORT_SPREAD}"
        source = "SLURM"
    parse_endpoint(endpoint)
    if rdzv_id is None:
        if not slurm:
            raise SpecError(f"launcher.nnodes={nnodes} needs launcher.rdzv_id, one name for the run, the same on "
                            "every node (it keeps two runs that share an endpoint apart)")
        rdzv_id = f"slurm-{_slurm_int(env, 'SLURM_JOB_ID')}"
    if not isinstance(rdzv_id, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", rdzv_id):
        raise SpecError(f"launcher.rdzv_id={rdzv_id!r} must be a name of letters, digits, '.', '_' or '-'")
    return NodePlace(node_rank, endpoint, rdzv_id, source)


def node_of(config: Mapping[str, Any]) -> int:
    """This process's node rank for a resolved run config (0 where it is invalid: the spec's check reports that)."""
    launcher = config.get("launcher") or {}
    try:
        found = place(launcher.get("nnodes", 1), launcher.get("node_rank"), launcher.get("rdzv_endpoint"),
                      launcher.get("rdzv_id"), os.environ)
    except (SpecError, TypeError):
        return 0
    return found.node_rank if found is not None else 0
