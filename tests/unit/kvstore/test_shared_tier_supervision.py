"""Unit tests: how the node's LMCache server is run against a RESP shared tier (Redis/Valkey) it may not be
able to use, with a real `redis-server` as that tier and `sleep` in place of LMCache's server.

LMCache 0.5.6's native Redis client never reconnects, has no timeout, and, started while its tier refuses
connections or rejects AUTH, never completes an operation: every request whose prompt fills a chunk then
hangs. So kvmesh probes the tier as LMCache authenticates (username and password, from the config or the
variables LMCache reads), launches without it while it does not answer, launches with it again once it does,
and tells a Redis restart between two looks from INFO's run_id.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import types

import pytest

from kvmesh.cluster.ports import free_port
from kvmesh.kvstore import lmcache_server
from kvmesh.kvstore.lmcache_server import LMCacheServer, refuse_placeholder_password, shared_tier_reachable
from kvmesh.kvstore.redis_process import RedisServer
from kvmesh.kvstore.tiers import TierConfig, TierConfigError, l2_credentials_env, normalise_l2, server_args

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture
def stand_in(monkeypatch):
    """The server's launches run `sleep` in place of LMCache's server (its real `launch` otherwise, probe
    included); yields the command lines it asked for. Only lmcache_server's Popen is replaced: the Redis
    these tests start is a real one."""
    real_popen = subprocess.Popen
    commands: list[list[str]] = []
    procs: list[subprocess.Popen] = []

    def popen(cmd, **kwargs):
        commands.append(list(cmd))
        procs.append(real_popen(["sleep", "60"], start_new_session=True))
        return procs[-1]

    monkeypatch.setattr(lmcache_server, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": popen}))
    monkeypatch.setattr(lmcache_server, "RESTART_DARK_S", 0.0)
    monkeypatch.setattr(lmcache_server, "SLOW_PROBE_S", 0.5)
    monkeypatch.setattr(lmcache_server, "port_open", lambda host, port, timeout=0.5: True)
    yield commands
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _server(l2: str | dict, tmp_path, env: dict | None = None) -> LMCacheServer:
    srv = LMCacheServer(TierConfig.from_dict({"l2": l2}), tmp_path / "log", env=env)
    srv.wait_ready = lambda: srv.endpoint  # type: ignore[method-assign]  # `sleep` serves nothing
    srv._scrape = lambda timeout=5.0: "lmcache_mp_lookup_requested_tokens_total 0.0\n"  # type: ignore[method-assign]
    return srv


def _with_tier(command: list[str]) -> bool:
    return "--l2-adapter" in command


@needs_redis
def test_a_server_launched_while_its_shared_tier_refuses_connections_runs_without_it_until_it_answers(
    stand_in, tmp_path
):
    """Launched with a Redis that refuses connections, LMCache's client never completed an operation and every
    chunk-filling request hung (over 90 s each), while health said healthy and the watchdog said
    "shared-down" each round without acting."""
    redis = RedisServer(tmp_path / "redis", port=free_port())  # not started: its port refuses connections
    srv = _server(redis.url, tmp_path)
    try:
        srv.start()
        assert not _with_tier(stand_in[-1]) and srv.without_shared
        health = srv.health()
        assert health["running_without_shared_tier"] and health["shared_tier_up"] is False and health["healthy"]
        assert srv.supervise() == "shared-down" and len(stand_in) == 1  # still down: no relaunch
        redis.start()
        assert srv.supervise() == "restarted-shared-back" and _with_tier(stand_in[-1])
        assert not srv.without_shared and srv.health()["healthy"]
        assert srv.supervise() == "ok" and len(stand_in) == 2
    finally:
        srv.stop()
        redis.stop()


@needs_redis
def test_a_shared_tier_that_rejects_the_password_is_not_launched_with(stand_in, tmp_path):
    """A wrong password: LMCache's client logged "AUTH failed" and never completed an operation."""
    with RedisServer(tmp_path / "redis") as redis:
        srv = _server(f"redis://:not-the-password@127.0.0.1:{redis.port}", tmp_path)
        try:
            srv.start()
            assert not _with_tier(stand_in[-1]) and srv.without_shared
            assert srv.supervise() == "shared-down" and len(stand_in) == 1
        finally:
            srv.stop()


