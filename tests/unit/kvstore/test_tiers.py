"""Unit tests: tier config parsing, LMCache server arguments, vLLM kv_transfer_config, metrics parsing."""

import json

import pytest

from kvmesh.kvstore.lmcache_metrics import parse_prometheus, tier_summary, total
from kvmesh.kvstore.lmcache_server import redis_ping, shared_tier_reachable
from kvmesh.kvstore.tiers import (
    HEARTBEAT_S,
    MQ_TIMEOUT_S,
    TierConfig,
    TierConfigError,
    kv_transfer_config,
    normalise_l2,
    server_args,
)


def test_defaults_have_no_shared_tier():
    cfg = TierConfig.from_dict({})
    assert cfg.l2 is None and cfg.shared_tier is None
    assert cfg.chunk_size == 256


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("redis://10.0.0.5:6380", {"type": "resp", "host": "10.0.0.5", "port": 6380}),
        ("valkey://vk:6379", {"type": "valkey", "startup_nodes": "vk:6379"}),
        ({"type": "mooncake_store", "x": 1}, {"type": "mooncake_store", "x": 1}),
        ("none", None),
    ],
)
def test_l2_spellings(spec, expected):
    assert normalise_l2(spec) == expected


def test_fs_l2_uses_given_path(tmp_path):
    assert normalise_l2("fs", str(tmp_path)) == {"type": "fs", "base_path": str(tmp_path)}


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"l1_size_gb": 0}, "l1_size_gb"),
        ({"l1_sise_gb": 1}, "unknown lmcache key"),
        ({"eviction_policy": "FIFO"}, "eviction_policy"),
        ({"l2": "redis://nohost"}, "host and a port"),
        ({"l2": "ftp://x:1"}, "not understood"),
        ({"l2": {"type": "resp"}}, "needs 'host' and 'port'"),
        ({"l2": {"base_path": "/x"}}, "string 'type'"),
        ({"port": 70000}, "port"),
    ],
)
def test_bad_config_names_the_key(bad, words):
    with pytest.raises(TierConfigError, match=words):
        TierConfig.from_dict(bad)


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"extra_args": "--l1-init-size-gb 2"}, "extra_args"),  # was split into one argument per character
        ({"extra_args": ["--eviction-ratio", 0.2]}, "extra_args"),
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": "4"}, "max_workers"),
        ({"max_workers": True}, "max_workers"),
        ({"l1_size_gb": float("nan")}, "l1_size_gb"),
        ({"l1_size_gb": float("inf")}, "l1_size_gb"),
        ({"l1_size_gb": True}, "l1_size_gb"),
        ({"chunk_size": True}, "chunk_size"),
        ({"start_timeout_s": "600"}, "start_timeout_s"),  # a TypeError at every node's start-up
        ({"start_timeout_s": 0}, "start_timeout_s"),
        ({"start_timeout_s": float("inf")}, "start_timeout_s"),
        ({"watch_interval_s": "2"}, "watch_interval_s"),  # a TypeError in the node actor
        ({"watch_interval_s": -1}, "watch_interval_s"),  # the watchdog silently off
        ({"watch_interval_s": float("nan")}, "watch_interval_s"),
    ],
)
def test_lmcache_values_of_the_wrong_type_or_out_of_range_are_refused_naming_the_key(bad, key):
    """TierConfig checked three of its settings: the others passed the engine config's check (this one) and
    reached LMCache's command line wrongly or failed later, on every node, as a bare TypeError."""
    with pytest.raises(TierConfigError, match=key) as err:
        TierConfig.from_dict(bad)
    assert "\n" not in str(err.value)


def test_lmcache_values_in_range_are_taken():
    cfg = TierConfig.from_dict(
        {"l1_size_gb": 2, "max_workers": 4, "start_timeout_s": 600, "watch_interval_s": 0, "extra_args": ["--x", "1"]}
    )
    assert (cfg.max_workers, cfg.start_timeout_s, cfg.watch_interval_s) == (4, 600, 0)
    assert server_args(cfg, "ipc:///run/s/requests")[-2:] == ["--x", "1"]


