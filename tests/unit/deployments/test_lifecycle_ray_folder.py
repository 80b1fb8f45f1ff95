"""A local run's Ray keeps its files (its sockets among them) in a new 0700 folder of the run's, not in the
shared /tmp/ray, whose sessions' `sockets` folders any local user may enter and rename files in; the folder
goes when Ray is shut down, when its start fails or is interrupted, and (for a run killed outright) at the
next start. Ray itself is faked: `ray.init` records what it was asked."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import pytest

# Ray's longest socket path below its temp folder: a session folder (session_<date>_<micros>_<pid>) and the
# object store's socket; a unix socket path must fit in 107 bytes
SESSION = "session_2026-12-06_01-31-12_579123_4194304"
UNIX_PATH_MAX = 107


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init records its keywords and brings a fake cluster up; nothing starts."""
    import ray
    from ray import serve

    from kvmesh.deployments import app, deploy_watch, process_tree
    from kvmesh.kvstore import node_server

    state = {"up": False, "init": {}, "init_error": None}
    monkeypatch.delenv("RAY_TMPDIR", raising=False)  # the caller's own folder: a case of its own below

    def init(**kw):
        state["init"] = kw
        if kw.get("_temp_dir"):  # as Ray does: the folder it is given becomes open to all
            os.makedirs(kw["_temp_dir"], exist_ok=True)
            os.chmod(kw["_temp_dir"], 0o777)
        if state["init_error"]:
            raise state["init_error"]
        state["up"] = True

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "shutdown", lambda: state.__setitem__("up", False))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(node_server, "stop_node_servers", lambda: 0)
    monkeypatch.setattr(deploy_watch, "deploy_or_explain", lambda built, cfg: None)
    monkeypatch.setattr(app, "build_app", lambda cfg: None)
    monkeypatch.setattr(app, "check_serve_contract", lambda: None)  # it reads the real ray.init's source
    monkeypatch.setattr(app, "_wait_ready", lambda cfg, timeout_s: None)
    monkeypatch.setattr(process_tree, "end_descendants", lambda **kw: [])
    saved = dict(os.environ)  # a start exports its secrets' and proxy's settings for Ray's processes
    yield state
    os.environ.clear()
    os.environ.update(saved)


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _run_folder(ray_folder: str) -> str:
    """The run's own folder, /tmp/kvmesh-ray-<pid>-*, that holds (or is) the one Ray was given."""
    path = ray_folder
    while not os.path.basename(path).startswith("kvmesh-ray-") and path != "/":
        path = os.path.dirname(path)
    assert path != "/", f"Ray's folder {ray_folder} is not inside a run's private folder"
    return path


def test_ray_keeps_its_files_in_a_private_folder_of_the_run_removed_at_the_stop(fake_ray):
    from kvmesh.deployments.app import start_local, stop_local

    start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    ray_folder = fake_ray["init"].get("_temp_dir")
    assert ray_folder, "Ray kept its files in the shared /tmp/ray"
    folder = _run_folder(ray_folder)
    st = os.lstat(folder)
    # no other user may enter it, whatever Ray makes of the folders inside
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert os.path.basename(folder).startswith(f"kvmesh-ray-{os.getpid()}-")
    assert len(os.path.join(ray_folder, SESSION, "sockets", "plasma_store")) <= UNIX_PATH_MAX
    stop_local(drain=False)
    assert not os.path.exists(folder), "the run's Ray folder outlived its stop"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(143), RuntimeError("raylet died")])
def test_a_ray_start_that_failed_or_was_interrupted_leaves_no_folder(fake_ray, monkeypatch, interrupt):
    from kvmesh.deployments import process_tree
    from kvmesh.deployments.local_ray import start_local_ray

    ended = []
    monkeypatch.setattr(process_tree, "end_descendants", lambda **kw: ended.append(kw) or [])
    fake_ray["init_error"] = interrupt
    with pytest.raises(type(interrupt)):
        start_local_ray(num_cpus=1, env_vars={}, log_to_driver=False)
    folder = _run_folder(fake_ray["init"]["_temp_dir"])
    assert not os.path.exists(folder), "an interrupted start left its Ray folder"
    assert ended, "the processes the failed start left were not ended"


def test_the_ray_folders_of_runs_whose_process_is_gone_are_removed_at_the_next_start(fake_ray):
    from kvmesh.deployments.local_ray import remove_ray_temp_dir, start_local_ray

    dead = tempfile.mkdtemp(prefix=f"kvmesh-ray-{_dead_pid()}-", dir="/tmp")
    live = tempfile.mkdtemp(prefix=f"kvmesh-ray-{os.getppid()}-", dir="/tmp")  # a live run's: kept
    try:
        start_local_ray(num_cpus=1, env_vars={}, log_to_driver=False)
        remove_ray_temp_dir()
        assert not os.path.exists(dead), "a killed run's Ray folder was never removed"
        assert os.path.exists(live)
    finally:
        for path in (dead, live):
            if os.path.exists(path):
                os.rmdir(path)


