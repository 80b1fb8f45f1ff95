"""The warm-start bench's pure parts on made-up rows: token hit rates over the new replica's first requests
and over the windows around a removal, and the verdicts (tiers against hbm-only, a missing arm misses)."""

from __future__ import annotations

from kvmesh.benchmarks import bench_scale_warm_start as b


def _row(t0, replica, cached, prompt=144, ok=True, prefix=0):
    return {
        "t0": t0,
        "t1": t0 + 0.5,
        "replica": replica,
        "cached": cached,
        "prompt_tokens": prompt,
        "ok": ok,
        "prefix": prefix,
    }


def test_hit_rate_counts_tokens_of_successful_requests_only():
    rows = [_row(0, "a", 128), _row(1, "a", 0), _row(2, "a", 0, ok=False)]
    assert b.hit_rate(rows) == 128 / 288
    assert b.hit_rate([]) is None
    assert b.hit_rate([_row(0, "a", 0, ok=False)]) is None


def test_new_replica_span_takes_its_first_n_and_the_old_ones_in_that_time():
    rows = [_row(0, "old", 128), _row(1, "new", 0), _row(2, "old", 128), _row(3, "new", 128)]
    rows += [_row(4, "new", 128), _row(5, "old", 0)]
    mine, old = b.new_replica_span(rows, "new", 2)
    assert [r["t0"] for r in mine] == [1, 3]
    assert [r["t0"] for r in old] == [2]  # sent between the new replica's 1st and 2nd
    assert b.hit_rate(mine) == 128 / 288
    assert b.new_replica_span(rows, "absent", 2) == ([], [])


def test_dip_windows_split_at_the_removal():
    rows = [_row(t, "a", 128) for t in range(5)] + [_row(t, "a", 0) for t in range(5, 10)]
    before, after = b.dip_windows(rows, before_end=5.2, after_start=5.2, n=3)
    assert [r["t0"] for r in before] == [2, 3, 4]  # finished (t1 = t0 + 0.5) before 5.2
    assert [r["t0"] for r in after] == [6, 7, 8]  # sent after 5.2
    before, after = b.dip_windows(rows, before_end=4.0, after_start=6.5, n=3)
    assert [r["t0"] for r in before] == [1, 2, 3]  # the requests around the removal are in neither
    assert [r["t0"] for r in after] == [7, 8, 9]
    assert b.dip(b.hit_rate(before), b.hit_rate(after)) == 128 / 144
    assert b.dip(None, 0.5) is None


def test_removal_split_is_the_removed_replicas_last_send_or_when_it_was_seen():
    rows = [_row(1, "gone", 128), _row(2, "a", 128), _row(3, "gone", 128), _row(4, "a", 128)]
    assert b.removal_split(rows, ["gone"], seen_at=5.0) == 3
    assert b.removal_split(rows, ["gone"], seen_at=2.5) == 2.5
    assert b.removal_split(rows, [], seen_at=5.0) == 5.0


def _arm(new_hit, dip, first=128, n=100, errors=0, removed=True, new_node=True):
    return {
        "new_hit": new_hit,
        "dip": dip,
        "new_first_cached": first,
        "new_requests": n,
        "errors": errors,
        "removed": removed,
        "new_node_is_new": new_node,
    }


def _first_shared(verdict: dict) -> bool:
    """The verdict on the shared arm's new replica's first request (whatever its label words)."""
    (ok,) = [v for k, v in verdict.items() if k.startswith("warm start: shared new replica") and "first request" in k]
    return ok


def test_shared_must_match_no_shared_warm_start_and_dip():
    ok = dict(b.checks({"shared": _arm(0.88, 0.01), "no_shared": _arm(0.80, 0.0)}))
    assert all(ok.values()), ok
    worse = dict(b.checks({"shared": _arm(0.79, 0.05, first=0), "no_shared": _arm(0.80, 0.0)}))
    assert not worse["warm start: shared new-replica hit >= no_shared's"]
    assert not _first_shared(worse)
    assert "warm start: same_node new replica's first request is a tier hit" not in worse  # arm not run
    assert not worse[f"scale-down: shared dip <= no_shared dip + {b.DIP_SLACK}"]


