"""The re-implemented peers follow their upstream defaults (each test names the upstream behaviour it pins)."""

from __future__ import annotations

import pytest
from replica_views import views

from kvmesh.policies.approx_tree import ApproxTree
from kvmesh.policies.base import RequestInfo
from kvmesh.policies.registry import make_policy

BS = 512


def req(hashes):
    return RequestInfo(list(hashes), len(hashes) * BS, BS, 100, None, None)


# ------------------------------------------------------------------------------- Ray Serve prefix-aware
def test_ray_prefix_tree_keeps_every_prompt_without_eviction_by_default():
    # ray 2.60 PrefixCacheAffinityRouter: do_eviction=False, so no prompt routed is ever forgotten, however
    # large a replica's tree grows (here 2 x 250 blocks x 512 tokens, past the 400k-character threshold)
    p = make_policy("ray_prefix_affinity")
    first, second = list(range(250)), list(range(1000, 1250))
    p.on_routed(req(first), "r1")
    p.on_routed(req(second), "r1")
    assert p.rank(req(first), views(2))[0] == "r1"  # still matched, not the empty (smallest) r0


def test_ray_prefix_tree_with_eviction_cuts_a_tree_over_the_threshold_to_the_target():
    # with do_eviction a tenant over eviction_threshold_chars is cut to eviction_target_chars (4 chars a token)
    chars = 4 * BS  # one block
    p = make_policy(
        "ray_prefix_affinity", do_eviction=True, eviction_threshold_chars=4 * chars, eviction_target_chars=3 * chars
    )
    p.on_routed(req(range(4)), "r1")
    assert p.tree.size("r1") == 4 * BS  # at the threshold: kept
    p.on_routed(req(range(5)), "r1")
    assert p.tree.size("r1") == 3 * BS  # over it: cut to the target, not to just under the threshold
    assert p.rank(req(range(5)), views(2))[0] == "r1"  # the prompt's first blocks outlive its last ones


def test_approx_tree_trims_from_a_threshold_to_a_target_and_never_without_one():
    tree = ApproxTree(10, 6)
    tree.insert("a", [1, 2, 3, 4, 5], 2)
    assert tree.size("a") == 10  # at the threshold: kept
    tree.insert("a", [1, 2, 3, 4, 5, 6], 2)
    assert tree.size("a") == 6 and tree.match([1, 2, 3, 4], ["a"]) == {"a": 3}
    unbounded = ApproxTree(None)
    unbounded.insert("a", list(range(10_000)), 512)
    assert unbounded.size("a") == 10_000 * 512
    with pytest.raises(ValueError):
        ApproxTree(10, 11)


def test_ray_match_rate_divides_by_the_whole_prompt_partial_last_block_included():
    # ray 2.60 prefix_aware_router.py: match_rate = len(matched_text) / len(input_text). r1 holds block A; the
    # prompt is A + 9 new blocks + a 31-token tail (351 tokens): 32 / 351 = 0.091 < 0.1, so the candidates are
    # the smallest trees (r0, empty), not r1 (1 / 10 full blocks = 0.100 would send it to r1)
    p = make_policy("ray_prefix_affinity")
    p.on_routed(RequestInfo([101], 40, 32, request_id="seed"), "r1")
    prompt = RequestInfo([101, *range(900, 909)], 351, 32, request_id="q")
    assert p.rank(prompt, views(2))[0] == "r0"
    # the same prompt without the tail is 32 / 320 = 0.1 of the prompt: matched, so r1
    assert p.rank(RequestInfo(prompt.block_hashes, 320, 32, request_id="q2"), views(2))[0] == "r1"


# ---------------------------------------------------------------------------------- SGLang cache_aware
def test_sglang_low_match_goes_to_the_least_loaded_worker_not_the_smallest_tree():
    # sglang-router 0.3.2 (min load since 2025-12-08): a request matching <= cache_threshold goes to the worker with the
    # fewest in-flight requests, even when another worker's tree is smaller
    p = make_policy("sglang_cache_aware")
    p.on_routed(req(range(40)), "r0")  # r0: big tree, idle; r1: empty tree, 3 in flight (balanced: 3 <= 64)
    assert p.rank(req(range(100, 110)), views(2, running={1: 3}))[0] == "r0"
    assert p.rank(req(range(100, 110)), views(2, running={0: 3}))[0] == "r1"