@needs_redis
def test_a_running_server_whose_shared_tier_goes_down_is_unhealthy_and_restarted_without_it(stand_in, tmp_path):
    """A server launched with its tier up keeps a client that will not recover: health must not say healthy
    while it runs with that tier, and the watchdog runs it without the tier until a probe (AUTH included)
    succeeds."""
    redis = RedisServer(tmp_path / "redis").start()
    srv = _server(redis.url, tmp_path)
    try:
        srv.start()
        assert _with_tier(stand_in[-1]) and srv.health()["healthy"]
        redis.stop()
        health = srv.health()
        assert health["shared_tier_up"] is False and not health["healthy"] and health["shared_tier_unusable"]
        assert srv.supervise() == "restarted-without-shared" and not _with_tier(stand_in[-1])
        assert srv.shared_losses == 1 and srv.health()["healthy"]
        assert srv.supervise() == "shared-down" and len(stand_in) == 2
        redis.start()
        assert srv.supervise() == "restarted-shared-back" and _with_tier(stand_in[-1])
        assert srv.supervise() == "ok" and len(stand_in) == 3
    finally:
        srv.stop()
        redis.stop()


def test_a_server_its_owner_did_not_start_is_not_launched_by_the_watchdog(tmp_path):
    """The watchdog restarts what its owner runs; a server never started (or stopped) stays so."""
    srv = LMCacheServer(TierConfig.from_dict({"l2": f"redis://127.0.0.1:{free_port()}"}), tmp_path / "log")
    assert srv.supervise() == "shared-down" and srv.proc is None and not srv.without_shared


@needs_redis
def test_a_redis_restart_between_two_watchdog_looks_counts_as_a_loss_and_restarts_the_server(stand_in, tmp_path):
    """Restarted in 0.13 s, between two 2 s looks, Redis was never seen down: the watchdog said "ok",
    shared_tier_up True, no loss counted, and LMCache's client, which never reconnects, stayed broken."""
    redis = RedisServer(tmp_path / "redis").start()
    srv = _server(redis.url, tmp_path)
    try:
        srv.start()
        assert srv.supervise() == "ok"
        redis.stop()
        redis.start()  # same port and password, a new process: empty
        assert not srv.health()["healthy"]  # the running client cannot use it
        assert srv.supervise() == "restarted-shared-back" and srv.shared_losses == 1
        assert _with_tier(stand_in[-1]) and srv.health()["healthy"]
        assert srv.supervise() == "ok" and srv.shared_losses == 1 and len(stand_in) == 2
    finally:
        srv.stop()
        redis.stop()


@needs_redis
def test_a_redis_stall_the_watchdog_rides_out_does_not_make_health_unhealthy(stand_in, tmp_path):
    """A Redis stalled for ~2 s (a fork or fsync; here SIGSTOP) is not an outage to the watchdog, whose second
    probe waits SLOW_PROBE_S; health()'s single quick probe called the server unhealthy (shared_tier_unusable)
    through it. health() now goes by the watchdog's last verdict while its probe gets no answer in time."""
    redis = RedisServer(tmp_path / "redis").start()
    srv = _server(redis.url, tmp_path)
    try:
        srv.start()
        assert _with_tier(stand_in[-1]) and srv.supervise() == "ok"
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            health = srv.health()  # its probe gets no answer while Redis is stopped
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        assert health["healthy"] and not health["shared_tier_unusable"] and health["shared_tier_up"] is True
        assert srv.supervise() == "ok" and srv.restarts == 0 and len(stand_in) == 1
        assert srv.health()["healthy"]
    finally:
        srv.stop()
        redis.stop()


@needs_redis
@pytest.mark.parametrize("first_seed_up_at_launch", [False, True], ids=["first seed down", "first seed up"])
def test_a_valkey_tier_is_up_while_any_startup_node_answers_and_a_seed_restart_restarts_nothing(
    first_seed_up_at_launch, stand_in, tmp_path
):
    """LMCache's valkey adapter (cluster mode) finds the cluster from any startup node and reconnects: judged by
    its first node only, a tier whose first seed was down was launched without, and each restart of that seed
    (a new run_id) restarted the LMCache server, losing the node's host tier for nothing."""
    seed1 = RedisServer(tmp_path / "r1", port=free_port(), require_password=False)  # not started: down
    seed2 = RedisServer(tmp_path / "r2", port=free_port(), require_password=False).start()
    if first_seed_up_at_launch:
        seed1.start()
    l2 = {"type": "valkey", "startup_nodes": f"127.0.0.1:{seed1.port},127.0.0.1:{seed2.port}", "cluster_mode": True}
    srv = _server(l2, tmp_path)
    try:
        srv.start()
        assert srv.launch_config().l2 == srv.config.l2 and not srv.without_shared  # valkey's JSON goes by env
        health = srv.health()
        assert health["shared_tier_up"] is True and health["healthy"]
        assert srv.supervise() == "ok"
        if not first_seed_up_at_launch:
            seed1.start()
            assert srv.supervise() == "ok"
        seed1.stop()
        seed1.start()  # a new process (run_id) on the first seed
        assert srv.supervise() == "ok" and srv.health()["healthy"]
        assert srv.restarts == 0 and srv.shared_losses == 0 and len(stand_in) == 1
    finally:
        srv.stop()
        seed1.stop()
        seed2.stop()


