"""The shared tier requires a password: the test Redis refuses clients without it, kvmesh's own probe and
the LMCache server authenticate, and the password never appears on the LMCache server's command line."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.lmcache_server import LMCacheServer, redis_ping, shared_tier_reachable
from kvmesh.kvstore.redis_process import RedisServer
from kvmesh.kvstore.tiers import TierConfig, normalise_l2

pytestmark = pytest.mark.integration


def test_redis_requires_the_password_and_kvmesh_sends_it(tmp_path, monkeypatch):
    import psutil
    import redis as redis_py

    monkeypatch.delenv("LMCACHE_RESP_PASSWORD", raising=False)
    with RedisServer(tmp_path / "redis") as redis:
        assert redis.password and f":{redis.password}@" in redis.url
        with pytest.raises(redis_py.exceptions.AuthenticationError):
            redis_py.Redis(host="127.0.0.1", port=redis.port, socket_timeout=5).set("k", "v")
        assert redis_ping("127.0.0.1", redis.port) is False
        assert redis_ping("127.0.0.1", redis.port, password=redis.password) is True
        l2 = normalise_l2(redis.url)
        assert shared_tier_reachable(l2) is True
        bare = {k: v for k, v in l2.items() if k != "password"}
        assert shared_tier_reachable(bare) is False
        monkeypatch.setenv("LMCACHE_RESP_PASSWORD", redis.password)  # how KubeRay's workers get Valkey's
        assert shared_tier_reachable(bare) is True
        monkeypatch.delenv("LMCACHE_RESP_PASSWORD")

        admin = redis_py.Redis.from_url(redis.url, socket_timeout=5)
        admin.config_resetstat()  # the refused calls above are counted: start from zero
        server = LMCacheServer(
            TierConfig.from_dict({"l1_size_gb": 0.05, "chunk_size": 32, "l2": redis.url, "start_timeout_s": 300}),
            tmp_path / "lmcache.log",
        )
        try:
            server.start()
            assert server.health()["shared_tier_up"] is True
            proc = psutil.Process(server.proc.pid)
            assert redis.password not in " ".join(proc.cmdline())
            assert proc.environ().get("LMCACHE_RESP_PASSWORD") == redis.password
            # LMCache's resp adapter connected and authenticated: connections of its own, no refused AUTH,
            # no command refused for want of one since the counters were reset
            assert len(admin.client_list()) > 1
            assert not {"errorstat_WRONGPASS", "errorstat_NOAUTH"} & set(admin.info("errorstats"))
        finally:
            server.stop()


def test_the_test_redis_password_is_never_on_its_command_line(tmp_path, monkeypatch):
    """Any local user reads argv (ps, /proc/PID/cmdline) before redis-server retitles itself."""
    import subprocess

    import redis as redis_py

    from kvmesh.kvstore import redis_process

    launched: list[list[str]] = []
    real_popen = subprocess.Popen

    def recording_popen(cmd, *args, **kwargs):
        launched.append(list(cmd))
        return real_popen(cmd, *args, **kwargs)

    monkeypatch.setattr(redis_process.subprocess, "Popen", recording_popen)
    with RedisServer(tmp_path / "redis") as redis:
        assert launched and all(redis.password not in " ".join(cmd) for cmd in launched)
        with pytest.raises(redis_py.exceptions.AuthenticationError):
            redis_py.Redis(host="127.0.0.1", port=redis.port, socket_timeout=5).set("k", "v")
        assert redis_py.Redis.from_url(redis.url, socket_timeout=5).set("k", "v")
