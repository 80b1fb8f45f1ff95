"""The gloo process groups an in-process engine makes share one transport device (one TCP loop thread)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import collections, json, os, sys
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from kvmesh.deployments.gloo_device import one_gloo_device

    def loops():
        task = f"/proc/{os.getpid()}/task"
        names = collections.Counter(open(f"{task}/{t}/comm").read().strip() for t in os.listdir(task))
        return names["gloo_tcp_loop"]

    base = c10d.ProcessGroupGloo
    shared = sys.argv[2] == "shared"
    ctx = one_gloo_device() if shared else __import__("contextlib").nullcontext()
    with ctx:
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", world_size=1, rank=0)
        groups = [dist.new_group([0], backend="gloo") for _ in range(12)]
    sums = []
    for g in groups:  # every group still works: a collective, a barrier, a broadcast
        t = torch.full((3,), 2.0)
        dist.all_reduce(t, group=g)
        dist.barrier(group=g)
        dist.broadcast(t, 0, group=g)
        sums.append(t.sum().item())
    backend = groups[0]._get_backend(torch.device("cpu"))
    print(json.dumps({"loops": loops(), "sums": sums, "restored": c10d.ProcessGroupGloo is base,
                      "is_gloo": isinstance(backend, base)}))
    dist.destroy_process_group()
    """
)


def _run(tmp_path, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / f"store-{mode}"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_groups_made_inside_share_one_gloo_device_and_still_work(tmp_path):
    alone, shared = _run(tmp_path, "alone"), _run(tmp_path, "shared")
    assert alone["loops"] == 13  # torch's way: a device, and its TCP loop thread, per group (12 + the default)
    assert shared["loops"] == 1
    assert shared["sums"] == alone["sums"] == [6.0] * 12
    assert shared["restored"] and shared["is_gloo"]