def test_sglang_match_rate_divides_by_the_whole_prompt_partial_last_block_included():
    # cache_aware.rs select_worker: match_rate = matched chars / input chars (tree.rs prefix_match_with_counts).
    # r1 (one request in flight) holds block A; the prompt is A + 2 new blocks + a 31-token tail (127 tokens):
    # 32 / 127 = 0.252 <= 0.3, so the least-loaded worker r0, not r1 (1 / 3 full blocks = 0.333 would be)
    p = make_policy("sglang_cache_aware")
    p.on_routed(RequestInfo([101], 40, 32, request_id="seed"), "r1")
    assert p.rank(RequestInfo([101, 202, 303], 127, 32, request_id="q"), views(2, running={1: 1}))[0] == "r0"
    # 32 / 96 = 0.333 > 0.3 without the tail: the match wins over the load
    assert p.rank(RequestInfo([101, 202, 303], 96, 32, request_id="q2"), views(2, running={1: 1}))[0] == "r1"


@pytest.mark.parametrize("name", ["sglang_cache_aware", "ray_prefix_affinity"])
def test_a_prompt_shorter_than_one_block_never_matches(name):
    # a granularity difference (docs/policies.md): upstream's text tree matches a repeated 20-character prompt
    # 20 / 20; a policy sees only full blocks' hashes, so a 20-token prompt has nothing to match and goes where a
    # miss goes (SGLang: least loaded; Ray: smallest tree, then least queued)
    p = make_policy(name)
    p.on_routed(RequestInfo([], 20, 32, request_id="s1"), "r1")
    assert p.rank(RequestInfo([], 20, 32, request_id="s2"), views(2, running={1: 1}))[0] == "r0"


# ------------------------------------------------------------------------------ llm-d precise prefix
def test_llmd_queue_scorer_reads_the_waiting_queue_not_running_requests():
    # queue-scorer: WaitingQueueSize (vllm:num_requests_waiting); r0 decodes 10 requests with none waiting
    p = make_policy("llmd_precise")
    assert p.rank(req(range(4)), views(2, running={0: 10}, queued={1: 1}))[0] == "r0"
    # the engine's own count, where given, over the router's queued (which also counts the one prefilling)
    vs = views(2, queued={0: 3, 1: 1})
    vs[0].extra["waiting"], vs[1].extra["waiting"] = 0, 1
    assert p.rank(req(range(4)), vs)[0] == "r0"


def test_llmd_prefix_score_is_matched_over_total_blocks_not_min_max():
    # llm-d-router e6f6b84: 1 of 20 blocks scores 0.05, not 1 as the best of the fleet; r0 has 2 waiting, r1 none
    p = make_policy("llmd_precise")
    vs = views(2, hbm_blocks={0: 1}, queued={0: 2})
    assert p.rank(req(range(20)), vs)[0] == "r1"  # r0 2 x 0.05 + 1 + 0 < r1 0 + 1 + 1


def test_llmd_weights_are_two_for_the_prefix_one_each_for_kv_and_queue():
    # guides/precise-prefix-cache-aware: 2 / 1 / 1. r0 holds the whole prompt with its KV full and the longest
    # queue: 2 x 1 = 2; r1 holds nothing at KV 0.1 with no queue: 0.9 + 1 = 1.9 (3 / 2 / 2 would pick r1)
    p = make_policy("llmd_precise")
    vs = views(2, hbm_blocks={0: 8}, queued={0: 5}, kv_usage={0: 1.0, 1: 0.1})
    assert p.rank(req(range(8)), vs)[0] == "r0"


def test_llmd_kv_scorer_reads_the_engines_allocated_blocks_where_given():
    # kv-cache-utilization-scorer: 1 - vllm:kv_cache_usage_perc (the engine's allocated blocks)
    p = make_policy("llmd_precise")
    vs = views(2, kv_usage={0: 0.9, 1: 0.0})
    vs[0].extra["kv_cache_usage"], vs[1].extra["kv_cache_usage"] = 0.0, 0.5
    assert p.rank(req(range(4)), vs)[0] == "r0"


# ---------------------------------------------------------------------------------------- Dynamo KV router
def test_dynamo_books_the_blocks_of_requests_in_flight_once_and_charges_only_the_new_ones():
    # potential active blocks = active blocks (a block in-flight requests share counts once) + the request's
    # blocks not already active; a cached prefix no request in flight holds is charged again (r0) while one a
    # request in flight holds is not (r1): with equal prefill work r1 wins
    p = make_policy("dynamo_cost")
    vs = views(2, hbm_blocks={0: 6, 1: 6}, kv_usage={0: 0.002, 1: 0.012})  # the engines count every copy
    vs[0].extra["active_prompt_blocks"] = {100: 1, 101: 1}  # another conversation: 2 + 8 new
    vs[1].extra["active_prompt_blocks"] = {0: 2, 1: 2, 2: 2, 3: 2, 4: 2, 5: 2}  # this prefix, twice: 6 + 2 new
    assert p.rank(req(range(8)), vs)[0] == "r1"  # r0: 2 + 2 + 8 = 12, r1: 2 + 6 + 2 = 10
    # without a booking the cache overlap is not taken off the decode term: 6 cached blocks do not outweigh
    # 10 active ones (r0: 2 + 10 + 8 = 20 against r1: 8 + 0 + 8 = 16)
    vs = views(2, hbm_blocks={0: 6})
    vs[0].extra["active_blocks"], vs[1].extra["active_blocks"] = 10, 0
    assert p.rank(req(range(8)), vs)[0] == "r1"


