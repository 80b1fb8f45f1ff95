"""The app the live scale benches start, and how they read every ingress replica's `/kvmesh/state`.

One place for both: the multi-ingress benches compare setups that must differ only in the number of
ingress replicas and the router sync, and each needs the state of every replica behind one front."""

from __future__ import annotations

ENGINES = 4


def app_config(key: str, ingress: int, sync: bool) -> dict:
    """4 tiny-model engine replicas behind `ingress` ingress replicas, policy kvmesh, router sync on or off."""
    return {
        "replicas": ENGINES,
        "ingress_replicas": ingress,
        "router_sync": sync,
        "policy": "kvmesh",
        "port": 0,
        "api_keys": [key],
        "engine": {"model": "tiny", "max_model_len": 2048, "num_cpus": 0.4},
    }


def ingress_states(url: str, key: str, want: int, tries: int = 60, required: bool = True) -> dict[str, dict]:
    """/kvmesh/state of every ingress replica, by pid: the front picks a replica per request (leastconn,
    ties in turn), so asking again, on new connections with the earlier ones held open, reaches them all.
    Fewer than `want` after `tries`: an error, or what was reached when not `required`."""
    import httpx

    seen: dict[str, dict] = {}
    clients = []
    try:
        for _ in range(tries):
            c = httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"})
            clients.append(c)
            r = c.get(url + "/kvmesh/state")
            if r.status_code == 200:
                st = r.json()
                seen[str(st.get("pid"))] = st
            if len(seen) >= want:
                break
            if len(clients) >= 8:  # let leastconn start over
                for old in clients:
                    old.close()
                clients = []
    finally:
        for c in clients:
            c.close()
    if required and len(seen) < want:
        raise RuntimeError(f"reached {len(seen)} of {want} ingress replicas for /kvmesh/state")
    return seen