def test_chunk_must_be_multiple_of_block():
    cfg = TierConfig.from_dict({"chunk_size": 96})
    cfg.check_block_size(32)
    with pytest.raises(TierConfigError, match="multiple"):
        cfg.check_block_size(64)


def test_server_args_carry_transfer_mode_chunk_and_l2():
    cfg = TierConfig.from_dict({"l1_size_gb": 0.5, "chunk_size": 64, "l2": "redis://127.0.0.1:7000"})
    args = server_args(cfg, "ipc:///run/s/requests", 5599)
    assert args[args.index("--supported-transfer-mode") + 1] == "auto"
    assert args[args.index("--chunk-size") + 1] == "64"
    assert args[args.index("--host") + 1] == "ipc:///run/s/requests"
    assert args[args.index("--port") + 1] == "5599"
    assert "--prometheus-port" not in args  # the metrics go to a unix socket beside the request socket
    assert json.loads(args[args.index("--l2-adapter") + 1]) == {"type": "resp", "host": "127.0.0.1", "port": 7000}
    assert "--no-l1-use-lazy" in args  # L1 allocated up front: its size is a real reservation
    assert "--l2-adapter" not in server_args(TierConfig(), "ipc:///run/s/requests")


def test_kv_transfer_config_shape():
    kv = kv_transfer_config("127.0.0.1", 5599)
    assert kv == {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": 5599,
            "lmcache.mp.heartbeat_interval": HEARTBEAT_S,
            "lmcache.mp.mq_timeout": MQ_TIMEOUT_S,
        },
    }
    with pytest.raises(TierConfigError):
        kv_transfer_config("127.0.0.1", 0)


SAMPLE = """# HELP lmcache_mp_lookup_hit_l1_tokens_total x
# TYPE lmcache_mp_lookup_hit_l1_tokens_total counter
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="/m"} 1152.0
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="s1",model_name="/m"} 48.0
lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="/m"} 576.0
lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="/m"} 1776.0
lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="/m"} 2720.0
lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 49.0
lmcache_mp_l1_read_chunks_total{l1_tag="_default"} 36.0
lmcache_mp_l1_memory_usage_bytes{backend="dram",l1_tag="_default"} 3.211264e+06
lmcache_mp_l1_usage_ratio{backend="dram",l1_tag="_default"} 0.0598
lmcache_mp_l2_store_completed_objects_chunks_total 49.0
lmcache_mp_l2_store_completed_requests_total{l2_name="resp"} 7.0
lmcache_mp_l2_prefetch_load_completed_chunks_total 20.0
lmcache_mp_l2_load_completed_requests_total{l2_name="resp"} 3.0
"""


def test_parse_prometheus_and_sum_by_label():
    s = parse_prometheus(SAMPLE)
    assert total(s, "lmcache_mp_lookup_hit_l1_tokens_total") == 1200.0
    assert total(s, "lmcache_mp_lookup_hit_l1_tokens_total", cache_salt="s1") == 48.0
    assert total(s, "absent_metric") == 0.0
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_prometheus("this is { not prometheus")


def test_tier_summary_bytes_from_a_fixed_bytes_per_chunk():
    t = tier_summary(parse_prometheus(SAMPLE), chunk_bytes=65536)
    assert t["host_hit_tokens"] == 1200.0 and t["shared_hit_tokens"] == 576.0
    assert t["chunk_bytes"] == 65536
    assert t["bytes_from_host"] == 36 * 65536
    assert t["bytes_to_shared"] == 49 * 65536
    assert t["bytes_from_shared"] == 20 * 65536
    assert tier_summary(parse_prometheus(SAMPLE), chunk_bytes=10)["bytes_to_host"] == 490


