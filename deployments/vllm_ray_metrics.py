"""vLLM's Ray stat logger, made to accept a KV connector's histograms.

In a Ray worker an AsyncLLM engine publishes vLLM's metrics through Ray's metrics port
(`RayPrometheusStatLogger`). That logger also builds the KV connector's own metrics, and LMCache's
connector declares a histogram (its lookup latency) without buckets: Prometheus' client then uses its
defaults, but Ray's `Histogram` refuses to be built without boundaries, so the engine failed to start
(`ValueError: boundaries argument should be provided`) whenever it had an LMCache connector. Here a
histogram given no buckets gets Prometheus' default ones.
"""

from __future__ import annotations

import math
from typing import Any


def default_buckets() -> list[float]:
    """Prometheus' default histogram buckets, without +Inf (Ray adds its own overflow bucket)."""
    from prometheus_client import Histogram

    return [b for b in Histogram.DEFAULT_BUCKETS if math.isfinite(b)]


def ray_stat_logger() -> Any:
    """`RayPrometheusStatLogger` whose KV-connector histograms fall back to Prometheus' default buckets."""
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper, RayKVConnectorProm, RayPrometheusStatLogger

    class HistogramWithDefaultBuckets(RayHistogramWrapper):
        def __init__(
            self,
            name: str,
            documentation: str | None = "",
            labelnames: list[str] | None = None,
            buckets: list[float] | None = None,
        ):
            super().__init__(name, documentation, labelnames, list(buckets) if buckets else default_buckets())

    class KVConnectorProm(RayKVConnectorProm):
        _histogram_cls = HistogramWithDefaultBuckets

    class StatLogger(RayPrometheusStatLogger):
        _kv_connector_cls = KVConnectorProm

    return StatLogger
