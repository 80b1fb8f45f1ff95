"""Miss attribution: one reason per uncached token, summing exactly, on hand-made and random cases."""

import random

from kvmesh.cluster.cachetest_analysis import MissAnalyzer, Prepared, Sent
from kvmesh.cluster.miss_reasons import REASONS, attribute, drift_kind
from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass, shared_prefixes
from kvmesh.cluster.request_log import LoggedRequest

B = 32


def test_reasons_sum_exactly_to_uncached_tokens_on_random_inputs():
    rng = random.Random(0)
    for _ in range(5000):
        n = rng.randint(0, 400)
        cached = rng.randint(0, n)
        kw = dict(
            seen_blocks=rng.randint(0, 14),
            isolated_blocks=rng.randint(0, 14),
            adapter_blocks=rng.randint(0, 14),
            drift_end=rng.randint(0, 450),
            partial_end=rng.randint(0, 450),
            elsewhere_blocks=rng.choice([None, rng.randint(0, 14)]),
            tier_blocks=rng.randint(0, 14),
        )
        out = attribute(n, cached, B, **kw)
        assert sum(out.values()) == n - cached, (n, cached, kw, out)
        assert set(out) <= set(REASONS) and all(v > 0 for v in out.values())


def test_each_reason_in_its_place():
    assert attribute(100, 96, B) == {"partial_block": 4}  # 3 full blocks served, the tail never is
    assert attribute(100, 0, B) == {"cold": 96, "partial_block": 4}
    assert attribute(100, 32, B, seen_blocks=3, elsewhere_blocks=2) == {
        "misrouted": 32,
        "evicted": 32,
        "partial_block": 4,
    }
    # a tier held 3 blocks but could load only 2 (whole chunks): the third is not an eviction
    assert attribute(100, 32, B, seen_blocks=3, elsewhere_blocks=1, tier_blocks=2) == {
        "partial_chunk": 32,
        "evicted": 32,
        "partial_block": 4,
    }
    assert attribute(100, 0, B, seen_blocks=2) == {"unknown": 64, "cold": 32, "partial_block": 4}
    assert attribute(100, 0, B, isolated_blocks=3) == {"isolated": 96, "partial_block": 4}
    assert attribute(100, 0, B, adapter_blocks=1, drift_end=70) == {
        "adapter": 32,
        "drift": 38,
        "cold": 26,
        "partial_block": 4,
    }
    assert attribute(100, 32, B, seen_blocks=1, partial_end=48) == {"partial_block": 20, "cold": 48}


def test_drift_kinds():
    assert drift_kind("a  b", "a b") == "whitespace"
    assert drift_kind("<|user|>a b", "## a: b") == "template"
    assert drift_kind("Tools: x; y", "Tools: y; x") == "tool order"
    assert drift_kind("ab", "a b c") == "tokenizer"


def _tok(i, tenant, ids, model="m"):
    return TokenizedRequest(i, f"r{i}", tenant, model, list(ids))


def test_offline_share_and_bounds_on_token_prompts():
    base = list(range(10, 10 + 100))
    reqs = [
        _tok(0, "a", base),
        _tok(1, "a", base[:70] + [500] * 30),  # shares 70 tokens (2 full blocks) with request 0
        _tok(2, "b", base),  # another tenant: shares nothing under salts
    ]
    hash_requests(reqs, B)
    assert shared_prefixes(reqs) == [0, 70, 0]
    assert shared_prefixes(reqs, by_tenant=False) == [0, 70, 100]
    off = offline_pass(reqs, B, replicas=(1, 2))
    assert off["repeated_prefix_share"] == 70 / 300
    assert off["infinite_cache"]["cached_tokens"] == 64
    assert off["round_robin_infinite"]["2"]["cached_tokens"] == 0  # request 1 lands on the other cache


def _prep(i, tenant, ids, model="m"):
    t = _tok(i, tenant, ids, model)
    return Prepared(LoggedRequest(t.id, {"prompt": ids}, "/v1/completions", tenant), t)


def test_the_analyzer_finds_isolation_adapter_and_recomputation():
    base = list(range(10, 10 + 130))
    ps = [_prep(0, "a", base), _prep(1, "b", base), _prep(2, "a", base, model="lora2"), _prep(3, "a", base)]
    hash_requests([p.tok for p in ps], B)
    sent = [Sent(p, "warm", float(i), float(i) + 0.5, 130, 0, "r0", model=p.tok.model) for i, p in enumerate(ps)]
    reasons = MissAnalyzer(B).run(sent)
    assert reasons[0] == {"cold": 128, "partial_block": 2}
    assert reasons[1] == {"isolated": 128, "partial_block": 2}
    assert reasons[2] == {"adapter": 128, "partial_block": 2}
    assert reasons[3] == {"unknown": 128, "partial_block": 2}  # computed before: no router said where it went
    sent[3].explain = {"elsewhere_blocks": 1}
    assert MissAnalyzer(B).run(sent)[3] == {"misrouted": 32, "evicted": 96, "partial_block": 2}


