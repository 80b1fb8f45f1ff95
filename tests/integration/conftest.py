"""Which of `make test`'s two pytest-xdist workers runs each integration test (`-n 2 --dist loadscope`).

Most tests run on one worker, in one process: they share the session's live app (one Ray cluster, its
engines), and several start Serve apps or Ray clusters of their own that would fight another worker's for
the two cores. The files in `BESIDE` start no Serve app and use no live app: LMCache servers, engines in a
process of their own or of the test's, Redis, vLLM's own server. They spend most of their time waiting
(heartbeats, a server kept dark, a watchdog's restart, a hung tier's timeout), so they run on the second
worker beside the others. Each worker runs its tests in collection order (the live app's first).
"""

from __future__ import annotations

BESIDE = frozenset(
    {
        "test_hashing_matches_vllm.py",
        "test_isolation_tiers.py",
        "test_kv_events_vllm.py",
        "test_lmcache_channel.py",
        "test_lmcache_restart_before_first_request.py",
        "test_lmcache_server_exit.py",
        "test_lmcache_server_restart.py",
        "test_local_cluster_orphans.py",
        "test_node_server.py",
        "test_redis_auth.py",
        "test_replay_vllm_server.py",
        "test_tiers_lmcache.py",
    }
)


def lane(nodeid: str) -> str:
    """The worker's share a test belongs to: "beside" for the files in BESIDE, "main" for the rest."""
    return "beside" if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in BESIDE else "main"


def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadscope`, a scope is a lane, not a module: xdist hands each worker one whole lane.
    (Its `xdist_group` marks would say the same, but pytest-xdist 3.8 cannot apply them under pytest 9.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return LaneScheduling(config, log)
