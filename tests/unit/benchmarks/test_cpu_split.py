"""The CPU split's bookkeeping: roles by process name, CPU spent between two snapshots."""

from __future__ import annotations

import psutil
import pytest

from kvmesh.benchmarks import cpu_split


@pytest.mark.parametrize(
    "name, cmdline, want",
    [
        ("ray::ServeReplica:kvmesh:Engine", "", "engine replicas"),
        ("ray::ServeReplica:kvmesh:Ingress", "", "ingress replicas"),
        ("VLLM::EngineCore", "python -m vllm.entrypoints.openai.api_server", "bare vLLM servers"),
        ("python", "python -m vllm.entrypoints.openai.api_server --port 1", "bare vLLM servers"),
        ("vllm::router", "", "peer router"),
        ("ray::RouterRegistry", "", "other Ray workers"),  # kvmesh's own router registry is not a peer
        ("raylet", "/x/raylet --node", "Ray daemons"),
        ("ray::IDLE", "", "other Ray workers"),
        ("python", "python -m kvmesh.kvstore.lmcache_main --port 5", "LMCache server"),
        ("redis-server", "/usr/bin/redis-server --port 6999", "Redis"),
        ("sleep", "sleep 5", "sleep"),
    ],
)
def test_processes_are_grouped_by_role(name, cmdline, want):
    assert cpu_split.role(name, cmdline, client_pid=1, pid=2) == want
    assert cpu_split.role(name, cmdline, client_pid=2, pid=2) == "this process (client, driver)"


def test_cpu_between_counts_new_processes_from_zero_and_sums_roles():
    before = {1: ("a", 1.0), 2: ("b", 5.0)}
    after = {1: ("a", 1.5), 2: ("b", 7.0), 3: ("a", 0.25)}
    assert cpu_split.cpu_between(before, after) == {"a": 0.75, "b": 2.0}


def test_a_snapshot_includes_this_process():
    snap = cpu_split.cpu_by_pid(psutil.Process())
    me = psutil.Process().pid
    assert snap[me][0] == "this process (client, driver)" and snap[me][1] > 0


def test_unknown_setups_are_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cpu_split.main(["--setups", "kvmesh,sglang"])
    assert e.value.code == 2 and "sglang" in capsys.readouterr().err
