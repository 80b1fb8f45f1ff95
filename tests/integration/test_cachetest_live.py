"""`kvmesh cachetest` against the live kvmesh app: a log with planted causes, each attributed to its reason.

Planted in a fresh token space (a random nonce in every text and fresh random token ids, so nothing here
was cached by another test), sent by the cachetest runner (`deployments/cachetest.py`), every request's
server record read back from `/kvmesh/explain/{x-kvmesh-request-id}`:
- drift: the base chat again with one extra space in its system prompt (same words, other tokens);
- isolated: tenant globex sends acme's base chat verbatim;
- partial_block: a token prompt, then the same prompt plus a 10-token tail (inside its last block);
- evicted: a prompt, then unique long prompts until more blocks than the engine's whole cache (1024
  blocks) were allocated on the replica that computed it (counted from the replica headers), then the
  prompt again;
- misrouted: a prefix computed on one replica, then 16 requests sharing it sent at once with long
  outputs: the router moves some to the other replica for load (ground truth: the replica headers).
Target: each planted cause gets >= 95% of its planted tokens; every request's reasons sum exactly, in the
client's report and in the server's record. Also: kvmesh's own cache reset before a cold pass.
"""

from __future__ import annotations

import json
import random
import time
import uuid

import pytest
from tenant_app import KEYS

from kvmesh.cluster.cachetest_analysis import Prepared, prepare
from kvmesh.cluster.request_log import LoggedRequest, parse_line
from kvmesh.deployments.cachetest import CachetestConfig, Runner

pytestmark = pytest.mark.integration

B = 32
ENGINE_BLOCKS = 1024  # live_app's num_gpu_blocks_override
# a short shared prefix with long private tails: every request queued on the prefix's replica adds its
# tail's prefill to that replica's predicted wait (kvmesh policy: 1e-4 s a token + 10 ms a request), while
# moving costs recomputing only the prefix (4 blocks, weighted 30x: ~0.4 s), so the policy itself moves
# requests off the prefix's replica after a few are queued there: misrouting forced by load
HOT_BLOCKS = 4
LOAD_TAIL = 1000
FLOOD_TOKENS = 63 * B  # + 1 output token fits max_model_len 2048: 64 blocks allocated per request
SYSTEM = (
    "You are the support assistant of {nonce}. Answer briefly and politely, cite the document you rely on, "
    "never share one customer's data with another, and escalate billing disputes to a human. "
    "Tools: lookup_account(id); open_ticket(subject, body); refund(order, amount); search_docs(query)."
)


def _line(n: int, rid: str, tenant: str, body: dict) -> LoggedRequest:
    rec = {"id": rid, "tenant": tenant, "body": {"max_tokens": 4, **body}, "interaction": rid}
    return parse_line(json.dumps(rec), "planted", n)


class PlantedLog:
    """The planted requests, prepared (tokenised, hashed) with the served model's tokenizer."""

    def __init__(self, tokenizer, seed: int):
        rng = random.Random(seed)
        vocab = len(tokenizer)
        nonce = uuid.UUID(int=rng.getrandbits(128)).hex[:12]
        system = SYSTEM.format(nonce=nonce)
        chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Where is my data?"}]}
        variant = json.loads(json.dumps(chat))
        variant["messages"][0]["content"] = system.replace("You are", "You  are", 1)

        def ids(n: int) -> list[int]:
            return [rng.randrange(10, vocab) for _ in range(n)]

        tail, evict, hot = ids(4 * B + 3), ids(30 * B), ids(HOT_BLOCKS * B)
        self.hot_blocks = len(hot) // B
        n = iter(range(1, 10_000))
        self.first = [
            _line(next(n), rid, t, body)
            for rid, t, body in [
                ("base", "acme", chat),
                ("drift", "acme", variant),
                ("isolated", "globex", chat),
                ("tail-a", "acme", {"prompt": tail}),
                ("tail-b", "acme", {"prompt": tail + ids(10)}),
                ("evict-a", "acme", {"prompt": evict}),
            ]
        ]
        self.flood = [
            _line(next(n), f"flood-{i}", "default", {"prompt": ids(FLOOD_TOKENS), "max_tokens": 1}) for i in range(48)
        ]
        self.after = [
            _line(next(n), "evict-b", "acme", {"prompt": evict}),
            _line(next(n), "hot-0", "acme", {"prompt": hot + ids(8)}),
        ]
        self.load = [_line(next(n), f"hot-{i + 1}", "acme", {"prompt": hot + ids(LOAD_TAIL)}) for i in range(16)]
        everything = self.first + self.flood + self.after + self.load
        prepared = prepare(everything, tokenizer, B)
        by_id = {p.req.id: p for p in prepared}
        self.p = {name: [by_id[r.id] for r in group] for name, group in self._groups().items()}

    def _groups(self) -> dict[str, list[LoggedRequest]]:
        return {"first": self.first, "flood": self.flood, "after": self.after, "load": self.load}


