"""A stop signal at any moment of a local run unwinds through its clean-up: every `kvmesh` command turns
SIGTERM into SystemExit (Python's default ends the process without running a `finally`), the handlers a
start had before `ray.init` are back after it (Ray replaces SIGTERM's), `kvmesh serve`'s driver stops on
SIGHUP and SIGTERM while the app still starts, a start interrupted before Ray ran leaves no HAProxy
folder, the stop ends a deploy still waiting in `serve.run` before Ray is shut down (its next Ray call would
start a second cluster), and `make bench` stops at a SIGTERM rather than taking it as one bench's verdict.
Ray and Serve are faked."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from kvmesh.deployments.deploy_watch import deploy_or_explain


@pytest.fixture
def handlers_kept():
    """This test process's stop-signal handlers, put back afterwards whatever the test set."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _run_until_signalled(command_run: str) -> subprocess.CompletedProcess:
    """`kvmesh model` (any command would do) whose run sends this process SIGTERM while inside a `try`."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        from kvmesh.deployments import cli
        from kvmesh.deployments.cli import model

        def run(args):
            try:
                {command_run}
            finally:
                print("cleaned up", flush=True)

        model.run = run
        sys.exit(cli.main(["model", "build-tiny", "unused-dir"]))
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_every_command_unwinds_through_its_clean_up_on_sigterm():
    done = _run_until_signalled("os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    assert "cleaned up" in done.stdout, f"SIGTERM skipped the command's clean-up (status {done.returncode})"
    assert done.returncode == 128 + signal.SIGTERM


def test_a_second_sigterm_does_not_cut_the_clean_up_short():
    from kvmesh.deployments.process_tree import Terminated, exit_on_sigterm

    previous = exit_on_sigterm()
    try:
        with pytest.raises(Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert info.value.code == 128 + signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # during the clean-up: ignored
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def test_the_handlers_a_start_had_before_ray_init_are_back_after_it(home, fake_ray, handlers_kept):
    from kvmesh.deployments.app import start_local, stop_local

    def ours(signum, frame):
        raise SystemExit(143)

    def rays(signum, frame):  # what ray.init leaves: Ray's own handler
        pass

    signal.signal(signal.SIGTERM, ours)
    fake_ray["on_ray_start"] = lambda: signal.signal(signal.SIGTERM, rays)
    start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    try:
        assert signal.getsignal(signal.SIGTERM) is ours, "after ray.init a SIGTERM skips the caller's clean-up"
    finally:
        stop_local(drain=False)


def test_handlers_put_back_restores_each_signals_handler_however_the_block_ends(handlers_kept):
    from kvmesh.deployments.process_tree import handlers_put_back

    def term(signum, frame):
        pass

    def intr(signum, frame):
        pass

    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGINT, intr)
    with pytest.raises(RuntimeError), handlers_put_back(signal.SIGTERM, signal.SIGINT):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        raise RuntimeError("the block failed")
    assert signal.getsignal(signal.SIGTERM) is term and signal.getsignal(signal.SIGINT) is intr
    failed = []

    def off_main_thread():  # where handlers cannot be set: nothing to save or put back, and no error
        try:
            with handlers_put_back(signal.SIGTERM):
                pass
        except Exception as exc:
            failed.append(exc)

    worker = threading.Thread(target=off_main_thread)
    worker.start()
    worker.join()
    assert not failed and signal.getsignal(signal.SIGTERM) is term


def test_a_start_keeps_its_handlers_around_ray_init_through_process_trees_helper(home, fake_ray, monkeypatch):
    """One way to put stop-signal handlers back (process_tree.handlers_put_back), which the start uses."""
    from kvmesh.deployments import app, process_tree

    real = process_tree.handlers_put_back
    kept = []

    def recording(*signals, **kw):
        kept.append(signals)
        return real(*signals, **kw)

    monkeypatch.setattr(process_tree, "handlers_put_back", recording)
    fake_ray["on_ray_start"] = lambda: kept.append("ray started")
    app.start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    try:
        assert kept == [(signal.SIGTERM, signal.SIGINT), "ray started"]
    finally:
        app.stop_local(drain=False)


def test_a_start_interrupted_before_ray_ran_leaves_no_haproxy_folder(home, fake_ray):
    from kvmesh.deployments import app

    def interrupted():
        raise KeyboardInterrupt

    fake_ray["on_ray_start"] = interrupted
    saved = dict(os.environ)
    made = []
    real = app._proxy_env
    try:
        app._proxy_env = lambda proxy: made.append(real(proxy)) or made[-1]  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            app.start_local({"replicas": 1, "port": 0, "proxy": "haproxy"})
    finally:
        app._proxy_env = real  # type: ignore[assignment]
        os.environ.clear()
        os.environ.update(saved)
    run = os.path.dirname(made[0]["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"])
    assert not os.path.exists(run), "the interrupted start left its HAProxy folder"
    assert app._haproxy_dir is None
    app.stop_local(drain=False)


def _driver_args():
    from kvmesh.deployments.cli import serve as serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    args = parser.parse_args(["--port", "0", "--proxy", "serve"])
    return serve_cmd, args, serve_cmd._build_config(args)


def test_the_driver_stopped_by_sigterm_while_the_app_starts_stops_what_it_started(home, fake_ray, monkeypatch):
    from kvmesh.deployments import app

    serve_cmd, args, cfg = _driver_args()
    stops = []
    monkeypatch.setattr(app, "start_local", lambda *a, **kw: (_ for _ in ()).throw(SystemExit(143)))
    monkeypatch.setattr(app, "stop_local", lambda drain=True: stops.append(drain))
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit):
        serve_cmd._drive(args, cfg)
    assert stops, "a stop signal during the start skipped stop_local"


def test_the_driver_whose_relay_dies_while_the_app_starts_stops_at_once(home, fake_ray, monkeypatch, handlers_kept):
    """The relay SIGKILLed during the start: the kernel sends the driver SIGHUP, which must end it now, with
    its processes and files, rather than kill it outright (Python's default) or wait for the start."""
    from kvmesh.deployments import app, process_tree

    serve_cmd, args, cfg = _driver_args()
    unhandled = []
    signal.signal(signal.SIGHUP, lambda signum, frame: unhandled.append(signum))  # what the default would be
    ended = []
    monkeypatch.setattr(process_tree, "end_descendants", lambda **kw: ended.append(kw) or [])

    # without a handler of its own during the start, the driver would only stop at this later SIGTERM
    later = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))

    def relay_dies(*a, **kw):
        os.kill(os.getpid(), signal.SIGHUP)
        later.start()
        time.sleep(0.5)
        return "http://127.0.0.1:1"

    def exit_now(status):
        raise SystemExit(status)

    monkeypatch.setattr(app, "start_local", relay_dies)
    monkeypatch.setattr(app, "stop_local", lambda drain=True: None)
    monkeypatch.setattr(os, "_exit", exit_now)
    try:
        with pytest.raises(SystemExit):
            serve_cmd._drive(args, cfg)
    finally:
        later.cancel()
    assert not unhandled, "SIGHUP during the start had no handler of the driver's"
    assert ended, "the fast stop did not end the processes below the driver"