def _lmcache_exported_text(monkeypatch) -> str:
    """What an LMCache MP server's /metrics prints after a known run of events: LMCache's own metric subscribers
    (the classes its server registers), fed the events its L1 manager and storage controllers publish, exported
    through the reader its `otel_init` sets up (`PrometheusMetricReader`, which appends each counter's unit)."""
    from lmcache.v1.mp_observability.event import Event, EventType
    from lmcache.v1.mp_observability.subscribers.metrics.l1 import L1MetricsSubscriber
    from lmcache.v1.mp_observability.subscribers.metrics.l2 import L2MetricsSubscriber
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    reader = PrometheusMetricReader()
    REGISTRY.unregister(reader._collector)  # a registry of the test's own, not the process-wide one
    registry = CollectorRegistry()
    registry.register(reader._collector)
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)  # its shutdown leaves REGISTRY
    monkeypatch.setattr(metrics, "get_meter", lambda name, *a, **k: provider.get_meter(name, *a, **k))
    subscriptions: dict = {}
    for subscriber in (L1MetricsSubscriber(), L2MetricsSubscriber()):
        for event_type, callback in subscriber.get_subscriptions().items():
            subscriptions.setdefault(event_type, []).append(callback)

    def publish(event_type, **metadata) -> None:
        for callback in subscriptions.get(event_type, ()):
            callback(Event(event_type=event_type, metadata=metadata))

    class Key:
        cache_salt = ""

    def keys(n: int) -> list:
        return [Key() for _ in range(n)]

    publish(EventType.L1_WRITE_FINISHED, keys=keys(49), l1_tag="_default")
    publish(EventType.L1_READ_FINISHED, keys=keys(36), l1_tag="_default")
    for _ in range(7):  # 7 store tasks, 49 chunks stored in the shared tier
        publish(EventType.L2_STORE_SUBMITTED, key_count_per_salt={"": 7})
        publish(EventType.L2_STORE_COMPLETED, key_count_per_salt={"": 7}, l2_name="resp")
    for loaded in (8, 8, 4):  # 3 load tasks bring 20 chunks back from the shared tier
        publish(EventType.L2_PREFETCH_LOAD_SUBMITTED, adapter_count=1, key_count_per_salt={"": loaded})
        publish(EventType.L2_LOAD_TASK_COMPLETED, l2_name="resp")
        publish(EventType.L2_PREFETCH_LOAD_COMPLETED, key_count_per_salt={"": loaded})
    return generate_latest(registry).decode()


def test_tier_summary_reads_the_chunk_counters_lmcache_exports(monkeypatch):
    """The names are the ones LMCache's exporter writes (the unit appended: `..._objects_chunks_total`), not
    `..._objects_total`, which no LMCache server exports: read under those, the shared tier's traffic was 0.
    Chunks loaded from the shared tier are `l2_prefetch_load_completed` (chunks); `l2_load_completed` counts
    load tasks (requests)."""
    from kvmesh.kvstore import lmcache_metrics

    samples = parse_prometheus(_lmcache_exported_text(monkeypatch))
    assert total(samples, "lmcache_mp_l2_load_completed_requests_total") == 3  # tasks, not chunks
    t = tier_summary(samples, chunk_bytes=65536)
    assert (t["l1_write_chunks"], t["l1_read_chunks"]) == (49, 36)
    assert (t["l2_stored_objects"], t["l2_loaded_objects"]) == (49, 20)
    assert (t["bytes_to_shared"], t["bytes_from_shared"]) == (49 * 65536, 20 * 65536)
    for name in ("L1_WRITE_CHUNKS", "L1_READ_CHUNKS", "L2_STORED_CHUNKS", "L2_LOADED_CHUNKS"):
        assert getattr(lmcache_metrics, name) in samples, (name, sorted(samples))


