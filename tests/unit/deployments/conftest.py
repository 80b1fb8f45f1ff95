"""Fixtures the deployment tests share."""

from __future__ import annotations

import os

import pytest

SECRET_VARS = ("KVMESH_SALT_SECRET", "KVMESH_SALT_SECRET_FILE", "KVMESH_CHANNEL_SECRET_FILE")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private KVMESH_HOME, no secret configured, and the process's environment put back afterwards
    (a start exports its secrets' and proxy's settings for Ray's processes)."""
    saved = dict(os.environ)
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)
    yield tmp_path / "home"
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def relay_gone(monkeypatch):
    """`kvmesh serve`'s driver as its relay's death leaves it: the stop is signalled as it starts waiting, the
    fast stop's `os._exit` raises SystemExit instead, and no signal handler is set.

    Only serve.py's own events are signalled at once: it gets a stand-in for its `threading` module. Setting
    `Event` on the real module (which `serve_cmd.threading` is) changed every Thread made meanwhile too (a
    Thread's `_started` is an Event: started already, it refuses to start), so the start's Serve contract
    check, whose worker thread runs only at a process's first check, failed with "threads can only be
    started once" unless an earlier test had checked already."""
    import signal
    import threading
    import types

    from kvmesh.deployments.cli import serve as serve_cmd

    class SignalledAtOnce(threading.Event):
        def wait(self, timeout=None) -> bool:
            return True

        def is_set(self) -> bool:
            return True

    def exit_now(status):
        raise SystemExit(status)

    class ServesThreading(types.ModuleType):
        """threading as serve.py sees it: its Events are signalled at once, the rest is the real module."""

        Event = SignalledAtOnce

        def __getattr__(self, name: str):
            return getattr(threading, name)

    monkeypatch.setattr(serve_cmd, "threading", ServesThreading("threading"))
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(os, "_exit", exit_now)
    return serve_cmd


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray and Serve as a local start and stop see them, minus every process. The state it returns: `up`,
    `calls` ("ray down" at each shutdown), `on_ray_start` (called as Ray starts) and `serve_start` (Serve's
    start: it decides whether the start gets through)."""
    import ray
    from ray import serve

    from kvmesh.deployments import app, deploy_watch, local_ray, process_tree
    from kvmesh.kvstore import node_server

    state = {"up": False, "calls": [], "on_ray_start": lambda: None, "serve_start": lambda **kw: None}

    def start_local_ray(**kw):
        state["on_ray_start"]()
        state["up"] = True

    def shutdown():
        state["up"] = False
        state["calls"].append("ray down")

    monkeypatch.setattr(local_ray, "start_local_ray", start_local_ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "shutdown", shutdown)
    monkeypatch.setattr(serve, "start", lambda **kw: state["serve_start"](**kw))
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(node_server, "stop_node_servers", lambda: 0)
    monkeypatch.setattr(deploy_watch, "deploy_or_explain", lambda built, cfg: None)
    monkeypatch.setattr(app, "build_app", lambda cfg: None)
    monkeypatch.setattr(app, "_wait_ready", lambda cfg, timeout_s: None)
    monkeypatch.setattr(process_tree, "end_descendants", lambda **kw: [])
    return state