def test_the_stop_ends_a_deploy_still_in_serve_run_before_ray_is_shut_down(home, fake_ray, monkeypatch):
    """A start that failed while serve.run waited (a deployment Serve cannot place, a stop signal): once Ray
    is shut down, serve.run's next Ray call would start a second cluster with Ray's defaults."""
    from ray import serve
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    from kvmesh.deployments import app, deploy_watch

    monkeypatch.setattr(deploy_watch, "deploy_or_explain", deploy_or_explain)
    second_cluster = []

    def waiting_run(*a, **kw):  # Serve's wait for the app to run: it polls the controller every second
        for _ in range(100):
            time.sleep(0.05)
            if not fake_ray["up"]:
                second_cluster.append("ray.init from the deploy thread")
                return

    message = (
        "Deployment 'EngineReplica' in application 'kvmesh' has 1 replicas that have taken more than 30s to be "
        "scheduled. Resources required for each replica: {'CPU': 8.0}, total resources available: {'CPU': 1.0}."
    )
    dep = DeploymentStatusOverview(
        status="UPDATING", status_trigger="CONFIG_UPDATE_STARTED", replica_states={}, message=message
    )
    status = ServeStatus(
        applications={
            "kvmesh": ApplicationStatusOverview(
                status="DEPLOYING", message="", last_deployed_time_s=0.0, deployments={"EngineReplica": dep}
            )
        }
    )
    monkeypatch.setattr(serve, "run", waiting_run)
    monkeypatch.setattr(serve, "status", lambda: status)
    with pytest.raises(deploy_watch.DeploymentUnschedulable):
        app.start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    time.sleep(0.5)
    assert fake_ray["calls"] == ["ray down"]
    assert not second_cluster, "the deploy thread went on after Ray was shut down"
    assert not [t for t in threading.enumerate() if t.name == "kvmesh-deploy"]


def test_make_bench_stops_at_a_sigterm_instead_of_taking_it_as_a_verdict(monkeypatch, handlers_kept):
    from kvmesh.benchmarks import run_all

    ran = []

    def bench_main():
        ran.append("first")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    def verdict():
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, lambda signum, frame: verdict())  # as a SIGTERM once raised SystemExit
    fakes = {"bench_a": bench_main, "bench_b": lambda: ran.append("second")}
    for name, main in fakes.items():
        monkeypatch.setitem(sys.modules, f"kvmesh.benchmarks.{name}", types.SimpleNamespace(main=main))
    monkeypatch.setattr(run_all.pkgutil, "iter_modules", lambda path: [types.SimpleNamespace(name=n) for n in fakes])
    with pytest.raises(SystemExit) as info:
        run_all.main([])
    assert info.value.code == 128 + signal.SIGTERM and ran == ["first"], "a stopped run went on to the next bench"


def test_make_bench_and_every_command_put_the_callers_sigterm_handler_back(handlers_kept):
    """Tests call them in their own process: a handler left behind raised in pytest at the next SIGTERM, then
    ignored every later one, and children started afterwards inherited SIGTERM ignored."""
    from kvmesh.benchmarks import run_all
    from kvmesh.deployments.cli import main

    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGTERM, mine)
    assert run_all.main(["no-such-bench"]) == 2
    assert signal.getsignal(signal.SIGTERM) is mine
    assert main(["simulate", "--no-such-flag"]) == 2
    assert signal.getsignal(signal.SIGTERM) is mine
