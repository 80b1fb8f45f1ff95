"""Unit tests: what keeps the node's LMCache server and its data private to kvmesh's own user.

- The server is reached through unix sockets in a 0700 folder, never a TCP port: LMCache's request server has
  no authentication and unpickles what clients send (the real server: tests/integration/test_lmcache_channel.py).
- Secrets of the shared tier never reach the server's command line (`ps` shows it to every local user), nor an
  error message.
- A local fs shared tier lives in a private folder, and the server writes private files.
- A server whose owner dies while starting it does not live on as an orphan.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.kvstore import lmcache_server
from kvmesh.kvstore.lmcache_server import LMCacheServer, LMCacheServerError
from kvmesh.kvstore.tiers import (
    TierConfig,
    TierConfigError,
    kv_transfer_config,
    l2_credentials_env,
    normalise_l2,
    redacted,
    server_args,
)

VALKEY_PASSWORD = "vk-Pa55word-0123"
# tiers.L2_ADAPTER_ENV, spelled out: the variable is the contract between the server's owner and its entry point
L2_ADAPTER_ENV = "KVMESH_LMCACHE_L2_ADAPTER"


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


class _RecordedPopen:
    """subprocess.Popen as LMCacheServer.launch calls it, recording the command and environment; starts nothing."""

    calls: list[dict] = []

    def __init__(self, cmd, **kwargs):
        _RecordedPopen.calls.append({"cmd": list(cmd), "env": dict(kwargs.get("env") or {})})
        self.pid = -1
        self.returncode = None

    def poll(self):
        return self.returncode


@pytest.fixture
def recorded_popen(monkeypatch):
    _RecordedPopen.calls = []
    monkeypatch.setattr(lmcache_server.subprocess, "Popen", _RecordedPopen)
    return _RecordedPopen.calls


def _launch_without_a_process(srv: LMCacheServer) -> None:
    try:
        srv.launch()
    finally:
        srv.proc = None  # nothing was started: stop() has nothing to end


# --- the request channel: unix sockets in a private folder ---------------------------------------------------


def test_engines_reach_the_server_through_an_ipc_socket_in_a_0700_folder_of_its_owner(recorded_popen):
    srv = LMCacheServer(TierConfig.from_dict({"l1_size_gb": 0.05}))
    try:
        host, port = srv.endpoint
        assert host.startswith("ipc://"), host
        folder = Path(srv.channel_dir)
        assert host == f"ipc://{folder}/requests"
        assert folder.is_dir() and _mode(folder) == 0o700 and folder.stat().st_uid == os.geteuid()
        extra = kv_transfer_config(host, port)["kv_connector_extra_config"]
        # LMCache's connector joins host and port with ':' into its ZMQ endpoint: a file in that folder
        assert f"{extra['lmcache.mp.host']}:{extra['lmcache.mp.port']}" == f"ipc://{folder}/requests:{port}"
        _launch_without_a_process(srv)
        cmd = recorded_popen[-1]["cmd"]
        assert cmd[cmd.index("--host") + 1] == host and "--prometheus-port" not in cmd
    finally:
        srv.stop()
    assert not folder.exists()  # the folder goes with its server


def test_folders_of_owners_that_died_are_removed_and_live_ones_kept(tmp_path):
    """An owner killed outright (SIGKILL, a Ray worker ended hard) never removes its server's folder."""
    from kvmesh.kvstore.lmcache_server import CHANNEL_PREFIX, remove_dead_channel_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{CHANNEL_PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{CHANNEL_PREFIX}{os.getpid()}-def"
    other = tmp_path / "kvmesh-engine-1-x"
    for folder in (dead, alive, other):
        folder.mkdir()
    assert remove_dead_channel_dirs(str(tmp_path)) == 1
    assert not dead.exists() and alive.exists() and other.exists()


def test_a_server_whose_owner_died_removes_its_sockets_and_folder_and_one_with_an_owner_keeps_them():
    """The folder is the one a server gets (`new_channel_dir`, with its owner tag): built here without the tag,
    the test passed while every real folder was left behind, its rmdir failing on the tag."""
    import shutil
    import socket
    from pathlib import Path

    from kvmesh.kvstore.lmcache_main import remove_channel_if_orphaned
    from kvmesh.kvstore.lmcache_server import new_channel_dir

    folder = Path(new_channel_dir())
    listeners = []
    for name in ("requests:1", "metrics"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(folder / name))
        listeners.append(s)
    try:
        host = f"ipc://{folder}/requests"
        remove_channel_if_orphaned(host, owner=os.getppid())  # its owner is alive: a restart reuses them
        assert sorted(p.name for p in folder.iterdir()) == [".kvmesh-owner", "metrics", "requests:1"]
        remove_channel_if_orphaned(host, owner=-1)  # reparented: the owner is gone
        assert not folder.exists()
        remove_channel_if_orphaned(host, owner=-1)  # the owner's own exit removed them first: nothing to do
    finally:
        for s in listeners:
            s.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_settings_of_the_old_tcp_ports_are_refused_not_ignored():
    for key, value in (("host", "0.0.0.0"), ("port", 5599), ("prometheus_port", 9100)):
        with pytest.raises(TierConfigError, match=f"{key}.*no longer settings"):
            TierConfig.from_dict({key: value})


def test_the_server_entry_point_binds_ipc_endpoints_only():
    """LMCache writes `tcp://` before --host; kvmesh's entry point binds the ipc endpoint inside, and stops the
    server rather than let it listen on TCP."""
    from kvmesh.kvstore.lmcache_main import ipc_bind_url

    assert ipc_bind_url("tcp://ipc:///tmp/k/requests:1") == "ipc:///tmp/k/requests:1"
    for url in ("tcp://127.0.0.1:5599", "tcp://0.0.0.0:1", "tcp://localhost:5555"):
        with pytest.raises(SystemExit, match="only ipc"):
            ipc_bind_url(url)


def test_metrics_are_served_over_a_unix_socket(tmp_path):
    from prometheus_client import CollectorRegistry, Counter

    from kvmesh.kvstore.lmcache_main import start_unix_metrics_server
    from kvmesh.kvstore.lmcache_server import unix_http_get

    registry = CollectorRegistry()
    Counter("kvmesh_probe_total", "a probe", registry=registry).inc(3)
    path = str(tmp_path / "metrics")
    (tmp_path / "stale").touch()
    server, thread = start_unix_metrics_server(path, registry)
    try:
        assert "kvmesh_probe_total 3.0" in (unix_http_get(path, "/metrics", timeout=5) or "")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert unix_http_get(str(tmp_path / "stale"), "/metrics", timeout=1) is None


def _run_entry_point(env: dict) -> dict:
    """Run kvmesh's LMCache entry point with LMCache's server replaced by a report of what it would start with."""
    script = r"""
import json, os, sys
from kvmesh.kvstore import lmcache_main
def report(*args, **kwargs):
    umask = os.umask(0)
    print(json.dumps({"argv": sys.argv[1:], "umask": umask, "env": sorted(os.environ)}))
lmcache_main.runpy.run_module = report
lmcache_main.main()
"""
    argv = ["--host", "ipc:///nonexistent/kvmesh/requests", "--port", "1"]
    out = subprocess.run(
        [sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- secrets: never on the command line, never in an error message -------------------------------------------


def test_a_non_resp_adapters_credentials_stay_off_the_servers_command_line(recorded_popen, monkeypatch):
    # a tier that answers: one that does not is launched without (test_shared_tier_supervision.py)
    monkeypatch.setattr(lmcache_server, "shared_tier_reachable", lambda l2, timeout=1.0: True)
    monkeypatch.setattr(lmcache_server, "shared_tier_run_id", lambda l2, timeout=1.0: None)
    cfg = TierConfig.from_dict({"l2": {"type": "valkey", "startup_nodes": "vk:6379", "password": VALKEY_PASSWORD}})
    srv = LMCacheServer(cfg)
    try:
        _launch_without_a_process(srv)
    finally:
        srv.stop()
    launched = recorded_popen[-1]
    assert not any(VALKEY_PASSWORD in a for a in launched["cmd"])
    assert json.loads(launched["env"][L2_ADAPTER_ENV])["password"] == VALKEY_PASSWORD
    assert not any(VALKEY_PASSWORD in a for a in server_args(cfg, "ipc:///run/s/requests"))
    assert json.loads(l2_credentials_env(cfg.l2)[L2_ADAPTER_ENV]) == cfg.l2


def test_the_entry_point_hands_the_adapter_to_lmcache_and_writes_private_files():
    adapter = {"type": "valkey", "startup_nodes": "vk:6379", "password": VALKEY_PASSWORD}
    env = {**os.environ, L2_ADAPTER_ENV: json.dumps(adapter)}
    seen = _run_entry_point(env)
    argv = seen["argv"]
    assert json.loads(argv[argv.index("--l2-adapter") + 1]) == adapter
    assert L2_ADAPTER_ENV not in seen["env"]  # nothing the server starts inherits it
    assert seen["umask"] == 0o077  # an fs shared tier's chunk files: 0600, not LMCache's 0644


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Zk9/Q2xY+pW8=@valkey:6379",  # a base64 password: '/' ends urlparse's netloc early
        "redis://:Zk9?Q2xY+pW8=@valkey:6379",
        "redis://:Zk9#Q2xY+pW8=@valkey:6379",
        "rediss://kvmesh:Zk9/Q2xY+pW8=@valkey:6380",  # a scheme kvmesh does not read
        "redis://kvmesh:Zk9Q2xY+pW8=@valkey:port",
    ],
)
def test_an_l2_url_with_an_unreadable_password_is_never_echoed(url):
    from kvmesh.deployments.config import ConfigError, app_config

    with pytest.raises(ConfigError) as err:
        app_config({"engine": {"lmcache": {"l2": url}}})
    message = str(err.value)
    assert "valkey" in message  # still says which setting
    for part in ("Zk9", "Q2xY", "pW8"):
        assert part not in message, message
    assert redacted(url).startswith(url.partition("://")[0] + "://***@")


def test_secret_keys_of_any_adapter_are_masked():
    shown = str(redacted({"type": "s3", "bucket": "b", "aws_access_key_id": "AKIA1", "aws_secret_access_key": "S3K"}))
    assert "AKIA1" not in shown and "S3K" not in shown and "'bucket': 'b'" in shown


# --- a local fs shared tier ----------------------------------------------------------------------------------


def test_fs_without_a_path_lives_under_kvmesh_home_not_the_shared_temp_folder(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    base = normalise_l2("fs")["base_path"]
    assert Path(base).parent == tmp_path / "home"
    assert not base.startswith(tempfile.gettempdir() + os.sep + "kvmesh")


def test_the_fs_folder_is_made_0700_and_one_open_to_others_is_refused(recorded_popen, tmp_path):
    made = tmp_path / "made"
    srv = LMCacheServer(TierConfig.from_dict({"l2": "fs", "l2_path": str(made)}))
    try:
        _launch_without_a_process(srv)
        assert _mode(made) == 0o700 and len(recorded_popen) == 1

        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        shared.chmod(0o755)  # as a folder another user made first, or one made with the default umask
        srv.config = TierConfig.from_dict({"l2": "fs", "l2_path": str(shared)})
        with pytest.raises(LMCacheServerError, match="open to group or others"):
            _launch_without_a_process(srv)
        assert len(recorded_popen) == 1  # nothing started
    finally:
        srv.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_an_fs_folder_of_another_user_is_refused(recorded_popen, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    srv = LMCacheServer(TierConfig.from_dict({"l2": "fs", "l2_path": str(theirs)}))
    try:
        with pytest.raises(LMCacheServerError, match="belongs to uid"):
            _launch_without_a_process(srv)
        assert recorded_popen == []
    finally:
        srv.stop()


# --- a server whose owner dies while starting it --------------------------------------------------------------

# The owner: launches a server (a stand-in that writes its pid to a file) through LMCacheServer.launch, with
# libc's prctl made to kill this owner first: the parent dies between the fork and the parent-death signal.
_OWNER = r"""
import ctypes, os, signal, sys, time
from kvmesh.kvstore import lmcache_server
from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.tiers import TierConfig

lmcache_server.CHANNEL_ROOT = sys.argv[1]
child_pid_file, ran_file = sys.argv[2], sys.argv[3]
owner = os.getpid()
real_cdll = ctypes.CDLL


class OwnerDiesFirst:
    def __init__(self, *args, **kwargs):
        self.libc = real_cdll(*args, **kwargs)

    def prctl(self, *args):
        with open(child_pid_file, "w") as f:
            f.write(str(os.getpid()))
        os.kill(owner, signal.SIGKILL)
        while os.getppid() == owner:
            time.sleep(0.005)
        return self.libc.prctl(*args)


ctypes.CDLL = OwnerDiesFirst
srv = LMCacheServer(TierConfig())
stand_in = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
srv.command = lambda: [sys.executable, "-c", stand_in, ran_file]
srv.launch()
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_server_whose_owner_died_before_its_parent_death_signal_was_set_ends_itself(tmp_path):
    child_pid_file, ran_file = tmp_path / "child.pid", tmp_path / "ran.pid"
    owner = subprocess.run(
        [sys.executable, "-c", _OWNER, str(tmp_path), str(child_pid_file), str(ran_file)], timeout=120
    )
    assert owner.returncode == -signal.SIGKILL and child_pid_file.exists()
    child = int(child_pid_file.read_text())
    deadline = time.monotonic() + 20
    while _alive(child) and not ran_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not ran_file.exists(), "the orphaned server started"
        assert not _alive(child)
    finally:
        if ran_file.exists() and ran_file.read_text().isdigit() and _alive(int(ran_file.read_text())):
            os.kill(int(ran_file.read_text()), signal.SIGKILL)
