"""Runs over several nodes, the arithmetic: a node's place (command line or SLURM), torchrun's command, the
record's node list. Every expectation is worked by hand from the inputs written here."""

from __future__ import annotations

import sys

import pytest

from bench.results.record import nodes, stage_record
from bench.run.config import compose
from bench.run.launcher import rendezvous_failure, torchrun_command
from bench.run.nodes import NodePlace, first_host, parse_endpoint, place
from bench.run.spec import SpecError, UnsupportedError, placed_launcher, spec_from_config

SLURM = {"SLURM_JOB_ID": "1234", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}


@pytest.mark.parametrize("nodelist, first", [
    ("vm", "vm"),
    ("gpu[07-09,12],cpu1", "gpu07"),  # a range keeps its zero padding, as `scontrol show hostnames` prints it
    ("a[3,1-2]-ib", "a3-ib"),  # the list's order, not the smallest number
    ("n1,n2", "n1"),
])
def test_the_first_host_of_a_slurm_host_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_an_empty_slurm_host_list_is_refused() -> None:
    with pytest.raises(SpecError, match="SLURM_JOB_NODELIST=''"):
        first_host("")


@pytest.mark.parametrize("value, host, port", [("node01:29400", "node01", 29400), ("[::1]:80", "[::1]", 80)])
def test_an_endpoint_is_host_and_port(value: str, host: str, port: int) -> None:
    assert parse_endpoint(value) == (host, port)


@pytest.mark.parametrize("value, message", [("node01", "must be HOST:PORT"), ("node01:70000", "port 70000"),
                                            ("node01:0", "port 0")])
