"""The prediction ledger (deployments/prediction.py): the hash-contract alarm fires only after
consecutive mismatches."""

from __future__ import annotations

from kvmesh.deployments.prediction import PredictionLedger


# ---------------------------------------------------------------------------- prediction ledger
def test_ledger_alarms_after_consecutive_mismatches_only():
    led = PredictionLedger(alarm_after=3)
    for i in range(2):
        led.predict(f"a{i}", "r1", 0, 32)
        assert led.deliver(f"a{i}", 192) == (0, True)
    led.predict("ok", "r1", 64, 32)
    assert led.deliver("ok", 64 + 31) == (64, False)  # within one block: agreement
    assert not led.alarm and led.consecutive == 0
    for i in range(3):
        led.predict(f"b{i}", "r2", 0, 32)
        led.deliver(f"b{i}", 96)
    snap = led.snapshot()
    assert snap["alarm"] and snap["alarms"] == 1 and snap["mismatches"] == 5 and snap["compared"] == 6
    assert snap["per_replica"]["r2"] == [0, 288, 3]
    assert led.deliver("unknown", 5) is None


def test_concurrent_requests_served_in_the_other_order_raise_no_alarm():
    # two pairs of concurrent requests sharing a new prefix, each pair scheduled by the engine in the order
    # opposite to the router's: one delivers what the other was predicted to, four mismatches in a row
    led = PredictionLedger(alarm_after=3)
    for pair in range(2):
        led.predict(f"p{pair}a", "r1", 256, 32)
        led.predict(f"p{pair}b", "r1", 0, 32)
        assert led.deliver(f"p{pair}a", 0) == (256, True)
        assert led.deliver(f"p{pair}b", 256) == (0, True)
    snap = led.snapshot()
    assert snap["mismatches"] == 4 and not snap["alarm"] and snap["alarms"] == 0
    assert snap["predicted_tokens"] == snap["delivered_tokens"] == 512
    # a broken contract errs one way every time, interleaved or not: the alarm fires at the third
    for i in range(3):
        led.predict(f"x{i}", "r1", 128, 32)
        led.deliver(f"x{i}", 0)
    assert led.snapshot()["alarms"] == 1


def test_a_forgotten_replica_leaves_the_per_replica_counts_and_the_totals_keep_it():
    """Autoscaling creates a new replica id for every replica it adds: a forgotten one must not stay."""
    led = PredictionLedger()
    for rid in ("r1", "r2"):
        led.predict(f"{rid}-done", rid, 64, 32)
        led.deliver(f"{rid}-done", 64)
    led.predict("r1-in-flight", "r1", 32, 32)  # still streaming while Serve stops its replica
    led.forget_replica("r1")
    led.forget_replica("never-seen")  # nothing to drop: no error
    assert set(led.snapshot()["per_replica"]) == {"r2"}
    assert led.deliver("r1-in-flight", 96) == (32, True)  # still compared when it finishes ...
    snap = led.snapshot()
    assert set(snap["per_replica"]) == {"r2"}  # ... without making the replica an entry again
    assert (snap["compared"], snap["mismatches"]) == (3, 1)
    assert (snap["predicted_tokens"], snap["delivered_tokens"]) == (160, 224)
    led.predict("r1-back", "r1", 64, 32)  # an id routed to again after it was forgotten counts afresh
    led.deliver("r1-back", 64)
    assert led.snapshot()["per_replica"]["r1"] == [64, 64, 0]


def test_a_prompts_samples_are_compared_as_a_whole_whichever_of_them_computed_the_prompt():
    """Three prompts' samples (`n` 2), each prompt computed by the sample the router predicted to find it
    cached: compared one by one, six mismatches and (delivered three of one direction in a row) an alarm;
    compared per prompt, none. Samples on different replicas are paired on their own replica only, and a
    sample not compared (None: it moved off a failed replica) leaves the others compared."""
    one_by_one, whole = PredictionLedger(alarm_after=3), PredictionLedger(alarm_after=3)
    for led in (one_by_one, whole):
        for k in range(3):
            led.predict(f"p{k}-first", "r1", 0, 32)
            led.predict(f"p{k}-second", "r1", 608, 32)
    for k in range(3):  # the engine ran each prompt's second sample first: it computed the prompt
        one_by_one.deliver(f"p{k}-first", 608)
    for k in range(3):
        one_by_one.deliver(f"p{k}-second", 0)
    assert one_by_one.snapshot()["mismatches"] == 6 and one_by_one.snapshot()["alarms"] == 1
    for k in range(3):
        whole.deliver_samples({f"p{k}-first": 608, f"p{k}-second": 0})
    snap = whole.snapshot()
    assert (snap["compared"], snap["mismatches"], snap["alarms"]) == (6, 0, 0)
    assert snap["predicted_tokens"] == snap["delivered_tokens"] == 3 * 608
    led = PredictionLedger(alarm_after=3)
    led.predict("a", "r1", 0, 32)
    led.predict("b", "r2", 608, 32)  # placed elsewhere: its own replica's pair
    led.predict("c", "r1", 608, 32)
    led.deliver_samples({"a": 608, "b": 608, "c": 0, "moved": None})
    snap = led.snapshot()
    assert (snap["compared"], snap["mismatches"]) == (3, 0) and snap["per_replica"]["r2"] == [608, 608, 0]
