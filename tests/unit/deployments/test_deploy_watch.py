"""The start-up watch fails only for replicas the cluster has no room for, not for slow ones."""

from __future__ import annotations

from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from kvmesh.deployments.deploy_watch import unschedulable_reason


def _status(required: str, available: str) -> ServeStatus:
    message = (
        "Deployment 'EngineReplica' in application 'kvmesh' has 3 replicas that have taken more than 30s to be "
        "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to be "
        f"installed. Resources required for each replica: {required}, total resources available: {available}. "
        "Use `ray status` for more details."
    )
    dep = DeploymentStatusOverview(
        status="UPDATING", status_trigger="CONFIG_UPDATE_STARTED", replica_states={}, message=message
    )
    app = ApplicationStatusOverview(
        status="DEPLOYING", message="", last_deployed_time_s=0.0, deployments={"EngineReplica": dep}
    )
    return ServeStatus(applications={"kvmesh": app})


def test_replicas_slow_to_start_on_a_loaded_machine_are_not_reported_unschedulable():
    """Serve says 'taken more than 30s to be scheduled' for replicas whose worker processes start slowly
    under load even when the cluster has room: seen with {"CPU": 0.53} needed and 2.31 free."""
    assert unschedulable_reason(_status('{"CPU": 0.53}', '{"CPU": 2.31}'), "kvmesh") is None
    assert unschedulable_reason(_status("{'CPU': 0.5}", "{'CPU': 0.5, 'memory': 1e9}"), "kvmesh") is None
    reason = unschedulable_reason(_status('{"CPU": 0.53}', '{"CPU": 0.31}'), "kvmesh")
    assert reason and reason.startswith("deployment EngineReplica: 3 replica(s) cannot be scheduled")
    assert unschedulable_reason(_status("{'GPU': 1}", "{'CPU': 4.0}"), "kvmesh")  # a resource it lacks entirely


# a joined cluster of 3 nodes x 3 CPUs running 3 engines of 2 CPUs (one per node) and the ingress (0.1 CPU)
SPLIT_NODES = [{"CPU": 1.0, "memory": 4e9}, {"CPU": 1.0}, {"CPU": 0.9, "node:__internal_head__": 1.0}]


def test_replicas_no_single_node_has_room_for_are_unschedulable_though_the_cluster_sum_fits():
    """Serve's free resources are the cluster's sum (2.9 CPUs free for a 2-CPU replica), but a replica is
    placed on one node: with 1, 1 and 0.9 free on three nodes it waits for ever."""
    status = _status('{"CPU": 2.0}', '{"CPU": 2.9}')
    reason = unschedulable_reason(status, "kvmesh", SPLIT_NODES)
    assert reason and reason.startswith("deployment EngineReplica: 3 replica(s) cannot be scheduled")
    assert "split across 3 nodes" in reason and "--num-cpus" in reason and "\n" not in reason
    # one node with room: only slow, not unschedulable
    assert unschedulable_reason(status, "kvmesh", [*SPLIT_NODES, {"CPU": 2.0}]) is None
    # fractional GPUs: 0.4 free on each of 2 GPU nodes, 0.8 in all, for a 0.6-GPU replica
    gpus = _status('{"CPU": 0.5, "GPU": 0.6}', '{"CPU": 10.0, "GPU": 0.8}')
    reason = unschedulable_reason(gpus, "kvmesh", [{"CPU": 5.0, "GPU": 0.4}, {"CPU": 5.0, "GPU": 0.4}])
    assert reason and "engine.num_gpus" in reason and "--num-cpus" not in reason
    assert unschedulable_reason(gpus, "kvmesh", [{"CPU": 5.0, "GPU": 0.4}, {"CPU": 0.5, "GPU": 1.0}]) is None


def test_the_advice_names_the_resources_that_are_short():
    """A GPU or a custom resource no node has got advice about CPUs only."""
    no_gpu = unschedulable_reason(_status('{"CPU": 0.5, "GPU": 1.0}', '{"CPU": 3.4}'), "kvmesh", [{"CPU": 3.4}])
    assert no_gpu and "GPU" in no_gpu and "engine.num_gpus" in no_gpu and "--num-cpus" not in no_gpu
    custom = unschedulable_reason(_status('{"CPU": 0.5, "kvmesh_engine": 1.0}', '{"CPU": 3.4}'), "kvmesh")
    assert custom and "ray start --resources" in custom and "kvmesh_engine" in custom
    assert "engine.resources" in custom and "--num-cpus" not in custom
    # each resource on some node, never together: both named
    both = unschedulable_reason(
        _status('{"CPU": 2.0, "GPU": 1.0}', '{"CPU": 5.0, "GPU": 1.0}'),
        "kvmesh",
        [{"CPU": 4.0}, {"CPU": 1.0, "GPU": 1.0}],
    )
    assert both and "--num-cpus" in both and "engine.num_gpus" in both


def _deploy_against(monkeypatch, status, nodes, **kwargs):
    """deploy_or_explain with Serve faked: serve.run waits until released (Serve's own wait for an app whose
    replicas are pending has no end); after 50 status polls the fake releases it, so a watch that never
    gives up returns instead of raising. Returns (the exception raised or None, status polls)."""
    import threading

    from ray import serve

    from kvmesh.deployments import deploy_watch

    release = threading.Event()
    polls = []

    def run(*args, **kw):
        release.wait()

    def fake_status():
        polls.append(1)
        if len(polls) >= 50:
            release.set()
        return status

    monkeypatch.setattr(serve, "run", run)
    monkeypatch.setattr(serve, "status", fake_status)
    monkeypatch.setattr(deploy_watch, "nodes_free_resources", lambda: nodes, raising=False)
    try:
        deploy_watch.deploy_or_explain(object(), {"name": "kvmesh", "route_prefix": "/"}, poll_s=0.0, **kwargs)
    except deploy_watch.DeploymentUnschedulable as exc:
        return exc, len(polls)
    finally:
        release.set()
        assert deploy_watch.end_deploys() == 0
    return None, len(polls)


def test_the_deploy_fails_when_no_node_can_take_a_pending_replica(monkeypatch):
    raised, polls = _deploy_against(monkeypatch, _status('{"CPU": 2.0}', '{"CPU": 2.9}'), SPLIT_NODES)
    assert raised is not None and "split across 3 nodes" in str(raised) and polls == 1


def test_the_deploy_gives_up_on_replicas_pending_past_the_limit(monkeypatch):
    """Some node seems to have room, yet Serve goes on reporting the replicas waiting: after `pending_polls`
    polls in a row the start fails with the reason Serve gives, instead of waiting for ever."""
    status = _status('{"CPU": 0.5}', '{"CPU": 2.0}')
    raised, polls = _deploy_against(monkeypatch, status, [{"CPU": 2.0}], pending_polls=3)
    assert raised is not None and polls == 3
    assert str(raised).startswith("deployment EngineReplica: 3 replica(s) still not scheduled")
    assert 'each needs {"CPU": 0.5}' in str(raised)
