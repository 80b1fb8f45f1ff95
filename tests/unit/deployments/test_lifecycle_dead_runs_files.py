"""What a local run killed outright (SIGKILL, a second Ctrl-C) could not remove is removed by whoever comes
next: its secret files under KVMESH_HOME/run (named after their owner's pid) at the next start, and every
leftover of a dead run (secret files, replicas' and LMCache servers' folders, HAProxy and Ray folders) by
`kvmesh serve`'s relay once its driver exited and by the driver's fast stop after its relay died. Ray and
Serve are faked: nothing starts."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

import pytest


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _leftovers(home, pid: int) -> list[str]:
    """A dead run's secret files and the private folders of its processes (all named after `pid`)."""
    run = home / "run"
    run.mkdir(parents=True, exist_ok=True, mode=0o700)
    from kvmesh.kvstore.private_dir import owner_tag

    tag = owner_tag()
    paths = [str(run / f"channel-secret-{pid}-{tag}-0a1b2c3d"), str(run / f"salt-secret-{pid}-{tag}-99aa88bb")]
    for path in paths:
        with open(path, "w") as fh:
            fh.write("s" * 64)
    for prefix in ("kvmesh-engine-", "kvmesh-lmcache-", "kvmesh-ray-"):
        paths.append(tempfile.mkdtemp(prefix=f"{prefix}{pid}-", dir="/tmp"))
    return paths


def test_a_runs_secret_files_are_named_after_it_and_only_dead_owners_files_are_removed(tmp_path):
    from kvmesh.cluster.secure_channel import remove_dead_owners_secret_files, write_channel_secret
    from kvmesh.kvstore.private_dir import owner_tag

    mine = write_channel_secret(tmp_path)
    assert mine.name.startswith(f"channel-secret-{os.getpid()}-{owner_tag()}-")
    dead = _dead_pid()
    orphan = tmp_path / f"salt-secret-{dead}-{owner_tag()}-0123abcd"
    unowned = tmp_path / "channel-secret-0123abcd"  # an older run's, without an owner: not ours to judge
    other = tmp_path / f"notes-{dead}"
    for path in (orphan, unowned, other):
        path.write_text("x")
    assert remove_dead_owners_secret_files(tmp_path) == 1
    assert mine.exists() and unowned.exists() and other.exists() and not orphan.exists()
    assert remove_dead_owners_secret_files(tmp_path / "missing") == 0


def test_a_start_removes_the_secret_files_of_runs_killed_before_they_could(home, fake_ray):
    from kvmesh.deployments.app import start_local, stop_local

    dead = _leftovers(home, _dead_pid())
    try:
        start_local({"replicas": 1, "port": 0, "proxy": "serve"})
        stop_local(drain=False)
        assert not any(os.path.exists(p) for p in dead[:2]), "a killed run's secret files outlived the next start"
    finally:
        for path in dead[2:]:
            if os.path.exists(path):
                os.rmdir(path)


def test_the_relay_removes_what_its_killed_driver_left(home, monkeypatch):
    """`kvmesh serve`'s driver SIGKILLed (a second Ctrl-C): the relay removes its secret files and folders. A
    Ray folder whose logs a failed start kept (and named as kept) stays for the user to read: the relay removed
    it as soon as the driver had exited; the next start's sweep removes it."""
    import shutil

    from kvmesh.deployments import local_ray, process_tree, supervisor

    made: list[str] = []
    kept: list[str] = []
    real_popen = subprocess.Popen

    def driver_killed(cmd, **kw):
        """Stands in for the driver: a process that dies of SIGKILL; what it 'wrote' is named after its pid."""
        proc = real_popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        proc.wait()
        made.extend(_leftovers(home, proc.pid))
        # a failed start's Ray folder, kept as the driver's stop_local(keep_logs=True) keeps it
        local_ray._ray_temp_dir.append(tempfile.mkdtemp(prefix=f"kvmesh-ray-{proc.pid}-", dir="/tmp"))
        kept.extend(local_ray.keep_ray_temp_dir())
        return proc

    monkeypatch.setattr(supervisor.subprocess, "Popen", driver_killed)
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: True)  # not this test process
    monkeypatch.setattr(process_tree, "end_descendants", lambda **kw: [])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        assert supervisor.supervise(["serve"]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        left = [p for p in made if os.path.exists(p)]
        for path in left:
            if os.path.isdir(path):
                os.rmdir(path)
        kept_after_relay = [p for p in kept if os.path.isdir(p)]
        if kept_after_relay:
            local_ray.remove_dead_ray_temp_dirs(kept_logs=True)  # as the next start sweeps
        kept_after_next_start = [p for p in kept if os.path.isdir(p)]
        for path in kept:
            shutil.rmtree(path, ignore_errors=True)
    assert made and left == [], f"the killed driver's leftovers stayed: {left}"
    assert kept and kept_after_relay == kept, "the relay removed the Ray logs the failed start said it kept"
    assert kept_after_next_start == [], "the next start left a dead run's kept Ray logs"


def test_the_relay_gone_driver_signals_only_its_own_events(relay_gone):
    """The stand-in signals serve.py's events at once and leaves every other Event and Thread as they are:
    a Thread made meanwhile (the start's Serve contract check runs one) still starts."""
    import threading

    serve_cmd = relay_gone
    assert serve_cmd.threading.Event().is_set() and serve_cmd.threading.Event().wait(0)
    assert not threading.Event().is_set()
    ran = []
    worker = threading.Thread(target=lambda: ran.append(True))
    worker.start()  # "threads can only be started once" while threading.Event itself was the stand-in
    worker.join(timeout=10)
    assert ran == [True]


def test_the_fast_stop_after_the_relay_died_removes_its_replicas_folders(home, fake_ray, relay_gone, monkeypatch):
    """`kvmesh serve`'s driver on SIGHUP (its relay was killed): once it ended its processes, their private
    folders (replicas', LMCache servers') are removed too."""
    from kvmesh.deployments import serve_contract

    # as a process's first start, whatever ran before: the Serve contract check (on a thread) runs too
    monkeypatch.setattr(serve_contract, "_checked", False)
    serve_cmd = relay_gone
    # the replicas' folders are named after their processes, which the fast stop ended
    dead = _leftovers(home, _dead_pid())
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    args = parser.parse_args(["--port", "0", "--proxy", "serve"])
    try:
        with pytest.raises(SystemExit):
            serve_cmd._drive(args, serve_cmd._build_config(args))
    finally:
        left = [p for p in dead if os.path.exists(p)]
        for path in left:
            if os.path.isdir(path):
                os.rmdir(path)
    assert left == [], f"the fast stop left its processes' folders: {left}"
