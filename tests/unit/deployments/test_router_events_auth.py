"""The router and the engines' CURVE event streams: without the channel secret it still routes."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV


class _Records(logging.Handler):
    """Ray's "ray.serve" loggers do not propagate to the root logger, so caplog would see nothing."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_router_without_the_channel_secret_routes_on_load_and_says_why(monkeypatch, tmp_path):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from kvmesh.deployments.router import KvmeshRouter

    monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(tmp_path / "missing-secret"))
    router = KvmeshRouter(
        deployment_id=DeploymentID(name="EngineReplica", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    router.initialize_state(policy="kvmesh", block_size=32)
    stats = {"kv_events_endpoint": "tcp://127.0.0.1:9", "replay_endpoint": "tcp://127.0.0.1:9", "events_auth": "curve"}
    replicas = [
        SimpleNamespace(
            replica_id=SimpleNamespace(unique_id=r), routing_stats=stats, node_id="n0", max_ongoing_requests=64
        )
        for r in "AB"
    ]
    req = {"request_id": "q", "prompt_token_ids": list(range(100)), "cache_salt": None, "params": {"max_tokens": 1}}
    pending = SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id="i-q"))

    async def scenario():
        ranked = await router.choose_replicas(replicas, pending)
        await router.choose_replicas(replicas, pending)  # no second attempt, no second error
        return ranked

    records = _Records()
    logger = logging.getLogger("ray.serve.kvmesh")
    logger.addHandler(records)
    try:
        ranked = asyncio.run(scenario())
    finally:
        logger.removeHandler(records)
    assert sorted(r.replica_id.unique_id for g in ranked for r in g) == ["A", "B"]
    errors = [m for m in records.messages if "no KV events from" in m]
    assert len(errors) == 2 and "missing-secret" in errors[0]  # one per replica, once