def test_a_bad_endpoint_is_refused_by_name(value: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_endpoint(value)


def test_one_node_has_no_place_and_refuses_a_place_given() -> None:
    assert place(1, None, None, None, {}) is None
    assert place(1, 0, None, None, {}) is None
    with pytest.raises(SpecError, match="launcher.node_rank=1 places a node"):
        place(1, 1, None, None, {})


def test_under_slurm_the_job_places_the_node() -> None:
    # one agent per task: SLURM_PROCID 1; the first host gpu07; port 29400 + 1234 % 1000 = 29634
    assert place(2, None, None, None, SLURM) == NodePlace(1, "gpu07:29634", "slurm-1234", "SLURM")


def test_the_command_line_wins_over_slurm() -> None:
    assert place(2, 0, "head:29500", "mine", SLURM) == NodePlace(0, "head:29500", "mine", "command line")


def test_a_slurm_step_with_another_task_count_is_refused() -> None:
    with pytest.raises(SpecError, match="launcher.nnodes=3 but this SLURM step runs SLURM_NTASKS=2"):
        place(3, None, None, None, SLURM)


@pytest.mark.parametrize("given, message", [
    ({"node_rank": None, "endpoint": "h:1", "rdzv_id": "r"}, "needs launcher.node_rank"),
    ({"node_rank": 0, "endpoint": None, "rdzv_id": "r"}, "needs launcher.rdzv_endpoint"),
    ({"node_rank": 0, "endpoint": "h:1", "rdzv_id": None}, "needs launcher.rdzv_id"),
    ({"node_rank": 2, "endpoint": "h:1", "rdzv_id": "r"}, "launcher.node_rank=2 must be an integer from 0 to 1"),
    ({"node_rank": 0, "endpoint": "h:1", "rdzv_id": "a b"}, "launcher.rdzv_id='a b'"),
])
def test_outside_slurm_every_figure_of_the_place_is_asked_for(given: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        place(2, given["node_rank"], given["endpoint"], given["rdzv_id"], {})


def _two_node_spec(*overrides: str):
    return spec_from_config(compose(["launcher.nnodes=2", "launcher.node_rank=1", "launcher.rdzv_endpoint=h0:29400",
                                     "launcher.rdzv_id=run7", *overrides]))


def test_two_nodes_double_the_data_parallel_ranks() -> None:
    spec = _two_node_spec("framework=dschat", "stage=ppo", "launcher.nproc=2", "batch=3")
    assert (spec.launcher.world_size, spec.data_parallel, spec.effective_global_batch) == (4, 4, 12)


def test_stages_that_hand_a_checkpoint_on_are_refused_over_nodes() -> None:
    with pytest.raises(UnsupportedError, match="stage=pipeline with launcher.nnodes=2"):
        _two_node_spec("stage=pipeline")


def test_hostile_node_counts_are_refused() -> None:
    with pytest.raises(SpecError, match="launcher.nnodes=0"):
        placed_launcher({"nnodes": 0}, {})
    with pytest.raises(SpecError, match="launcher.rdzv_timeout_s=-1"):
        placed_launcher({"nnodes": 1, "rdzv_timeout_s": -1}, {})


def test_torchrun_meets_the_other_agents_at_the_endpoint() -> None:
    spec = _two_node_spec("framework=dschat", "stage=sft", "launcher.nproc=2", "launcher.rdzv_timeout_s=45")
    assert torchrun_command(spec, "/r/spec.json", "/r/sft", "sft", {}) == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=h0:29400", "--rdzv-id=run7-sft", "--max-restarts=0", "--rdzv-conf=join_timeout=45",
        "--nproc-per-node=2", "-m", "bench.run.worker", "/r/spec.json", "/r/sft", "sft"]


def test_one_node_stays_standalone() -> None:
    spec = spec_from_config(compose(["stage=sft"]))
    assert torchrun_command(spec, "s", "d", "sft", {})[3:6] == ["--standalone", "--nnodes=1", "--nproc-per-node=1"]


def test_a_failed_rendezvous_names_its_endpoint() -> None:
    spec = _two_node_spec("stage=sft", "launcher.rdzv_timeout_s=10")
    log = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n"
    failure = rendezvous_failure(spec, log)
    assert failure["error"]["phase"] == "rendezvous"
    assert "2 nodes at h0:29400 (id run7) failed (RendezvousTimeoutError) within launcher.rdzv_timeout_s=10" \
        in failure["error"]["message"]
    assert rendezvous_failure(spec, "a rank raised ValueError") is None


def _rank(rank: int, node: int, peaks: dict[str, int], **extra) -> dict:
    samples = [{"phase": p, "peak_bytes": b, "step": 0, "time_s": 1.0, "tokens": 8, "samples": 2}
               for p, b in peaks.items()]
    return {"rank": rank, "status": extra.pop("status", "ok"), "device": "cpu", "phase_samples": samples,
            "place": {"rank": rank, "node": node, "host": f"h{node}", "local_rank": rank % 2, "group_rank": node},
            **extra}


def test_each_node_lists_its_ranks_and_their_summed_host_memory() -> None:
    ranks = [_rank(0, 0, {"init": 100, "training": 300}), _rank(1, 0, {"init": 110, "training": 250}),
             _rank(2, 1, {"init": 90, "training": 400}), _rank(3, 1, {"init": 95, "training": 405})]
    found = nodes(ranks)
    assert [(n["node"], n["host"], n["ranks"]) for n in found] == [(0, "h0", [0, 1]), (1, "h1", [2, 3])]
    assert found[0]["host_peak_bytes"] == {"init": 210, "training": 550}
    assert found[1]["host_peak_bytes"] == {"init": 185, "training": 805}
    assert not any(n.get("why") for n in found)


def test_a_lost_node_is_named_with_its_ranks_and_why() -> None:
    # node 1's agent died: rank 2 was stopped by it (its result reached node 0), rank 3 wrote nothing; the
    # collector (rank 0) read every place at start
    places = [{"rank": r, "node": r // 2, "host": f"h{r // 2}", "local_rank": r % 2, "group_rank": r // 2}
              for r in range(4)]
    ranks = [_rank(0, 0, {"training": 1}, places=places, status="error",
                   error={"message": "Connection closed by peer", "phase": "training"}),
             _rank(1, 0, {"training": 1}),
             _rank(2, 1, {"training": 1}, status="error", error={"message": "cut short", "phase": "training"},
                   cut_short={"signal": "SIGTERM", "phase": "training", "steps_done": 3, "agent_ended": True})]
    failure = {"status": "error", "error": {"message": "1 of 4 ranks wrote no result", "phase": None}}
    record = stage_record("ppo", ranks, 0, 10.0, failure)
    lost = record.nodes[1]
    assert (lost["missing_ranks"], lost["agent_ended_ranks"]) == ([3], [2])
    why = ("node 1 (host h1): rank(s) [2] stopped when their torchrun agent ended; rank(s) [3] wrote no result "
           "that reached node 0")
    assert lost["why"] == why and record.error["nodes"] == [why]
    assert record.error["message"].startswith(why + ". Then: ")
    assert "why" not in record.nodes[0]


def test_one_node_records_no_node_list() -> None:
    assert nodes([{"rank": 0, "status": "ok", "phase_samples": []}]) == []


def test_the_report_lists_each_node_with_its_largest_host_peak() -> None:
    from bench.report.environment import nodes_rows

    mib = 2**20
    records = {"r1": {"stages": {"ppo": {"nodes": [
        {"node": 0, "host": "h0", "ranks": [0, 1], "host_peak_bytes": {"init": 100 * mib, "training": 300 * mib}},
        {"node": 1, "host": "h1", "ranks": [2, 3], "host_peak_bytes": {}, "why": "node 1 (host h1): lost"}]}}},
        "r0": {"stages": {"sft": {"nodes": []}}}}
    assert nodes_rows(records) == [["r1", "ppo", "0", "h0", "0 1", "300 (training)", "finished"],
                                   ["r1", "ppo", "1", "h1", "2 3", "-", "node 1 (host h1): lost"]]


def test_a_dry_run_checks_the_place_a_slurm_job_will_read() -> None:
    from bench.run.dry_run import check_cell

    slurm = ["hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2", "launcher.nnodes=2", "stage=sft"]
    assert check_cell(slurm).outcome == "run"
    assert "x 2 nodes" in check_cell(slurm).detail
    wrong = check_cell([*slurm, "hydra.launcher.tasks_per_node=2"])  # 4 tasks for 2 agents
    assert (wrong.outcome, "SLURM_NTASKS=4" in wrong.detail) == ("invalid", True)
    by_hand = check_cell(["launcher.nnodes=2", "stage=sft"])  # outside SLURM the place must be given
    assert (by_hand.outcome, "needs launcher.node_rank" in by_hand.detail) == ("invalid", True)
