"""vLLM's Ray stat logger must accept a KV connector's histogram that declares no buckets (LMCache's
lookup latency): Ray's Histogram refuses one without boundaries, and the async engine then failed to start."""

from __future__ import annotations

import math

import pytest

from kvmesh.deployments.vllm_ray_metrics import default_buckets, ray_stat_logger


def test_default_buckets_are_prometheus_defaults_without_infinity():
    buckets = default_buckets()
    assert buckets and all(math.isfinite(b) and b > 0 for b in buckets)
    assert buckets == sorted(buckets) and buckets[0] == 0.005 and buckets[-1] == 10.0


def test_a_kv_connector_histogram_without_buckets_is_built_with_the_defaults():
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

    with pytest.raises(ValueError, match="boundaries"):  # what the engine's start-up ran into
        RayHistogramWrapper(name="vllm:lookup_seconds", documentation="d", labelnames=["model_name"])
    histogram_cls = ray_stat_logger()._kv_connector_cls._histogram_cls
    built = histogram_cls(name="vllm:lookup_seconds", documentation="d", labelnames=["model_name"])
    assert built.metric.boundaries == default_buckets()
    given = histogram_cls(name="vllm:other_seconds", documentation="d", labelnames=["model_name"], buckets=[0.1, 1.0])
    assert given.metric.boundaries == [0.1, 1.0]  # buckets a metric declares are kept