def test_tier_counters_never_step_back_and_bytes_are_never_estimated():
    """`kvmesh_tier_bytes_total` was chunks x a bytes-per-chunk re-estimated at each scrape from what L1 held
    (resident bytes / (writes - evictions)): 0 when L1 was empty, another figure after keys left L1 without an
    eviction, so the counter stepped back, which Prometheus reads as a reset. Chunks are LMCache's counters as
    they are; bytes only from a fixed bytes-per-chunk."""
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    def page(writes: int, reads: int, evicted: int, resident_chunks: int) -> dict:
        return parse_prometheus(
            f'lmcache_mp_l1_write_chunks_total{{l1_tag="_default"}} {writes}\n'
            f'lmcache_mp_l1_read_chunks_total{{l1_tag="_default"}} {reads}\n'
            f'lmcache_mp_l1_evicted_chunks_total{{l1_tag="_default"}} {evicted}\n'
            f'lmcache_mp_l1_memory_usage_bytes{{backend="dram",l1_tag="_default"}} {resident_chunks * 65536}\n'
            f"lmcache_mp_l2_store_completed_objects_chunks_total {writes}\n"
        )

    # all resident; all evicted (L1 empty); one resident; 10 keys deleted without an eviction event
    scrapes = [(49, 36, 0, 49), (60, 40, 60, 0), (61, 41, 60, 1), (80, 50, 60, 10)]
    for chunk_bytes in (None, 65536):
        figures = [tier_summary(page(*scrape), chunk_bytes) for scrape in scrapes]
        texts = [tier_metrics_text({"n1": {"health": {"healthy": True}, "tiers": t}}) for t in figures]
        pages = [parse_prometheus(text) for text in texts]
        last: dict = {}
        for s in pages:  # every exported counter only grows
            for name in ("kvmesh_tier_chunks_total", "kvmesh_tier_bytes_total"):
                for labels, value in s.get(name, ()):
                    series = (name, tuple(sorted(labels.items())))
                    assert value >= last.get(series, 0), (series, value, last.get(series), chunk_bytes)
                    last[series] = value
        for (writes, *_), t, s in zip(scrapes, figures, pages):
            if chunk_bytes is None:  # no size from configuration: no bytes at all, rather than a guess
                assert t["bytes_to_host"] is None and t["chunk_bytes"] is None
                assert "kvmesh_tier_bytes_total" not in s
            else:
                assert total(s, "kvmesh_tier_bytes_total", direction="to_host") == writes * chunk_bytes
            assert total(s, "kvmesh_tier_chunks_total", direction="to_host") == writes
            assert total(s, "kvmesh_tier_chunks_total", direction="to_shared") == writes


def test_a_server_whose_metrics_do_not_answer_gives_no_tier_figures_not_zeros(monkeypatch):
    """Health and the tier figures are two scrapes: one may answer and the next not. Zeros for every counter
    would read as a reset on the next good scrape; no figures leave the node's counters out (`tier_metrics`)."""
    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    srv = LMCacheServer.__new__(LMCacheServer)  # nothing launched: only its scrape is asked for
    monkeypatch.setattr(srv, "_scrape", lambda timeout=5.0: None)
    assert srv.tier_metrics() == {}
    monkeypatch.setattr(srv, "_scrape", lambda timeout=5.0: SAMPLE)
    assert srv.tier_metrics() == tier_summary(parse_prometheus(SAMPLE))
    page = tier_metrics_text({"n1": {"health": {"healthy": True, "metrics_ok": True}, "tiers": {}}})
    assert "kvmesh_tier_lookup_tokens_total{" not in page and 'kvmesh_tier_server_healthy{node="n1"} 1' in page


def test_shared_tier_probe_reports_down_for_closed_port(tmp_path):
    from kvmesh.cluster.ports import free_port

    port = free_port()
    assert redis_ping("127.0.0.1", port) is False
    assert shared_tier_reachable({"type": "resp", "host": "127.0.0.1", "port": port}) is False
    assert shared_tier_reachable({"type": "fs", "base_path": str(tmp_path)}) is True
    assert shared_tier_reachable({"type": "fs", "base_path": str(tmp_path / "missing")}) is False
    assert shared_tier_reachable(None) is None


