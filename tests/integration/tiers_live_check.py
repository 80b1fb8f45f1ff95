"""Run by tests/integration/test_tiers_live.py in its own process (its own Ray, apart from the session's live app):
the kvmesh app with LMCache on the engines' path, checked end to end. Prints one JSON line of findings.

    python tests/tiers_live_check.py WORKDIR
"""

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "support"))  # run as a script, outside pytest's conftest
from ingress_routers import router_states  # noqa: E402


def held_for_inflight(url: str, headers: dict, model: str, pairs: int = 4) -> dict:
    """A request whose prompt another replica is computing right now waits for that prefill, then loads
    the prompt from the node's LMCache server instead of computing it again: in each pair, `second`, sent
    30 ms after `first` with the same new 1,280-token prompt, is placed on the other replica by the balance
    guard (strict in this app: `policy_params`) unless the replicas are even. Each request has a connection
    of its own, so HAProxy spreads them over the two ingress replicas: a pair whose requests two routers
    placed shows the hold across routers (the first's router publishes its first token). Returns, per
    pair, each request's replica, cached tokens, router and the router's predicted cached tokens, and each
    router's hold counters."""
    import concurrent.futures

    import httpx

    def send(prompt: list[int], delay_s: float = 0.0) -> tuple[str, int, str, int]:
        time.sleep(delay_s)
        with httpx.Client(timeout=180, headers=headers) as fresh:
            r = fresh.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})
        r.raise_for_status()
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(r.headers.get("x-kvmesh-predicted-cached-tokens", -1))
        return r.headers["x-kvmesh-replica"], cached, r.headers["x-kvmesh-request-id"], predicted

    placed = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for k in range(pairs):
            base = [(i * 104729 + k * 31) % 1000 + 10 for i in range(1280)]
            first = pool.submit(send, base + [1] * 8)
            second = pool.submit(send, base + [2] * 8, 0.03)
            placed.append([first.result(), second.result()])
    time.sleep(1.0)  # the last requests' `done` and `started` reach the other router
    routers = router_states(url, headers)
    by_request = {d.get("request_id"): rid for rid, st in routers.items() for d in st.get("recent_decisions", []) if d}
    return {
        "pairs": [[[rep, cached, by_request.get(req), pred] for rep, cached, req, pred in pair] for pair in placed],
        "routers": {
            rid: {"held_for_tier": st.get("held_for_tier"), "hold_timeouts": st.get("hold_timeouts")}
            for rid, st in routers.items()
        },
        "tiers": {rid: st.get("tiers") for rid, st in routers.items()},
    }


def prefills_recorded(url: str, headers: dict) -> dict[str, int]:
    """Per router (ingress replica): how many completed prefills it has recorded in its tier view."""
    return {rid: (st.get("tiers") or {}).get("prefills_recorded", 0) for rid, st in router_states(url, headers).items()}


def parted_inside_a_chunk(c, url: str, headers: dict, model: str, rounds: int = 4) -> list[list]:
    """Per round: `a`, a new 712-token prompt (22 full blocks of 32, 11 LMCache chunks of 64), then `b`, which
    shares its first 21 blocks (672 tokens) and goes on differently, once both routers have recorded `a`'s
    prefill (the other ingress replica hears of it on the placement stream). Placed on the other replica
    (the strict guard sends it to the one with less work), `b` can load only the 10 chunks before the point
    where the prompts part, since LMCache keys a chunk by every token up to its end: 640 cached tokens,
    which the router must predict. Returns [a's replica, b's replica, b's cached tokens, b's predicted
    cached tokens] per round."""

    def send(prompt: list[int]) -> tuple[str, int, int]:
        r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
        r.raise_for_status()
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return r.headers["x-kvmesh-replica"], cached, int(r.headers.get("x-kvmesh-predicted-cached-tokens", -1))

    out = []
    for k in range(rounds):
        shared = [(i * 6151 + k * 17) % 1000 + 10 for i in range(672)]
        before = prefills_recorded(url, headers)
        a = send(shared + [3] * 40)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = prefills_recorded(url, headers)
            if len(now) >= 2 and all(now[rid] > before.get(rid, 0) for rid in now):
                break
            time.sleep(0.1)
        b = send(shared + [4] * 40)
        out.append([a[0], b[0], b[1], b[2]])
    return out


def main() -> int:
    root = sys.argv[1]
    ray_tmp = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    os.environ["RAY_TMPDIR"] = ray_tmp
    os.environ.setdefault("KVMESH_LOG_DIR", os.path.join(root, "logs"))
    import httpx

    from kvmesh.cluster.ports import free_port
    from kvmesh.deployments.app import start_local, stop_local

    key = "kvm-tiers-live-key-0123456789"
    cfg = {
        "replicas": 2,
        "ingress_replicas": 2,  # two routers: the hold below works across them
        "policy": "kvmesh",
        # a strict balance guard: a request that shares a prompt another replica is computing goes elsewhere
        "policy_params": {"guard_weight": 1000, "balance_slack": 0.0},
        "port": free_port(),
        "api_keys": [key],
        "routing_stats_period_s": 0.5,
        "engine": {
            "model": "tiny",
            "block_size": 32,
            "max_model_len": 2048,
            "num_gpu_blocks_override": 256,
            "lmcache": {
                "l1_size_gb": 0.05,
                "chunk_size": 64,
                "l2": "fs",
                "l2_path": os.path.join(root, "l2"),
                "start_timeout_s": 300,
            },
        },
    }
    found = {}
    try:
        url = start_local(cfg, num_cpus=2, timeout_s=900)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=180) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            # the router learns each replica's tiers from its routing stats (every 0.5 s here); a prefill it
            # serves before then is not recorded as a host-tier entry, so wait until both replicas reported
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                stats = ((c.get("/kvmesh/state").json().get("router") or {}).get("routing_stats")) or {}
                if len(stats) >= 2 and all(s.get("tiers") for s in stats.values()):
                    break
                time.sleep(0.25)
            prompt = [(i * 7919) % 1000 + 10 for i in range(600)]
            cached = []
            for _ in range(2):
                r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
                r.raise_for_status()
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            found["cached"] = cached
            found["held"] = held_for_inflight(url, {"Authorization": f"Bearer {key}"}, model)
            found["parted"] = parted_inside_a_chunk(c, url, {"Authorization": f"Bearer {key}"}, model)
            time.sleep(2.0)
            r = c.get("/kvmesh/state")
            if r.status_code != 200:
                raise RuntimeError(f"/kvmesh/state -> {r.status_code}: {r.text[:300]}")
            state = r.json()
            found["router_tiers"] = (state.get("router") or {}).get("tiers")
            found["tier_report"] = state.get("tiers")
            routing_stats = (state.get("router") or {}).get("routing_stats", {})
            found["tier_stats"] = {rid: s.get("tiers") for rid, s in routing_stats.items()}
            found["loaded"] = {rid: s.get("external_hit_tokens") for rid, s in routing_stats.items()}
            metrics = c.get("/metrics").text
            found["metrics_lines"] = [line for line in metrics.splitlines() if line.startswith("kvmesh_tier_")]
    except Exception as exc:
        found["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        stop_local()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
