"""Run by tests/integration/test_autoscale.py in its own process (its own Ray, apart from the session's live
app): the engine deployment autoscaled by Serve (config `autoscaling:`), driven by load from 1 replica to 3
and back to 1 while requests keep flowing. Prints one JSON line of findings.

    python tests/integration/autoscale_check.py WORKDIR
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

# Small delays so a test sees both directions in a minute or two; target 1 request per replica.
AUTOSCALING = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 3,
    "target_ongoing_requests": 1,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 4,
}


async def _client(c, model: str, stop: asyncio.Event, tally: dict, k: int, max_tokens: int) -> None:
    n = 0
    while not stop.is_set():
        prompt = [(k * 131 + i * 17 + n) % 900 + 10 for i in range(96)]
        n += 1
        try:
            r = await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens})
            tally["ok" if r.status_code == 200 else "failed"] += 1
            if r.status_code != 200:
                tally["errors"].append(f"{r.status_code} {r.text[:200]}")
            else:
                tally["replicas"].add(r.headers["x-kvmesh-replica"])
        except Exception as exc:
            tally["failed"] += 1
            tally["errors"].append(f"{type(exc).__name__}: {exc}"[:200])


async def _drive(url: str, key: str, found: dict) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]

        async def router() -> dict:
            return (await c.get("/kvmesh/state")).json()["router"] or {"replicas": [], "routing_stats": {}}

        async def wait_for(pred, timeout_s: float):
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                st = await router()
                if pred(st):
                    return st
                await asyncio.sleep(1.0)
            return None

        tally: dict = {"ok": 0, "failed": 0, "errors": [], "replicas": set()}
        r = await c.post("/v1/completions", json={"model": model, "prompt": [11] * 40, "max_tokens": 1})
        tally["ok" if r.status_code == 200 else "failed"] += 1  # the ingress's router exists from here on
        found["replicas_at_start"] = len(
            (await wait_for(lambda st: st["routing_stats"], 60) or {}).get("routing_stats", {})
        )
        # heavy load: 6 clients with long answers keep ~6 requests in flight, twice the 3 replicas' target
        stop = asyncio.Event()
        heavy = [asyncio.create_task(_client(c, model, stop, tally, k, 48)) for k in range(6)]
        up = await wait_for(lambda st: len(st["replicas"]) >= 3, 420)
        found["scaled_up"] = up is not None
        found["replicas_at_peak"] = len(up["replicas"]) if up else len((await router())["replicas"])
        await asyncio.sleep(3.0)  # traffic reaches the new replicas
        stop.set()
        await asyncio.gather(*heavy)
        found["replicas_serving_at_peak"] = len(tally["replicas"])
        # light load while Serve removes replicas: one client, short answers, must never fail
        stop = asyncio.Event()
        light = asyncio.create_task(_client(c, model, stop, tally, 99, 1))
        down = await wait_for(lambda st: len(st["replicas"]) == 1 and len(st["routing_stats"]) == 1, 300)
        await asyncio.sleep(2.0)
        stop.set()
        await light
        st = await router()
        found["scaled_down"] = down is not None
        found["replicas_at_end"] = len(st["replicas"])
        found["forgotten"] = st["forgotten"]
        found["held_back"] = st["held_back"]
        found["subscribers"] = len(st["subscribers"])
        found["ok"], found["failed"], found["errors"] = tally["ok"], tally["failed"], tally["errors"][:5]


def main() -> int:
    root = sys.argv[1]
    os.environ.setdefault("KVMESH_LOG_DIR", os.path.join(root, "logs"))
    os.environ["KVMESH_HOME"] = os.path.join(root, "home")
    ray_tmp = tempfile.mkdtemp(prefix="kva-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    os.environ["RAY_TMPDIR"] = ray_tmp
    from kvmesh.benchmarks.local_cluster import patient_node_start
    from kvmesh.cluster.ports import free_port
    from kvmesh.deployments.app import start_local, stop_local

    patient_node_start()  # a busy machine can take longer than Ray's 30 s to register the node

    key = "kvm-autoscale-key-0123456789"
    cfg = {
        "policy": "kvmesh",
        "port": free_port(),
        "api_keys": [key],
        "proxy": "serve",
        "routing_stats_period_s": 0.5,
        "autoscaling": AUTOSCALING,
        "engine": {"model": "tiny", "num_gpu_blocks_override": 256},
    }
    found: dict = {}
    try:
        url = start_local(cfg, num_cpus=2, timeout_s=900)
        asyncio.run(_drive(url, key, found))
    except Exception as exc:
        found["error"] = f"{type(exc).__name__}: {exc}"[:800]
        found["trace"] = traceback.format_exc()[-2000:]
    finally:
        stop_local()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