STATUS = {
    "node-b": {
        "health": {"healthy": True, "shared_tier_up": False},
        "tiers": {
            "host_hit_tokens": 10.0,
            "shared_hit_tokens": 0.0,
            "lookup_requested_tokens": 40.0,
            "bytes_to_host": 100.0,
            "l1_usage_ratio": 0.5,
        },
    },
    "node-a": {
        "health": {"healthy": True, "shared_tier_up": True},
        "tiers": {
            "host_hit_tokens": 576.0,
            "shared_hit_tokens": 64.0,
            "lookup_requested_tokens": 700.0,
            "bytes_from_shared": 8.0,
        },
    },
    "node-c": {"health": {"healthy": False, "error": "ActorDiedError"}, "tiers": {}},
}


def test_tier_report_sums_nodes_and_flags_shared_down():
    from kvmesh.kvstore.tier_metrics import tier_report

    r = tier_report(STATUS)
    assert r["host_hit_tokens"] == 586.0 and r["shared_hit_tokens"] == 64.0
    assert r["nodes"] == 3 and r["healthy_nodes"] == 2
    assert r["shared_tier_up"] is False


def test_tier_report_sums_chunks_and_gives_bytes_only_where_a_node_has_them():
    from kvmesh.kvstore.tier_metrics import tier_report

    status = {
        "a": {"health": {"healthy": True}, "tiers": tier_summary(parse_prometheus(SAMPLE))},
        "b": {"health": {"healthy": True}, "tiers": tier_summary(parse_prometheus(SAMPLE))},
    }
    r = tier_report(status)
    assert (r["chunks_to_host"], r["chunks_from_host"]) == (98.0, 72.0)
    assert (r["chunks_to_shared"], r["chunks_from_shared"]) == (98.0, 40.0)
    assert r["bytes_to_host"] is None and r["bytes_to_shared"] is None  # no bytes-per-chunk: not a guess
    status["b"]["tiers"] = tier_summary(parse_prometheus(SAMPLE), chunk_bytes=10)
    assert tier_report(status)["bytes_to_shared"] == 490.0


def test_tier_metrics_text_is_valid_prometheus():
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    text = tier_metrics_text(STATUS)
    s = parse_prometheus(text)
    assert total(s, "kvmesh_tier_hit_tokens_total", node="node-a", tier="host") == 576.0
    assert total(s, "kvmesh_tier_shared_up", node="node-b") == 0.0
    assert total(s, "kvmesh_tier_server_healthy") == 2.0
    assert total(s, "kvmesh_tier_bytes_total", direction="to_host") == 100.0
    assert "node-c" not in {labels.get("node") for labels, _ in s["kvmesh_tier_shared_up"]}


def _tier_families(status: dict) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    families = list(text_string_to_metric_families(tier_metrics_text(status)))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names  # a family split in two: its samples came apart from its TYPE
    return {f.name: f for f in families}


def test_each_tier_family_is_typed_as_declared():
    """HELP and TYPE right before the family's own samples: written apart, prometheus_client's parser (and
    Prometheus) takes the samples for an untyped family of their own."""
    fams = _tier_families(STATUS)
    assert {name: f.type for name, f in fams.items()} == {
        "kvmesh_tier_hit_tokens": "counter",
        "kvmesh_tier_lookup_tokens": "counter",
        "kvmesh_tier_chunks": "counter",
        "kvmesh_tier_bytes": "counter",
        "kvmesh_tier_server_healthy": "gauge",
        "kvmesh_tier_shared_up": "gauge",
        "kvmesh_tier_host_usage_ratio": "gauge",
    }
    assert len(fams["kvmesh_tier_server_healthy"].samples) == 3