def test_a_missing_arm_short_run_or_failed_request_misses():
    verdict = dict(b.checks({"shared": _arm(0.9, 0.0, n=60, errors=1, removed=False)}))
    assert not verdict[f"shared: new replica served {b.FIRST_N} requests"]
    assert not verdict["shared: no failed request"]
    assert not verdict["shared: a replica was removed"]
    assert not verdict["no_shared: no failed request"]
    assert not verdict["warm start: shared new-replica hit >= no_shared's"]


def test_arm_figures_from_rows():
    rows = [_row(0, "a", 128), _row(1, "new", 0), _row(2, "new", 128), _row(3, "a", 128)]
    fig = b.arm_figures(rows, "new", removed_at=None, removed=[])
    assert fig["new_requests"] == 2 and fig["new_first_cached"] == 0
    assert fig["new_cumulative_hit"] == [0.0, round(128 / 288, 4)]
    assert not fig["removed"] and fig["dip"] is None


def test_same_node_arm_is_judged_on_its_first_request_when_run():
    arms = {"shared": _arm(0.88, 0.0), "no_shared": _arm(0.80, 0.0), "same_node": _arm(0.88, 0.0, first=0)}
    verdict = dict(b.checks(arms))
    assert not verdict["warm start: same_node new replica's first request is a tier hit"]
    assert verdict["same_node: no failed request"]


def test_arm_figures_split_the_dip_at_the_removed_replicas_last_request():
    rows = [_row(t, "a", 128) for t in range(4)] + [_row(4, "gone", 128)]
    rows += [_row(5, "a", 128), _row(6, "a", 0), _row(7, "a", 0)]  # 5: sent before the shrink was seen
    fig = b.arm_figures(rows, "gone", removed_at=5.6, removed=["gone"])
    assert fig["before_n"] == 4 and fig["after_n"] == 2  # before: finished by t=4; after: sent after 5.6
    assert fig["before_hit"] == 128 / 144 and fig["after_hit"] == 0.0
    assert fig["dip"] == 128 / 144
    assert fig["orphaned_prefixes"] == 0  # "a" served prefix 0 too


def test_orphaned_prefixes_are_those_only_the_removed_replica_served():
    rows = [dict(_row(0, "a", 128), prefix=0), dict(_row(1, "gone", 128), prefix=0)]
    rows += [dict(_row(2, "gone", 0), prefix=1), dict(_row(3, "gone", 128), prefix=1)]
    rows += [dict(_row(9, "gone", 0), prefix=2)]  # after the split: does not count
    rows += [dict(_row(10, "a", 0), prefix=1), dict(_row(11, "a", 128), prefix=1), dict(_row(12, "a", 128), prefix=0)]
    assert b.orphaned_prefixes(rows, ["gone"], before_end=5) == [1]
    nxt = b.first_after(rows, [1], after_start=5)
    assert [r["t0"] for r in nxt] == [10]  # its first request after the removal: a recompute here
    assert b.hit_rate(nxt) == 0.0


def test_the_shared_arms_first_request_on_an_old_node_is_no_shared_tier_hit():
    """Cached tokens > 0 passed as a shared-tier hit although the new replica had landed on an old node,
    whose host tier holds the prefixes (new_node_is_new was only printed)."""
    on_old_node = dict(b.checks({"shared": _arm(0.88, 0.0, new_node=False), "no_shared": _arm(0.80, 0.0)}))
    assert not _first_shared(on_old_node)
    unknown = {**_arm(0.88, 0.0), "new_node_is_new": None}  # the node look-up failed: the premise is unproven
    assert not _first_shared(dict(b.checks({"shared": unknown, "no_shared": _arm(0.80, 0.0)})))
    assert _first_shared(dict(b.checks({"shared": _arm(0.88, 0.0), "no_shared": _arm(0.80, 0.0)})))