def test_a_ray_folder_the_caller_names_in_ray_tmpdir_is_kept(fake_ray, monkeypatch, tmp_path):
    """RAY_TMPDIR is Ray's own variable for where its files go: the caller's choice (the tests' and
    benchmarks' private folders, whose logs they read), so Ray is given no folder of kvmesh's."""
    from kvmesh.deployments.app import start_local, stop_local

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    assert "_temp_dir" not in fake_ray["init"]
    stop_local(drain=False)
    assert tmp_path.is_dir()


def test_a_start_that_failed_keeps_its_ray_logs_and_names_them(fake_ray, monkeypatch, caplog):
    """Serve's and the replicas' log lines go to Ray's log files only: removed with the folder, a failed
    deploy left no record of why."""
    import shutil

    from kvmesh.deployments import app, deploy_watch

    def refuse(built, cfg):
        raise RuntimeError("replica constructor raised (see its log)")

    monkeypatch.setattr(deploy_watch, "deploy_or_explain", refuse)
    with caplog.at_level("WARNING", logger=app.log.name), pytest.raises(RuntimeError):
        app.start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    folder = _run_folder(fake_ray["init"]["_temp_dir"])
    try:
        assert os.path.isdir(folder), "the failed start's Ray logs were removed with its folder"
        assert folder in caplog.text
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_failed_ray_start_puts_the_callers_signal_handlers_back(fake_ray, monkeypatch):
    """Ray sets its own SIGTERM handler as ray.init starts: left after a failure, a later SIGTERM exited with
    Ray's status instead of unwinding the caller's clean-up (make bench took it for one bench's verdict)."""
    import signal

    import ray

    from kvmesh.deployments import app

    def init(**kw):
        signal.signal(signal.SIGTERM, lambda *a: None)  # as Ray's ray.init does first
        raise RuntimeError("raylet died")

    mine = lambda *a: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, mine)
    monkeypatch.setattr(ray, "init", init)
    try:
        with pytest.raises(RuntimeError):
            app.start_local({"replicas": 1, "port": 0, "proxy": "serve"})
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("status", [1, 15])
def test_a_sigterm_that_rays_own_handler_took_during_ray_init_is_a_stop(fake_ray, monkeypatch, status):
    """ray.init replaces the SIGTERM handler (its driver's exits with 15, its node's with 1 after ending its
    processes): a stop signal during the start exited 1 and was reported as a failed start, not the 143 of
    every other stop."""
    import signal

    import ray

    from kvmesh.deployments.local_ray import start_local_ray
    from kvmesh.deployments.process_tree import Terminated, handlers_put_back

    def init_stopped(**kw):
        fake_ray["init"] = kw
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(status))  # as Ray's handlers do
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs in this thread between two bytecodes
            pass
        pytest.fail("the SIGTERM never reached Ray's handler")

    monkeypatch.setattr(ray, "init", init_stopped)
    with handlers_put_back(signal.SIGTERM), pytest.raises(SystemExit) as info:
        start_local_ray(num_cpus=1, env_vars={}, log_to_driver=False)
    assert isinstance(info.value, Terminated) and info.value.code == 143


def test_ray_inits_own_exit_without_a_signal_stays_what_it_was(fake_ray):
    from kvmesh.deployments.local_ray import start_local_ray
    from kvmesh.deployments.process_tree import Terminated

    fake_ray["init_error"] = SystemExit(1)
    with pytest.raises(SystemExit) as info:
        start_local_ray(num_cpus=1, env_vars={}, log_to_driver=False)
    assert not isinstance(info.value, Terminated) and info.value.code == 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), SystemExit(143)])
def test_a_start_a_stop_signal_ended_keeps_no_logs_and_says_none_are_kept(fake_ray, monkeypatch, caplog, stop):
    """Only a start that failed has logs worth keeping: one interrupted by Ctrl-C or SIGTERM said its logs were
    kept in a folder, which then stayed behind."""
    from kvmesh.deployments import app, deploy_watch
    from kvmesh.deployments.process_tree import Terminated

    if isinstance(stop, SystemExit):
        stop = Terminated(143)

    def stopped(built, cfg):
        raise stop

    monkeypatch.setattr(deploy_watch, "deploy_or_explain", stopped)
    with caplog.at_level("WARNING", logger=app.log.name), pytest.raises(type(stop)):
        app.start_local({"replicas": 1, "port": 0, "proxy": "serve"})
    folder = _run_folder(fake_ray["init"]["_temp_dir"])
    assert not os.path.exists(folder), "an interrupted start left its Ray folder"
    assert "kept" not in caplog.text