def test_concurrent_requests_with_one_prefix_are_both_cold():
    base = list(range(10, 74))
    ps = [_prep(0, "a", base), _prep(1, "a", base)]
    hash_requests([p.tok for p in ps], B)
    sent = [Sent(ps[0], "cold", 0.0, 1.0, 64, 0, "r"), Sent(ps[1], "cold", 0.5, 1.5, 64, 0, "r")]
    assert MissAnalyzer(B).run(sent) == [{"cold": 32, "partial_block": 32}, {"cold": 32, "partial_block": 32}]


def test_a_twin_under_another_model_is_an_adapter_miss_not_a_partial_block():
    """A chat's twin (same words) sent under another model shares every token: the match runs past the next
    block, so it is not a match shorter than a block (`partial_block`) but the other model's cache."""
    from kvmesh.cluster.miss_reasons import unit_key

    base = list(range(10, 140))
    units = [(unit_key("user", "hello world"), 130)]

    def prep(i: int, model: str) -> Prepared:
        tok = TokenizedRequest(i, f"r{i}", "a", model, list(base))
        body = {"model": model, "messages": [{"role": "user", "content": "hello world"}]}
        return Prepared(LoggedRequest(tok.id, body, "/v1/chat/completions", "a"), tok, units)

    prepared = [prep(0, "m"), prep(1, "lora2")]
    hash_requests([p.tok for p in prepared], 32)
    sent = [Sent(p, "warm", float(i), float(i) + 0.5, 130, 0, "r0", model=p.tok.model) for i, p in enumerate(prepared)]
    assert MissAnalyzer(32).run(sent)[1] == {"partial_block": 2, "adapter": 128}


def test_misses_are_attributed_by_the_model_sent_not_the_model_logged():
    """The runner sends every request as the served model: two logged models sent as one are one model's
    history, so a prompt computed before under it and held nowhere is `evicted`, not `adapter`."""
    base = list(range(10, 110))  # 3 full blocks and a 4-token tail
    ps = [_prep(0, "a", base, model="tiny"), _prep(1, "a", base, model="tiny-lora")]
    hash_requests([p.tok for p in ps], B)
    held_nowhere = {"elsewhere_blocks": 0, "tier_blocks": 0}  # kvmesh's record: no replica held it
    sent = [
        Sent(p, "cold", 5.0 * i, 5.0 * i + 0.1, 100, 0, "r0", explain=held_nowhere, model="tiny")
        for i, p in enumerate(ps)
    ]
    assert MissAnalyzer(B).run(sent)[1] == {"evicted": 96, "partial_block": 4}
    # sent as another model, the same tokens are the other model's cache
    sent[1].model = "tiny-lora"
    assert MissAnalyzer(B).run(sent)[1] == {"adapter": 96, "partial_block": 4}


def test_the_runner_records_the_model_it_sent_each_request_as():
    from kvmesh.deployments.cachetest import _record, _sent
    from kvmesh.deployments.replay import RequestResult

    p = _prep(0, "a", list(range(10, 50)), model="logged-model")
    assert _record(p, "served")["body"]["model"] == "served"
    (s,) = _sent([p], [RequestResult(0, "u", "a", 40, 0, 1, 0.1, 0.2, "r0")], "cold", 0.0, model="served")
    assert s.model == "served"


def test_a_log_naming_two_models_sent_as_the_served_one_has_no_adapter_misses(monkeypatch):
    """The runner's own report: the log names `tiny` and `tiny-lora`, the runner sends both as the served
    model, so the second prompt (the first's tokens, computed before) is not the other model's cache."""
    import kvmesh.deployments.cachetest as ct
    from kvmesh.deployments.replay import ReplayReport, RequestResult

    base = list(range(10, 110))
    ps = [_prep(0, "a", base, model="tiny"), _prep(1, "a", base, model="tiny-lora")]
    hash_requests([p.tok for p in ps], B)
    monkeypatch.setattr(ct, "discover", lambda cfg: (["served"], False))
    results = [RequestResult(i, "u", "a", 100, 0, 1, 0.1, 0.2, "r0", None, 5.0 * i) for i in range(2)]
    monkeypatch.setattr(ct, "replay", lambda recs, cfg: ReplayReport(results, 10.0))
    runner = ct.Runner(ct.CachetestConfig(url="http://x"), ps, tokenizer=None)
    runner.send("cold", ps, 1)
    rep = runner.report(offline_pass([p.tok for p in ps], B))
    assert rep["requests"][1]["miss_tokens"] == {"unknown": 96, "partial_block": 4}  # not `adapter`
