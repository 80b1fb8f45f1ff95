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
