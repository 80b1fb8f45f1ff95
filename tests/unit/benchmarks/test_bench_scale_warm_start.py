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


def _arm(new_hit, dip, first=128, n=100, errors=0, removed=True):
    return {
        "new_hit": new_hit,
        "dip": dip,
        "new_first_cached": first,
        "new_requests": n,
        "errors": errors,
        "removed": removed,
    }


def test_shared_must_match_no_shared_warm_start_and_dip():
    ok = dict(b.checks({"shared": _arm(0.88, 0.01), "no_shared": _arm(0.80, 0.0)}))
    assert all(ok.values()), ok
    worse = dict(b.checks({"shared": _arm(0.79, 0.05, first=0), "no_shared": _arm(0.80, 0.0)}))
    assert not worse["warm start: shared new-replica hit >= no_shared's"]
    assert not worse["warm start: shared new replica's first request is a tier hit"]
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