@pytest.mark.parametrize("kind", ["valkey", "fs"])
def test_a_valkey_or_fs_tier_back_after_an_outage_restarts_nothing_and_its_loss_still_counts(kind, stand_in, tmp_path):
    """Back after an outage, a valkey or fs tier restarted the LMCache server ("restarted-shared-back"), emptying
    the node's host tier and keeping its engines' connectors dark, though only resp's client never reconnects
    (valkey's adapter reconnects; fs opens a file per operation). The loss still counts, so routers forget
    what they marked in the tier, and the tier is no longer reported as having been down once it is back."""
    if kind == "valkey":
        if shutil.which("redis-server") is None:
            pytest.skip("needs redis-server")
        tier = RedisServer(tmp_path / "valkey", port=free_port(), require_password=False).start()
        l2: str | dict = f"valkey://127.0.0.1:{tier.port}"
        down, up, end = tier.stop, tier.start, tier.stop
    else:
        folder, away = tmp_path / "l2", tmp_path / "l2-away"
        l2 = {"type": "fs", "base_path": str(folder)}
        down, up, end = (lambda: folder.rename(away)), (lambda: away.rename(folder)), (lambda: None)
    srv = _server(l2, tmp_path)
    try:
        srv.start()
        assert srv.supervise() == "ok" and srv.health()["healthy"]
        for loss in (1, 2):
            down()
            assert srv.supervise() == "shared-down" and srv.shared_losses == loss
            assert srv.health()["shared_tier_was_down"] and not srv.health()["healthy"]
            up()
            assert srv.supervise() == "ok" and srv.shared_losses == loss
            health = srv.health()
            assert health["healthy"] and health["shared_tier_up"] and not health["shared_tier_was_down"]
            assert srv.restarts == 0 and len(stand_in) == 1 and srv.alive()
    finally:
        srv.stop()
        end()


@needs_redis
def test_redis_run_id_changes_with_the_process_and_needs_the_password(tmp_path):
    from kvmesh.kvstore.lmcache_server import redis_run_id

    redis = RedisServer(tmp_path / "redis").start()
    try:
        first = redis_run_id("127.0.0.1", redis.port, password=redis.password)
        assert first and redis_run_id("127.0.0.1", redis.port, password=redis.password) == first
        assert redis_run_id("127.0.0.1", redis.port, password="wrong") is None
        assert redis_run_id("127.0.0.1", redis.port) is None
        redis.stop()
        assert redis_run_id("127.0.0.1", redis.port, password=redis.password) is None
        redis.start()
        assert redis_run_id("127.0.0.1", redis.port, password=redis.password) not in (None, first)
    finally:
        redis.stop()


# --- credentials: probes authenticate as LMCache does -----------------------------------------------------


def _acl_user(redis: RedisServer, user: str, password: str) -> None:
    """An ACL user with every right; the default user switched off, as on an ACL-only Valkey."""
    cli = ["redis-cli", "-p", str(redis.port), "--no-auth-warning", "-a", redis.password]
    subprocess.run([*cli, "ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all"], check=True)
    subprocess.run([*cli, "ACL", "SETUSER", "default", "off"], check=True)