def test_a_node_whose_figures_this_scrape_did_not_read_has_no_counters_rather_than_zeros():
    """A node that did not answer one scrape: its counters at 0 then back read as a reset (increase() of
    the whole count where nothing happened). Left out, they are a gap; its health gauge says 0."""
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    ok = {
        "health": {"healthy": True},
        "tiers": {
            "host_hit_tokens": 50000.0,
            "lookup_requested_tokens": 9.0,
            "l1_write_chunks": 2.0,
            "bytes_to_host": 131072.0,  # a node with a bytes-per-chunk from configuration
        },
    }
    for down in (
        {"health": {"healthy": False, "error": "GetTimeoutError: ..."}, "tiers": {}},  # the actor did not answer
        {"health": {"healthy": False, "metrics_ok": False}, "tiers": tier_summary({})},  # LMCache's /metrics did not
    ):
        fams = _tier_families({"nodeA": down, "nodeB": ok})
        for name in ("kvmesh_tier_hit_tokens", "kvmesh_tier_lookup_tokens", "kvmesh_tier_chunks", "kvmesh_tier_bytes"):
            assert {s.labels["node"] for s in fams[name].samples} == {"nodeB"}, name
        assert {s.labels["node"] for s in fams["kvmesh_tier_host_usage_ratio"].samples} == {"nodeB"}
        healthy = {s.labels["node"]: s.value for s in fams["kvmesh_tier_server_healthy"].samples}
        assert healthy == {"nodeA": 0, "nodeB": 1}
    assert 'kvmesh_tier_hit_tokens_total{node="nodeA",tier="host"} 50000.0' in tier_metrics_text({"nodeA": ok})


def test_tier_routing_info_for_routers():
    from kvmesh.kvstore.tiers import tier_routing_info

    info = tier_routing_info({"l1_size_gb": 1, "chunk_size": 256, "l2": "redis://r:6379"}, 32, bytes_per_block=1 << 20)
    assert info == {"chunk_blocks": 8, "shared": True, "host_capacity_blocks": 1024}
    assert tier_routing_info({}, 32)["host_capacity_blocks"] is None
    assert tier_routing_info({}, 32)["shared"] is False


def test_tier_routing_info_from_a_running_servers_config():
    """An engine describes the node server it connected to, given as that server's TierConfig."""
    from kvmesh.kvstore.tiers import TierConfig, tier_routing_info

    running = TierConfig.from_dict({"l1_size_gb": 2, "chunk_size": 256, "l2": "redis://r:6379"})
    info = tier_routing_info(running, 32, bytes_per_block=1 << 20)
    assert info == {"chunk_blocks": 8, "shared": True, "host_capacity_blocks": 2048}


def test_kv_bytes_per_block_from_model_config(tmp_path):
    from kvmesh.deployments.config import hf_model_config
    from kvmesh.kvstore.tiers import kv_bytes_per_block

    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 2, "hidden_size": 128, "num_hidden_layers": 2, "torch_dtype": "float32"})
    )
    config = hf_model_config(tmp_path)
    # the probe engines' tiny Llama: 32 tokens x 2 (K,V) x 2 layers x 2 heads x 64 dims x 4 bytes = 65536,
    # the LMCache chunk size seen in the server's L1 usage (3,211,264 bytes / 49 chunks)
    assert kv_bytes_per_block(config, 32, dtype="float32") == 65536
    assert kv_bytes_per_block(config, 32, dtype="bfloat16") == 32768
    assert kv_bytes_per_block(config, 32) == 32768  # "auto": vLLM runs fp32 checkpoints in 16 bit
    assert hf_model_config(tmp_path / "missing") is None
    assert kv_bytes_per_block(None, 32) is None
    assert kv_bytes_per_block({"num_attention_heads": 2}, 32) is None


