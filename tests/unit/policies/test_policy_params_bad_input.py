"""Every policy refuses parameters that would rank replicas by numbers that mean nothing: NaN (it passed the
`x < 0` checks), infinities, weights so large a score overflows to inf, and strings where a number or a
switch goes. Each refusal is a ValueError naming the policy and the parameter (the config reports it as is)."""

from __future__ import annotations

import math

import pytest

from kvmesh.policies.registry import make_policy

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "policy, params, needle",
    [
        ("kvmesh", {"balance_slack": NAN}, "kvmesh: balance_slack must be a finite number >= 0, got nan"),
        ("kvmesh", {"balance_slack": INF}, "balance_slack must be a finite number"),
        ("kvmesh", {"recompute_weight": INF}, "recompute_weight must be a finite number >= 0 and <= 1e+06"),
        ("kvmesh", {"recompute_weight": 1e308}, "recompute_weight must be a finite number >= 0 and <= 1e+06"),
        ("kvmesh", {"spread_weight": NAN}, "spread_weight"),
        ("kvmesh", {"hot_recompute_weight": NAN}, "hot_recompute_weight"),
        ("kvmesh", {"guard_weight": NAN}, "guard_weight"),
        ("kvmesh", {"overshoot_weight": NAN}, "overshoot_weight"),
        ("kvmesh", {"overshoot_cap": INF}, "overshoot_cap must be a finite number >= 1"),
        ("kvmesh", {"half_life_requests": NAN}, "half_life_requests must be a finite number > 0"),
        ("kvmesh", {"window_tokens_per_replica": NAN}, "window_tokens_per_replica must be a finite number > 0"),
        ("kvmesh", {"mean_output_tokens": NAN}, "mean_output_tokens must be a finite number >= 0"),
        ("kvmesh", {"hot_fanout": NAN}, "hot_fanout must be a whole number >= 2"),
        ("kvmesh", {"balance_slack": "0.1"}, "balance_slack must be a finite number >= 0, got '0.1'"),
        ("kvmesh", {"hold_for_tier": "false"}, "hold_for_tier must be true or false, got str"),
        ("kvmesh", {"cost": 5}, "kvmesh: cost must be a mapping of cost model constants"),
        ("kvmesh", {"cost": 0}, "kvmesh: cost must be a mapping"),  # was taken as "no cost model given"
        ("consistent_hash", {"vnodes": NAN}, "consistent_hash: vnodes must be a whole number >= 1"),
        ("consistent_hash", {"vnodes": 0}, "vnodes must be a whole number >= 1"),  # an empty ring
        ("dynamo_cost", {"overlap_score_weight": NAN}, "dynamo_cost: overlap_score_weight must be a finite number"),
        ("llmd_precise", {"prefix_weight": NAN}, "llmd_precise: prefix_weight must be a finite number"),
        ("llmd_precise", {"queue_weight": INF}, "queue_weight must be a finite number"),
        ("sglang_cache_aware", {"cache_threshold": NAN}, "sglang_cache_aware: cache_threshold must be a finite"),
        ("sglang_cache_aware", {"balance_rel_threshold": NAN}, "balance_rel_threshold must be a finite number"),
        ("sglang_cache_aware", {"balance_abs_threshold": INF}, "balance_abs_threshold must be a finite number"),
        ("sglang_cache_aware", {"max_tree_size": NAN}, "max_tree_size must be a whole number >= 1"),
        ("sglang_cache_aware", {"chars_per_token": 0}, "sglang_cache_aware: chars_per_token must be a whole"),
        ("ray_prefix_affinity", {"imbalanced_threshold": NAN}, "ray_prefix_affinity: imbalanced_threshold must"),
        ("ray_prefix_affinity", {"match_rate_threshold": NAN}, "match_rate_threshold must be a finite number"),
        ("ray_prefix_affinity", {"do_eviction": "no"}, "do_eviction must be true or false"),
        ("ray_prefix_affinity", {"do_eviction": True, "chars_per_token": 0}, "chars_per_token must be a whole"),
    ],
)
def test_parameters_that_mean_nothing_are_refused_by_name(policy, params, needle):
    with pytest.raises(ValueError) as info:
        make_policy(policy, **params)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "policy, params",
    [
        ("kvmesh", {"guard_weight": None}),  # the hard guard
        ("kvmesh", {"balance_slack": 0, "recompute_weight": 0.0, "overshoot_weight": 0, "hold_for_tier": False}),
        ("kvmesh", {"cost": {}}),
        ("kvmesh", {"cost": {"max_batch": 8}}),
        ("ray_prefix_affinity", {"imbalanced_threshold": INF}),  # its default: never fall back
        ("ray_prefix_affinity", {"imbalanced_threshold": 4, "match_rate_threshold": 1}),
        ("consistent_hash", {"vnodes": 1}),
        ("sglang_cache_aware", {"cache_threshold": 0.5, "balance_abs_threshold": 0}),
        ("sglang_cache_aware", {"max_tree_size": None}),  # a tree never trimmed
        ("llmd_precise", {"prefix_weight": 0}),
    ],
)
def test_meaningful_parameters_still_build(policy, params):
    assert make_policy(policy, **params).name == policy
