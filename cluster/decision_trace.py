"""Decision traces: what a router saw per replica when it placed each request, in one form for the live
router (`/kvmesh/state` `recent_decisions`) and the simulator, and where two traces of one workload part.

Why: a simulated placement that differs from the live one says the simulator does not model something the
live path does, but not what. The first request the two place differently, with each side's view of the
fleet then (prefix blocks per tier, queue, pending prefill, the balance guard's work), shows whether the
live router saw a prefix, a queue or a load the simulator did not, or saw the same and chose otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# per replica, in this order: prefix blocks in hbm, hbm or host, any tier; requests waiting for a first token;
# requests decoding; prefill tokens sent and not yet computed; the policy's balance-guard work; the policy's
# score (lower ranks first). The last two are None for a policy that keeps none.
CELLS = ("hbm", "host", "shared", "queued", "running", "pending", "work", "score")
# replicas a decision keeps beyond the chosen one: the best scored (a trace of a large fleet stays small)
TRACED_REPLICAS = 8


def ranking_cells(policy, fleet, top: int, limit: int = TRACED_REPLICAS) -> dict[str, list]:
    """What `policy` saw of `fleet` (a `FleetView`) when it ranked replica `top` first, as `replica_cells`:
    every replica up to `limit`, else `top` and the `limit` best scored (the longest prefixes when the policy
    keeps no scores). Call it after ranking and before the placement is credited: the guard's work is read
    as ranking used it."""
    scores = getattr(policy, "last_scores", None)
    if scores is not None and len(scores) != len(fleet.ids):
        scores = None
    n = len(fleet.ids)
    if n <= limit:
        keep = list(range(n))
    else:
        key = np.nan_to_num(scores, nan=np.inf) if scores is not None else -np.asarray(fleet.shared_blocks)
        keep = sorted({*np.argsort(key, kind="stable")[:limit].tolist(), top})
    ids = [fleet.ids[k] for k in keep]
    cols = (fleet.hbm_blocks, fleet.host_blocks, fleet.shared_blocks, fleet.queued, fleet.running)
    views = {rid: [*(int(c[k]) for c in cols), int(fleet.pending_prefill_tokens[k])] for rid, k in zip(ids, keep)}
    recent_work = getattr(policy, "recent_work", None)
    work = recent_work(ids) if recent_work is not None else None
    by_id = {rid: float(scores[k]) for rid, k in zip(ids, keep)} if scores is not None else None
    return replica_cells(views, work, by_id)


def replica_cells(
    views: Mapping[str, Sequence[int]],
    work: Mapping[str, float] | None,
    scores: Mapping[str, float] | None = None,
) -> dict[str, list]:
    """replica -> `CELLS` from the view fields (the first six), the guard's work and the score per replica."""
    return {rid: [*(int(x) for x in v), _rounded(work, rid, 1), _rounded(scores, rid, 5)] for rid, v in views.items()}


def _rounded(values: Mapping[str, float] | None, rid: str, digits: int) -> float | None:
    if values is None:
        return None
    x = float(values.get(rid, 0.0))
    return round(x, digits) if x == x else None  # NaN (no score): none


def decision(request_id: Any, chosen: str, replicas: dict[str, list], **more: Any) -> dict:
    """One placement: the request, the replica it went to, each replica's `CELLS` as ranking saw them, and
    whatever else the side knows (time, re-rankings, holds, the first choice)."""
    return {"request_id": request_id, "chosen": chosen, "replicas": replicas, **more}


def first_divergence(a: Sequence[dict], b: Sequence[dict], order: Sequence[Any]) -> dict | None:
    """The first request, taking `order` (request keys, e.g. the simulator's routing order), that the two
    traces place on different replicas once each side's replicas are renamed r0, r1, ... by first use; with
    both sides' decisions renamed alike. None when they agree throughout.

    Why renamed: replica names differ between runs, and two idle replicas are interchangeable; up to the
    first divergence the two placements are the same up to this renaming, so the names match there."""
    by_a = {d["request_id"]: d for d in a}
    by_b = {d["request_id"]: d for d in b}
    names_a: dict[str, str] = {}
    names_b: dict[str, str] = {}
    for position, key in enumerate(order):
        da, db = by_a.get(key), by_b.get(key)
        if da is None or db is None:
            continue
        x, y = da["chosen"], db["chosen"]
        # agree: both sides use a replica new to them, or replicas of the same name
        if (x in names_a) != (y in names_b) or (x in names_a and names_a[x] != names_b[y]):
            div = {"request": key, "position": position, "a": _renamed(da, names_a), "b": _renamed(db, names_b)}
            return {**div, "sent_apart": _sent_apart(a, b)}
        if x not in names_a:  # both sides' counts of used replicas are equal up to here
            names_a[x] = names_b[y] = f"r{len(names_a)}"
    return None


def _sent_apart(a: Sequence[dict], b: Sequence[dict]) -> list | None:
    """[position, a's request, b's request] where the two sides' own routing orders first differ (None: the
    same order throughout the shorter): placed alike up to a request ranked at another moment, with other
    requests in flight, the two need not have seen the same fleet."""
    for position, (da, db) in enumerate(zip(a, b)):
        if da["request_id"] != db["request_id"]:
            return [position, da["request_id"], db["request_id"]]
    return None


def _renamed(d: dict, names: dict[str, str]) -> dict:
    """`d` with replica ids replaced by first-use names (unused replicas named u0, u1, ... in sorted order)."""
    unused = [rid for rid in sorted(d["replicas"]) if rid not in names]
    full = {**names, **{rid: f"u{k}" for k, rid in enumerate(unused)}}
    replicas = {full[rid]: cells for rid, cells in sorted(d["replicas"].items(), key=lambda kv: full[kv[0]])}
    out = {**d, "chosen": full.get(d["chosen"], d["chosen"]), "replicas": replicas}
    if out.get("first_choice"):
        out["first_choice"] = full.get(out["first_choice"], out["first_choice"])
    return out


def format_divergence(div: dict, a_name: str = "live", b_name: str = "sim", head: str = "") -> list[str]:
    """A few lines (the first starting with `head`): the request, and per side the replica chosen and each
    replica's `CELLS`."""
    lines = [f"{head}first placement that differs: request {div['request']} (#{div['position']} in order)"]
    if (apart := div.get("sent_apart")) is not None and apart[0] <= div["position"]:
        lines.append(f"    routed in another order from #{apart[0]}: {a_name} {apart[1]}, {b_name} {apart[2]}")
    for name, d in ((a_name, div["a"]), (b_name, div["b"])):
        shown = {k: d.get(k) for k in ("rankings", "held")}
        if d.get("first_choice") != d["chosen"]:  # Serve placed it elsewhere than the policy's first choice
            shown["first_choice"] = d.get("first_choice")
        extra = "".join(f", {k} {v}" for k, v in shown.items() if v not in (None, False, "", 1))
        t = f" at {d['t_s']:.3f}s" if d.get("t_s") is not None else ""
        lines.append(f"    {name}{t}: to {d['chosen']}{extra}")
        for rid, cells in d["replicas"].items():
            row = " ".join(f"{k} {v}" for k, v in zip(CELLS, cells) if v is not None)
            lines.append(f"      {rid}: {row}")
    return lines
