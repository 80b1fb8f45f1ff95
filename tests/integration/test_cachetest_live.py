"""`kvmesh cachetest` against the live kvmesh app: a log with planted causes, each attributed to its reason.

Planted, in one sequential pass (then a concurrent one for load), in a fresh token space (a random
nonce in every text and fresh random token ids, so nothing here was cached by another test):
- drift: the base chat again with one extra space in its system prompt (same words, other tokens);
- isolated: tenant globex sends acme's base chat verbatim;
- partial_block: a token prompt, then the same prompt plus a 10-token tail (inside its last block);
- evicted: a prompt, then enough unique long prompts to push it out of both engines' 1024-block
  caches, then the prompt again;
- misrouted: a prefix computed on one replica, then 16 requests sharing it sent at once with long
  outputs: the router moves some to the other replica for load (ground truth: the replica headers).
Target: each planted cause gets >= 95% of its planted tokens; every request's reasons sum exactly.
"""

from __future__ import annotations

import json
import random
import uuid

import pytest
from tenant_app import KEYS

from kvmesh.cluster.cachetest_analysis import prepare
from kvmesh.cluster.request_log import parse_line
from kvmesh.deployments.cachetest import CachetestConfig, Runner

pytestmark = pytest.mark.integration

B = 32
SYSTEM = (
    "You are the support assistant of {nonce}. Answer briefly and politely, cite the document you rely on, "
    "never share one customer's data with another, and escalate billing disputes to a human. "
    "Tools: lookup_account(id); open_ticket(subject, body); refund(order, amount); search_docs(query)."
)


def _line(n: int, rid: str, tenant: str, body: dict, interaction: str | None = None) -> object:
    rec = {"id": rid, "tenant": tenant, "body": {"max_tokens": 4, **body}, "interaction": interaction or rid}
    return parse_line(json.dumps(rec), "planted", n)


def planted_log(rng: random.Random, vocab: int):
    nonce = uuid.uuid4().hex[:12]
    system = SYSTEM.format(nonce=nonce)
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Where is my data?"}]}
    variant = json.loads(json.dumps(chat))
    variant["messages"][0]["content"] = system.replace("You are", "You  are", 1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    tail = ids(4 * B + 3)
    evict = ids(30 * B)
    hot = ids(20 * B)
    seq = [
        ("base", "acme", chat),
        ("drift", "acme", variant),
        ("isolated", "globex", chat),
        ("tail-a", "acme", {"prompt": tail}),
        ("tail-b", "acme", {"prompt": tail + ids(10)}),
        ("evict-a", "acme", {"prompt": evict}),
    ]
    seq += [(f"flood-{i}", "default", {"prompt": ids(1900)}) for i in range(64)]
    seq += [("evict-b", "acme", {"prompt": evict}), ("hot-0", "acme", {"prompt": hot})]
    first = [_line(n + 1, rid, t, body) for n, (rid, t, body) in enumerate(seq)]
    load = [_line(1000 + i, f"hot-{i + 1}", "acme", {"prompt": hot + ids(40), "max_tokens": 64}) for i in range(16)]
    return first, load, len(hot) // B


def test_planted_causes_are_attributed_to_their_reasons(live_app, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    first, load, hot_blocks = planted_log(random.Random(uuid.uuid4().int), len(tok))
    prepared = prepare(first + load, tok, B)
    cfg = CachetestConfig(
        url=live_app.url,
        tenant_keys={"default": live_app.api_key, "acme": KEYS["acme"], "globex": KEYS["globex"]},
        block_size=B,
    )
    runner = Runner(cfg, prepared, tok)
    assert runner.is_kvmesh
    runner.send("planted", prepared[: len(first)], 1)
    runner.send("load", prepared[len(first) :], 16)
    report = runner.report({"prompt_tokens": 0})

    rows = {(r["pass"], r["id"]): r for r in report["requests"]}
    explained = {(s.pass_name, s.prepared.req.id): s.explain for run in runner.runs for s in run.sent}
    missing = [k for k, e in explained.items() if e is None]
    assert not missing, f"no /kvmesh/explain record for {missing[:5]}"
    for r in report["requests"]:
        assert r["cached_tokens"] is not None, r
        assert sum(r["miss_tokens"].values()) == r["prompt_tokens"] - r["cached_tokens"], r

    def share(pass_name: str, rid: str, reason: str) -> float:
        r = rows[(pass_name, rid)]
        planted = r["prompt_tokens"] - r["cached_tokens"] - r["miss_tokens"].get("partial_block", 0)
        assert planted > 0, r
        return r["miss_tokens"].get(reason, 0) / planted

    def why(rid: str) -> str:
        r = rows[("planted", rid)]
        return f"{r['cached_tokens']} cached, misses {r['miss_tokens']}, router {explained[('planted', rid)]}"

    assert share("planted", "drift", "drift") >= 0.95, why("drift")
    assert share("planted", "isolated", "isolated") >= 0.95, why("isolated")
    tail = rows[("planted", "tail-b")]
    assert tail["cached_tokens"] >= 4 * B
    assert tail["miss_tokens"] == {"partial_block": tail["prompt_tokens"] - tail["cached_tokens"]}
    assert share("planted", "evict-b", "evicted") >= 0.95, why("evict-b")

    # misrouting: ground truth from the replica headers -- the hot prefix was computed on `home`
    home = rows[("planted", "hot-0")]["replica"]
    moved = [r for (p, _), r in rows.items() if p == "load" and r["replica"] != home]
    planted = sum(max(0, hot_blocks * B - r["cached_tokens"]) for r in moved)
    got = sum(r["miss_tokens"].get("misrouted", 0) for r in moved)
    assert planted > 0, "the load did not move any request off the prefix's replica"
    assert got >= 0.95 * planted, (got, planted, moved)

    drift = report["drift_examples"][0]
    assert drift["id"] == "drift" and drift["kind"] == "whitespace"
    with live_app.client() as c:
        metrics = c.get("/metrics").text
        rid = runner.runs[0].sent[0].explain["request_id"]
        explain = c.get(f"/kvmesh/explain/{rid}").json()
    assert 'kvmesh_miss_tokens_total{reason="isolated",tenant="globex"}' in metrics
    assert explain["replica"] and "miss_tokens" in explain
