"""A request waiting for a free replica: Serve asks the router again until one is free, backing off between
rounds only when the router says its answer was the whole fleet (`routing_context.should_backoff`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router_fakes import make_router

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger


def _serve_request(ids, request_id: str):
    """A PendingRequest as Serve makes one (its routing context included)."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    req = {"request_id": request_id, "prompt_token_ids": ids, "cache_salt": "s", "tenant": "t1", "params": {}}
    meta = RequestMetadata(request_id=request_id, internal_request_id="i-" + request_id)
    return PendingRequest(args=[req], kwargs={}, metadata=meta)


class _Replica:
    """What Serve's routing loop needs of a replica: an id, routing stats and a queue-length probe."""

    def __init__(self, rid: str, queue_len: int, max_ongoing: int = 4):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=rid, deployment_id=DeploymentID(name="EngineReplica", app_name="t"))
        self.node_id = "n0"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = max_ongoing
        self.is_cross_language = False
        self.routing_stats = {"node_id": "n0"}
        self.queue_len = queue_len

    async def get_queue_len(self, *, deadline_s):
        await asyncio.sleep(0.001)
        return self.queue_len


def _router():
    local_state.LEDGER = PredictionLedger()
    router = make_router(policy="kvmesh", block_size=32)
    sent: list[list] = []
    router.sync = SimpleNamespace(router_id="X", publish=sent.append, drain=lambda: None)
    return router, sent


def test_a_request_ranked_over_the_whole_fleet_tells_serve_to_back_off():
    """Serve sleeps between rounds only when the router sets `should_backoff`, as its own routers do on their
    full-fleet round; kvmesh ranks the whole fleet every round."""

    async def run():
        router, _ = _router()
        a, b = _Replica("A", 0), _Replica("B", 0)
        router.update_replicas([a, b])
        pr = _serve_request(list(range(300)), "q")
        await router.choose_replicas([a, b], pr)
        return pr.routing_context.should_backoff

    assert asyncio.run(run()) is True


def test_a_request_waiting_for_a_full_fleet_is_not_ranked_again_in_a_tight_loop():
    """Serve's own routing loop over two replicas at their max_ongoing_requests for 0.5 s: with its backoff
    (25 ms doubling), a handful of rankings; without it, hundreds a second (each a ranking, a queue-length probe
    per replica and a withdraw and commit)."""

    async def run():
        router, sent = _router()
        a, b = _Replica("A", queue_len=4), _Replica("B", queue_len=4)
        router.update_replicas([a, b])
        task = asyncio.create_task(router._choose_replica_for_request(_serve_request(list(range(300)), "q")))
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return router.decisions, router.rerankings, len(sent)

    decisions, rerankings, messages = asyncio.run(run())
    assert decisions == 1 and rerankings <= 12, rerankings
    assert messages <= 2 * (rerankings + 1)  # a withdrawal and a commitment per ranking told to the peers
