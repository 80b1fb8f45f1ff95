"""The CPU split's bookkeeping: roles by process name, CPU spent between two snapshots."""

from __future__ import annotations

import time

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


def test_a_thread_kvmesh_names_is_split_out_of_its_role():
    """The thread naming and the split together: a named thread's CPU shows under its own name."""
    import threading

    from kvmesh.cluster.thread_names import name_this_thread

    me = psutil.Process().pid
    stop = threading.Event()
    named = threading.Event()

    def spin() -> None:
        assert name_this_thread("kvmesh-test-spin-long-name")  # longer than the OS keeps
        named.set()
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        assert named.wait(5)
        before = cpu_split.thread_cpu(me, "engine replicas")
        deadline = time.monotonic() + 10
        while True:  # until the busy thread has spent measurable CPU (clock ticks), even on a loaded machine
            time.sleep(0.1)
            split = dict(
                cpu_split.by_thread(
                    cpu_split.cpu_between(before, cpu_split.thread_cpu(me, "engine replicas")), "engine replicas"
                )
            )
            if split.get("kvmesh-test-spi", 0) >= 0.1 or time.monotonic() > deadline:
                break
    finally:
        stop.set()
        t.join()
    assert "kvmesh-test-spi" in split  # the first 15 bytes
    assert split["kvmesh-test-spi"] >= 0.5 * max(split.values())


def test_the_thread_split_keeps_a_roles_own_threads_and_drops_small_ones():
    threads = {"engine replicas: kvmesh-step": 8.0, "engine replicas: ray::IDLE": 1.0, "engine replicas: tiny": 0.1}
    threads["ingress replicas: ray::IDLE"] = 5.0
    assert cpu_split.by_thread(threads, "engine replicas") == [("kvmesh-step", 8.0), ("ray::IDLE", 1.0)]
    assert cpu_split.by_thread(threads, "Serve controller") == []


def test_a_setup_that_answered_nothing_prints_n_a_instead_of_crashing():
    """The replay's summary has no hit rate or TTFT when every request failed: formatting None raised."""
    from kvmesh.benchmarks.cpu_split import format_run

    res = {
        "summary": {"hit_rate_tokens": None, "errors": 120, "ttft_p50_s": None},
        "wall_s": 30.0,
        "cpu_s": {"engine replicas": 10.0, "this process (client, driver)": 2.0},
        "thread_cpu_s": {},
    }
    first = format_run("kvmesh", res, 120).splitlines()[0]
    assert first.startswith("kvmesh: 120 requests in 30.0 s, hit n/a, errors 120, TTFT p50 n/a; CPU 12.0 s")