def test_actor_config_round_trip():
    """The node-server actor is created from a plain dict; reading it back must give the same config."""
    from kvmesh.kvstore.node_server import _to_dict

    cfg = TierConfig.from_dict({"l2": "redis://h:1", "chunk_size": 64, "extra_args": ["--max-gpu-workers", "2"]})
    assert TierConfig.from_dict(_to_dict(cfg)) == cfg


def test_redis_credentials_come_from_the_url_and_stay_off_the_servers_command_line():
    from kvmesh.kvstore.tiers import l2_credentials_env, normalise_l2, server_args

    l2 = normalise_l2("redis://:s3cr%40t@10.0.0.5:6379")
    assert l2 == {"type": "resp", "host": "10.0.0.5", "port": 6379, "password": "s3cr@t"}
    assert normalise_l2("redis://kvmesh:pw@h:1")["username"] == "kvmesh"
    cfg = TierConfig.from_dict({"l2": "redis://:s3cr%40t@10.0.0.5:6379"})
    args = server_args(cfg, "ipc:///run/s/requests")
    assert not any("s3cr" in a for a in args)
    assert json.loads(args[args.index("--l2-adapter") + 1]) == {"type": "resp", "host": "10.0.0.5", "port": 6379}
    assert l2_credentials_env(cfg.l2) == {"LMCACHE_RESP_PASSWORD": "s3cr@t"}
    assert l2_credentials_env(normalise_l2("redis://h:1")) == {} and l2_credentials_env(None) == {}


def test_a_shared_tier_probe_that_fails_once_is_asked_again_with_time_to_answer_before_it_counts(monkeypatch, tmp_path):
    """A slow PING on a busy machine is no outage: counted as one, the watchdog restarted the LMCache server
    under engines still starting. A refused connection fails both probes, and counts as before."""
    from kvmesh.kvstore import lmcache_server
    from kvmesh.kvstore.lmcache_server import SLOW_PROBE_S, LMCacheServer
    from kvmesh.kvstore.tiers import TierConfig

    srv = LMCacheServer(TierConfig.from_dict({"l2": "redis://127.0.0.1:6399"}), tmp_path / "log")
    probes: list[float] = []
    answers: list[bool] = []

    def probe(l2, timeout=1.0):
        probes.append(timeout)
        return answers.pop(0)

    monkeypatch.setattr(lmcache_server, "shared_tier_reachable", probe)
    monkeypatch.setattr(lmcache_server, "shared_tier_probe", probe)  # health()'s probe
    answers[:] = [False, True]  # too slow once, then answered
    assert srv.supervise() == "ok" and not srv.shared_seen_down and probes == [1.0, SLOW_PROBE_S]
    answers[:] = [False, False]  # down: both probes fail
    assert srv.supervise() == "shared-down" and srv.shared_seen_down
    probes.clear()
    answers[:] = [True]  # up at the first probe: asked once
    assert srv.health()["shared_tier_up"] is True and probes == [1.0]
    probes.clear()
    answers[:] = [False]  # health() reports one quick probe: the node actor answers its callers one at a time
    assert srv.health()["shared_tier_up"] is False and probes == [1.0]


def test_the_watchdog_keeps_restarting_a_server_whose_relaunch_failed_until_its_owner_stops_it(tmp_path):
    """A relaunch that fails (Popen raising, or a server not serving in time) left no process, and the
    watchdog only restarted a process it had: the server stayed down for good while reporting ok."""
    import subprocess

    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.tiers import TierConfig

    srv = LMCacheServer(TierConfig.from_dict({}), tmp_path / "log")
    launches: list[int] = []

    def launch(stops: int | None = None) -> None:
        launches.append(1)
        srv.wanted = True
        if len(launches) == 2:  # the first relaunch fails
            raise OSError(24, "Too many open files")
        srv.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)

    srv.launch = launch  # type: ignore[method-assign]
    srv.wait_ready = lambda: srv.endpoint  # type: ignore[method-assign]
    srv.start()
    try:
        srv.proc.kill()
        srv.proc.wait()
        with pytest.raises(OSError):
            srv.supervise()
        assert srv.proc is None
        assert srv.supervise() == "restarted-dead" and srv.alive() and len(launches) == 3
        srv.stop()
        assert srv.supervise() == "ok" and not srv.alive() and len(launches) == 3
    finally:
        if srv.proc is not None:
            srv.proc.kill()