@needs_redis
def test_a_resp_tier_of_an_acl_user_given_by_environment_is_probed_as_that_user(monkeypatch, stand_in, tmp_path):
    """LMCache reads LMCACHE_RESP_USERNAME as well as _PASSWORD (the k8s docs set both for an ACL user); a probe
    that sent the password alone judged the tier down for good."""
    if shutil.which("redis-cli") is None:
        pytest.skip("needs redis-cli")
    with RedisServer(tmp_path / "redis") as redis:
        _acl_user(redis, "kvmesh", "acl-pass-0123456789")
        l2 = normalise_l2(f"redis://127.0.0.1:{redis.port}")
        monkeypatch.setenv("LMCACHE_RESP_USERNAME", "kvmesh")
        monkeypatch.setenv("LMCACHE_RESP_PASSWORD", "acl-pass-0123456789")
        assert shared_tier_reachable(l2) is True
        monkeypatch.delenv("LMCACHE_RESP_USERNAME")
        assert shared_tier_reachable(l2) is False  # the password alone is the default user's, switched off
        # the server's own env, as its launch passes it to LMCache
        srv = _server(f"redis://127.0.0.1:{redis.port}", tmp_path, env={"LMCACHE_RESP_USERNAME": "kvmesh"})
        try:
            srv.start()
            assert _with_tier(stand_in[-1]) and srv.health()["shared_tier_up"] is True
        finally:
            srv.stop()


@needs_redis
def test_a_valkey_tier_with_a_password_keeps_it_and_is_probed_with_it(tmp_path):
    """valkey://:PW@h:p lost its password silently, and the valkey probe never authenticated: a Valkey that
    requires a password was reported down."""
    with RedisServer(tmp_path / "redis") as redis:
        l2 = normalise_l2(f"valkey://:{redis.password}@127.0.0.1:{redis.port}")
        assert l2 == {"type": "valkey", "startup_nodes": f"127.0.0.1:{redis.port}", "password": redis.password}
        assert shared_tier_reachable(l2) is True
        assert shared_tier_reachable({**l2, "password": "wrong"}) is False
    assert normalise_l2("valkey://kv:p%40ss@vk:6379") == {
        "type": "valkey",
        "startup_nodes": "vk:6379",
        "password": "p@ss",
        "username": "kv",
    }
    cfg = TierConfig.from_dict({"l2": "valkey://kv:p%40ss@vk:6379"})
    assert not any("p@ss" in a for a in server_args(cfg, "ipc:///run/s/requests"))  # its JSON goes by env
    assert "p@ss" in l2_credentials_env(cfg.l2)["KVMESH_LMCACHE_L2_ADAPTER"]


# --- the examples' placeholder password ------------------------------------------------------------------

PLACEHOLDER = "REPLACE-WITH-32-RANDOM-BYTES-HEX"  # k8s/secrets.example.yaml's kvmesh-valkey-password


@pytest.mark.parametrize("where", ["environment", "server env", "url", "valkey dict"])
def test_the_examples_placeholder_password_is_refused_when_the_server_launches(where, monkeypatch, stand_in, tmp_path):
    """The example secret's value is public; docs/kubernetes.md says kvmesh refuses to start on it."""
    monkeypatch.delenv("LMCACHE_RESP_PASSWORD", raising=False)
    env = None
    l2: str | dict = "redis://127.0.0.1:1"
    if where == "environment":
        monkeypatch.setenv("LMCACHE_RESP_PASSWORD", PLACEHOLDER)
    elif where == "server env":
        env = {"LMCACHE_RESP_PASSWORD": PLACEHOLDER}
    elif where == "url":
        l2 = f"redis://:{PLACEHOLDER}@127.0.0.1:1"
    else:
        l2 = {"type": "valkey", "startup_nodes": "127.0.0.1:1", "password": PLACEHOLDER}
    srv = LMCacheServer(TierConfig.from_dict({"l2": l2}), tmp_path / "log", env=env)
    try:
        with pytest.raises(TierConfigError, match="placeholder") as err:
            srv.launch()
        assert PLACEHOLDER not in str(err.value) and stand_in == [] and not srv.wanted
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "l2",
    [
        None,
        {"type": "fs", "base_path": "/tmp/kvmesh-l2"},
        {"type": "valkey", "startup_nodes": "vk:6379", "password": "own"},
    ],
    ids=["no tier", "fs", "valkey with its own password"],
)
def test_a_placeholder_in_the_resp_password_variable_is_refused_only_where_lmcache_reads_it(l2):
    """LMCACHE_RESP_PASSWORD is read by LMCache's resp adapter alone: a node with no shared tier, an fs tier or
    a valkey tier with its own password was refused for a value nothing uses."""
    env = {"LMCACHE_RESP_PASSWORD": PLACEHOLDER}
    refuse_placeholder_password(l2, env)  # no TierConfigError
    with pytest.raises(TierConfigError, match="placeholder"):
        refuse_placeholder_password({"type": "resp", "host": "127.0.0.1", "port": 1}, env)