def run_planted(url: str, api_key: str, tokenizer, seed: int) -> tuple[Runner, dict, PlantedLog, dict]:
    """Send the planted log; (runner, report, log, facts the test checks: the flood's count on the
    evicted prompt's replica)."""
    log = PlantedLog(tokenizer, seed)
    cfg = CachetestConfig(
        url=url, tenant_keys={"default": api_key, "acme": KEYS["acme"], "globex": KEYS["globex"]}, block_size=B
    )
    runner = Runner(cfg, [p for g in log.p.values() for p in g], tokenizer)
    assert runner.is_kvmesh
    first = runner.send("planted", log.p["first"], 1)
    home = {s.prepared.req.id: s.replica for s in first.sent}["evict-a"]
    # unique long prompts until the replica that computed evict-a allocated more blocks than it has
    flood: list[Prepared] = list(log.p["flood"])
    on_home = 0
    k = 0
    while on_home * (FLOOD_TOKENS // B + 1) <= ENGINE_BLOCKS and flood:
        batch, flood = flood[:8], flood[8:]
        run = runner.send(f"flood{k}", batch, 2)
        k += 1
        assert all(s.error is None for s in run.sent), [s.error for s in run.sent]
        on_home += sum(1 for s in run.sent if s.replica == home)
    time.sleep(1.0)  # the engines' BlockRemoved events reach the router's index
    runner.send("evict", log.p["after"], 1)
    runner.send("load", log.p["load"], 16)
    report = runner.report({"prompt_tokens": 0})
    return runner, report, log, {"home": home, "flood_on_home": on_home}


def check_planted(runner: Runner, report: dict, log: PlantedLog, facts: dict) -> dict:
    """The assertions; returns the measured shares (for the log)."""
    rows = {(r["pass"], r["id"]): r for r in report["requests"]}
    explained = {(s.pass_name, s.prepared.req.id): s.explain for run in runner.runs for s in run.sent}
    missing = [k for k, e in explained.items() if e is None]
    assert not missing, f"no /kvmesh/explain record for {missing[:5]}"
    for (p, rid), r in rows.items():
        assert r["cached_tokens"] is not None, r
        assert sum(r["miss_tokens"].values()) == r["prompt_tokens"] - r["cached_tokens"], r
        e = explained[(p, rid)]  # the server's own attribution of the same request sums exactly too
        assert e["prompt_tokens"] == r["prompt_tokens"] and e["cached_tokens"] == r["cached_tokens"], (r, e)
        assert sum(e["miss_tokens"].values()) == e["prompt_tokens"] - e["cached_tokens"], e
        assert e["replica"] == r["replica"], (r, e)
    for name, fig in report["passes"].items():
        assert sum(fig["miss_tokens"].values()) == fig["prompt_tokens"] - fig["cached_tokens"], (name, fig)

    def share(pass_name: str, rid: str, reason: str) -> float:
        r = rows[(pass_name, rid)]
        planted = r["prompt_tokens"] - r["cached_tokens"] - r["miss_tokens"].get("partial_block", 0)
        assert planted > 0, r
        return r["miss_tokens"].get(reason, 0) / planted

    def why(pass_name: str, rid: str) -> str:
        r = rows[(pass_name, rid)]
        return f"{r['cached_tokens']} cached, misses {r['miss_tokens']}, router {explained[(pass_name, rid)]}"

    shares: dict[str, object] = {}
    shares["drift"] = share("planted", "drift", "drift")
    assert shares["drift"] >= 0.95, why("planted", "drift")
    drift = report["drift_examples"][0]
    assert drift["id"] == "drift" and drift["kind"] == "whitespace", drift

    shares["isolated"] = share("planted", "isolated", "isolated")
    assert shares["isolated"] >= 0.95, why("planted", "isolated")
    # the server tells isolated apart on its own (the same tokens under another tenant's salt)
    iso = explained[("planted", "isolated")]["miss_tokens"]
    assert iso.get("isolated", 0) >= 0.95 * (sum(iso.values()) - iso.get("partial_block", 0)), iso

    tail = rows[("planted", "tail-b")]
    assert tail["cached_tokens"] >= 4 * B, why("planted", "tail-b")
    assert tail["miss_tokens"] == {"partial_block": tail["prompt_tokens"] - tail["cached_tokens"]}
    shares["partial_block"] = 1.0

    assert facts["flood_on_home"] * (FLOOD_TOKENS // B + 1) > ENGINE_BLOCKS, facts
    shares["evicted"] = share("evict", "evict-b", "evicted")
    assert shares["evicted"] >= 0.95, why("evict", "evict-b")
    ev = explained[("evict", "evict-b")]
    assert ev["elsewhere_blocks"] == 0, ev

    # misrouting: ground truth from the replica headers -- the hot prefix was computed on `hot_home`
    hot_home = rows[("evict", "hot-0")]["replica"]
    load = [(r, explained[("load", r["id"])]) for (p, _), r in rows.items() if p == "load"]
    keys = ("predicted_blocks", "elsewhere_blocks", "router_reason", "prefix_blocks")
    detail = [(r["id"], r["replica"], r["cached_tokens"], r["miss_tokens"], {k: e[k] for k in keys}) for r, e in load]
    moved = [r for r, _ in load if r["replica"] != hot_home]
    planted = sum(max(0, log.hot_blocks * B - r["cached_tokens"]) for r in moved)
    got = sum(r["miss_tokens"].get("misrouted", 0) for r in moved)
    assert planted > 0, ("the load did not move any request off the prefix's replica", hot_home, detail)
    shares["misrouted"] = got / planted
    assert got >= 0.95 * planted, (got, planted, hot_home, detail)
    # the router placed some knowingly where less of the prefix was (the rest of the moved requests may have
    # followed the prefix it had just sent there), and says why
    knowing = [e for _, e in load if e["elsewhere_blocks"] > e["predicted_blocks"]]
    assert knowing, (hot_home, detail)
    reasons = sorted({e["router_reason"] for e in knowing})
    assert set(reasons) <= {"load", "balance_guard", "serve_fallback"}, (hot_home, detail)
    shares["moved"] = len(moved)
    shares["router_reasons"] = reasons
    return shares


def test_planted_causes_are_attributed_to_their_reasons(live_app, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    runner, report, log, facts = run_planted(live_app.url, live_app.api_key, tok, uuid.uuid4().int)
    shares = check_planted(runner, report, log, facts)
    print("planted shares", shares, facts)
    with live_app.client() as c:
        metrics = c.get("/metrics").text
    assert 'kvmesh_miss_tokens_total{reason="isolated",tenant="globex"}' in metrics


def test_kvmesh_resets_every_engine_cache_before_the_cold_pass(live_app, tiny_model_dir):
    """`POST /kvmesh/reset_prefix_cache` empties every engine replica's prefix cache, the router's index
    follows (the engines' AllBlocksCleared events), and the cachetest runner uses it before its cold pass."""
    from kvmesh.deployments.cachetest import reset_cache

    rng = random.Random(uuid.uuid4().int)
    prompt = [rng.randrange(10, 1000) for _ in range(4 * B + 5)]
    with live_app.client() as c:

        def send() -> tuple[int, str, str]:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            return cached, r.headers["x-kvmesh-replica"], r.headers["x-kvmesh-predicted-cached-tokens"]

        send()
        cached, replica, predicted = send()
        assert (cached, predicted) == (4 * B, str(4 * B))
        assert c.post("/kvmesh/reset_prefix_cache", headers={"Authorization": "Bearer nope"}).status_code == 401
        resp = c.post("/kvmesh/reset_prefix_cache")
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["reset"] is True and len(body["replicas"]) == live_app.config["replicas"], body
        assert replica in body["replicas"] and all(body["replicas"].values()), body
        time.sleep(1.0)  # the AllBlocksCleared events reach the router's index
        cached, _, predicted = send()
        assert (cached, predicted) == (0, "0")
    cfg = CachetestConfig(url=live_app.url, api_key=live_app.api_key, block_size=B)
    assert reset_cache(cfg) == "/kvmesh/reset_prefix_cache"