def test_the_shared_arms_first_request_needs_shared_tier_hits_on_the_new_node_where_counted():
    """The per-tier hit tokens were only printed: a new node whose LMCache server counted no shared-tier
    hit cannot have loaded the first request's cached tokens from the shared tier."""

    def arm(by_node):
        return {
            **_arm(0.88, 0.0),
            "new_replica": "r3",
            "replica_nodes": {"r1": "head", "r2": "head", "r3": "worker"},
            "tier_hit_tokens_by_node": by_node,
        }

    def verdict(by_node):
        return _first_shared(dict(b.checks({"shared": arm(by_node), "no_shared": _arm(0.80, 0.0)})))

    # shared-tier hits on the head only (its own L1 evictions), none on the new node: a miss
    assert not verdict({"head": {"host": 900.0, "shared": 128.0}, "worker": {"host": 640.0, "shared": 0.0}})
    assert verdict({"head": {"host": 900.0, "shared": 0.0}, "worker": {"host": 512.0, "shared": 128.0}})
    assert verdict({"head": {"host": 900.0, "shared": 0.0}})  # the new node's counters were not read: unjudged
    assert verdict({})


def test_tier_hits_are_read_per_node_and_summed_per_tier():
    text = "\n".join(
        [
            "# HELP kvmesh_tier_hit_tokens_total Prompt tokens LMCache could serve, by tier.",
            "# TYPE kvmesh_tier_hit_tokens_total counter",
            'kvmesh_tier_hit_tokens_total{node="head",tier="host"} 900.0',
            'kvmesh_tier_hit_tokens_total{node="head",tier="shared"} 0.0',
            'kvmesh_tier_hit_tokens_total{node="worker",tier="host"} 512.0',
            'kvmesh_tier_hit_tokens_total{node="worker",tier="shared"} 128.0',
            'kvmesh_tier_lookup_tokens_total{node="head"} 5000.0',
        ]
    )
    by_node = b.tier_hits_by_node(text)
    assert by_node == {"head": {"host": 900.0, "shared": 0.0}, "worker": {"host": 512.0, "shared": 128.0}}
    assert b.by_tier(by_node) == {"host": 1412.0, "shared": 128.0}
    assert (
        b.new_node_shared_hits(
            {"new_replica": "r3", "replica_nodes": {"r3": "worker"}, "tier_hit_tokens_by_node": by_node}
        )
        == 128.0
    )
    assert (
        b.new_node_shared_hits({"new_replica": "r3", "replica_nodes": {}, "tier_hit_tokens_by_node": by_node}) is None
    )


def test_the_arms_measured_before_a_failing_one_are_on_disk(monkeypatch, tmp_path):
    """The JSON was written only after the last arm: an arm that failed lost the earlier ones. Now each arm
    rewrites it, marked incomplete, and the failure still ends the bench with an error."""
    import json

    import pytest

    calls = []

    def run_arm(arm, seed):
        calls.append(arm)
        if len(calls) == 2:
            raise RuntimeError("ray node 1 did not start (fake)")
        return {"arm": arm, "new_hit": 0.889, "new_requests": 100, "dip": 0.0, "errors": 0}

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setenv("BENCH_WARM_START_ARMS", "shared,no_shared")
    monkeypatch.setattr(b, "run_arm", run_arm)
    with pytest.raises(RuntimeError):
        b.main()
    report = json.loads((tmp_path / "warm_start" / "warm_start.json").read_text())
    assert report["complete"] is False
    assert list(report["arms"]) == calls[:1]
    assert not list((tmp_path / "warm_start").glob("*.tmp"))


def test_the_plot_shows_a_missing_hit_rate_as_missing_not_as_zero(monkeypatch):
    """An arm without a figure (e.g. no request after the removal) was drawn as a 0.0 hit-rate bar."""
    figures = []
    monkeypatch.setattr(b, "save_plot", lambda fig, path: figures.append(fig))
    arm = {"new_cumulative_hit": [0.5, 0.8], "new_hit": 0.8, "old_hit_same_span": 0.7, "before_hit": 0.7}
    b.plot({"shared": {**arm, "after_hit": None}, "no_shared": {**arm, "after_hit": 0.6}}, "unused.png")
    down = figures[0].axes[2]
    assert sorted(round(p.get_height(), 3) for p in down.patches if p.get_fill()) == [0.6, 0.7, 0.7]
    assert [t.get_text() for t in down.texts] == ["n/a"]
    import matplotlib.pyplot as plt

    plt.close(figures[0])