def test_a_shared_tier_password_never_reaches_an_error_message():
    """The messages about an l2 setting name it (an engine's start-up error lands in Serve's logs), with its
    credentials masked."""
    from kvmesh.kvstore.tiers import TierConfigError, normalise_l2, redacted

    for bad in ("redis://:s3cret@myredis", "rediss://user:s3cret@myredis:6380"):
        with pytest.raises(TierConfigError) as err:
            normalise_l2(bad)
        assert "s3cret" not in str(err.value) and "myredis" in str(err.value)
    assert "s3cret" not in str(redacted({"type": "resp", "host": "h", "port": 1, "password": "s3cret"}))
    assert redacted("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"


def test_a_shared_tier_that_takes_connections_and_never_answers_is_run_without_until_it_answers(monkeypatch, tmp_path):
    """A stopped Redis (SIGSTOP, a wedged host) accepts connections and never answers: LMCache's client has no
    timeout, so every lookup, and every request whose prompt fills a chunk, waited for good. The watchdog
    restarts the server without its shared tier, and with it again once it answers."""
    import socket
    import subprocess

    from kvmesh.kvstore import lmcache_server
    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.tiers import TierConfig

    monkeypatch.setattr(lmcache_server, "SLOW_PROBE_S", 0.2)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # the kernel takes connections; nothing ever reads or answers them
    port = hung.getsockname()[1]
    srv = LMCacheServer(TierConfig.from_dict({"l2": f"redis://127.0.0.1:{port}"}), tmp_path / "log")
    commands: list[list[str]] = []

    def launch(stops: int | None = None) -> None:
        commands.append(srv.command())
        srv.wanted = True
        srv.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)

    srv.launch = launch  # type: ignore[method-assign]
    srv.wait_ready = lambda: srv.endpoint  # type: ignore[method-assign]
    monkeypatch.setattr(lmcache_server, "RESTART_DARK_S", 0.0)
    try:
        srv.start()
        assert "--l2-adapter" in commands[-1]
        assert srv.supervise() == "restarted-without-shared" and "--l2-adapter" not in commands[-1]
        assert srv.health()["running_without_shared_tier"] is True
        assert srv.supervise() == "shared-down" and len(commands) == 2  # still hung: no more restarts
        monkeypatch.setattr(lmcache_server, "shared_tier_reachable", lambda l2, timeout=1.0: True)
        assert srv.supervise() == "restarted-shared-back" and "--l2-adapter" in commands[-1]
        assert srv.supervise() == "ok" and len(commands) == 3
    finally:
        hung.close()
        srv.stop()


def test_a_refused_shared_tier_is_not_a_hung_one_and_a_server_not_started_is_left_alone(monkeypatch, tmp_path):
    """A Redis that is gone refuses connections: not a hang. A running server is still relaunched without it,
    since LMCache's client restarted against it never completes an operation
    (test_shared_tier_supervision.py); one its owner has not started is not launched by the watchdog."""
    import socket

    from kvmesh.kvstore import lmcache_server
    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.tiers import TierConfig

    monkeypatch.setattr(lmcache_server, "SLOW_PROBE_S", 0.2)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there
    srv = LMCacheServer(TierConfig.from_dict({"l2": f"redis://127.0.0.1:{port}"}), tmp_path / "log")
    assert lmcache_server.shared_tier_probe(srv.config.l2, 0.2) is False  # refused at once: down, not stalled
    assert srv.supervise() == "shared-down" and not srv.without_shared