# ------------------------------------------------------------------ approximate trees: withdrawn commits
@pytest.mark.parametrize("name", ["sglang_cache_aware", "ray_prefix_affinity"])
def test_a_withdrawn_first_choice_does_not_keep_the_prompt_in_the_peer_tree(name):
    # Serve's PrefixCacheAffinityRouter and SGLang's router insert a prompt only for the replica the request
    # was sent to; the live router commits to its first choice at ranking time and withdraws it when Serve
    # places the request elsewhere, so the withdrawn replica must not look like it holds the prompt
    p = make_policy(name)
    for r in ("r0", "r1", "r2"):
        p.on_replica_added(r)
    doc = RequestInfo(list(range(100, 120)), 20 * 16, 16, request_id="req-1")
    p.on_routed(doc, "r0")
    p.on_unrouted(doc, "r0")
    p.on_routed(doc, "r1")
    follow = RequestInfo(list(range(100, 120)) + [999], 21 * 16, 16, request_id="req-2")
    assert p.tree.match(follow.block_hashes, ["r0", "r1", "r2"]) == {"r0": 0, "r1": 20, "r2": 0}
    assert p.tree.size("r0") == 0 and p.tree.size("r1") == 20 * 16
    assert p.rank(follow, views(3, queued={1: 1}))[0] == "r1"  # its holder, not the idle withdrawn one


def test_a_withdrawal_removes_only_blocks_no_other_commit_references():
    p = make_policy("ray_prefix_affinity")
    system = list(range(10))
    a = RequestInfo(system + [50, 51], 12 * 16, 16, request_id="a")
    b = RequestInfo(system + [60], 11 * 16, 16, request_id="b")
    c = RequestInfo(system + [70], 11 * 16, 16, request_id="c")
    p.on_routed(a, "r0")  # inserts the system prompt and its own blocks
    p.on_routed(b, "r0")  # references the system prompt, inserts its own block
    p.on_unrouted(a, "r0")  # b still references the system prompt: only a's own two blocks go
    assert p.tree.match(a.block_hashes, ["r0"]) == {"r0": 10}
    assert p.tree.match(b.block_hashes, ["r0"]) == {"r0": 11}
    assert p.tree.size("r0") == 11 * 16
    p.on_unrouted(a, "r0")  # taken back already: nothing more goes
    p.on_unrouted(c, "r0")  # never committed there: nothing goes
    assert p.tree.size("r0") == 11 * 16
    p.on_unrouted(b, "r0")
    assert p.tree.size("r0") == 0 and p.tree.match(b.block_hashes, ["r0"]) == {"r0": 0}
    assert not p.tree._owners  # no replica left listed as holding a block


def test_a_withdrawal_never_removes_blocks_inserted_again_after_its_commit():
    # eviction on: a tree over 4 blocks is cut to 2 (LRU first)
    chars = 4 * 16
    p = make_policy(
        "ray_prefix_affinity", do_eviction=True, eviction_threshold_chars=4 * chars, eviction_target_chars=2 * chars
    )
    old = RequestInfo([1, 2], 2 * 16, 16, request_id="old")
    p.on_routed(old, "r0")
    p.on_routed(RequestInfo([7, 8, 9], 3 * 16, 16, request_id="push"), "r0")  # 5 blocks: cut to 2, [1, 2] trimmed
    assert p.tree.match(old.block_hashes, ["r0"]) == {"r0": 0}
    again = RequestInfo([1, 2], 2 * 16, 16, request_id="again")
    p.on_routed(again, "r0")  # the same blocks inserted anew, by a commit after old's
    size = p.tree.size("r0")
    p.on_unrouted(old, "r0")  # old's reference went with the trimmed entries
    assert p.tree.match(again.block_hashes, ["r0"]) == {"r0": 2}
    assert p.tree.size("r0") == size


def test_sglang_tree_bound_is_sglangs_max_tree_size_in_characters():
    # sglang-router 0.3.2 max_tree_size=2**26 counts characters (its tree is over text); this tree counts
    # tokens, so the bound is converted at 4 characters a token, as Ray's eviction bounds are
    assert make_policy("sglang_cache_aware").tree.max_tokens == 2**26 // 4
    p = make_policy("sglang_cache_aware", max_tree_size=4 * 4 * BS)  # four blocks' tokens in characters
    p.on_routed(req(range(8)), "r1")
    assert p.tree.size("r1") == 4 * BS  # counted as tokens, the bound would have kept all 8 blocks
