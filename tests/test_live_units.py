"""Fast tests of the live-serving parts without engines: request validation, config, the prediction
ledger, metrics text, the tiny model build, and the router's ranking/bookkeeping with fake replicas."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.deployments import local_state
from kvmesh.deployments import openai_protocol as proto
from kvmesh.deployments.config import ConfigError, app_config, engine_config
from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.serving_metrics import ServingMetrics


# ---------------------------------------------------------------------------- request validation
def err(fn, body) -> proto.OpenAIError:
    with pytest.raises(proto.OpenAIError) as info:
        fn(body)
    return info.value


def test_completion_accepts_text_token_ids_and_single_item_batches():
    r = proto.parse_completion(
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
        }
    )
    assert (r.prompt_text, r.stream, r.include_usage, r.params["max_tokens"]) == ("hi", True, True, 3)
    assert proto.parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt_ids == [1, 2, 3]
    assert proto.parse_completion({"model": "m", "prompt": ["x"]}).prompt_text == "x"
    assert proto.parse_completion({"model": "m", "prompt": [[4, 5]]}).prompt_ids == [4, 5]
    assert proto.parse_completion({"model": "m", "prompt": "x"}).params["max_tokens"] == proto.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"prompt": "x"}, "model", "missing_required_parameter"),
        ({"model": 3, "prompt": "x"}, "model", "invalid_type"),
        ({"model": "m"}, "prompt", "missing_required_parameter"),
        ({"model": "m", "prompt": ""}, "prompt", "empty_prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": [1, True]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": {"a": 1}}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
        ({"model": "m", "prompt": "x", "temperature": -1}, "temperature", "invalid_value"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "prompt": "x", "n": 2}, "n", "invalid_value"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
        ({"model": "m", "prompt": "x", "stop": 5}, "stop", "invalid_type"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
        ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs", "unsupported_parameter"),
    ],
)
def test_completion_rejects_bad_fields_with_param_and_code(body, param, code):
    e = err(proto.parse_completion, body)
    assert (e.status, e.param, e.code) == (400, param, code)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_validation():
    r = proto.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        }
    )
    assert r.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    assert err(proto.parse_chat, {"model": "m"}).code == "missing_required_parameter"
    assert err(proto.parse_chat, {"model": "m", "messages": []}).code == "empty_prompt"
    assert err(proto.parse_chat, {"model": "m", "messages": "hi"}).code == "invalid_type"
    assert (
        err(proto.parse_chat, {"model": "m", "messages": [{"role": "x", "content": "a"}]}).param == "messages[0].role"
    )
    assert err(proto.parse_chat, {"model": "m", "messages": [{"role": "user", "content": 5}]}).code == "invalid_type"
    assert (
        err(
            proto.parse_chat,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        ).code
        == "invalid_type"
    )


def test_parse_json_errors():
    for raw in (b"", b"{x", b"[1]", b"\xff\xfe"):
        assert err(proto.parse_json, raw).code == "invalid_json"
    assert proto.parse_json(b'{"a": 1}') == {"a": 1}


def test_stream_chunks_have_openai_shape():
    req = proto.parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    first = proto.stream_chunk(req, "id", "he", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"} and first["usage"] is None
    last = proto.stream_chunk(req, "id", None, None, u=proto.usage(5, 2, 3))
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert proto.sse("[DONE]") == b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------- config
def test_config_defaults_and_strict_keys():
    cfg = app_config({"replicas": 3, "engine": {"block_size": 64}})
    assert cfg["replicas"] == 3 and cfg["engine"]["block_size"] == 64 and cfg["policy"] == "kvmesh"
    with pytest.raises(ConfigError, match="unknown key"):
        app_config({"replica": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        engine_config({"blocksize": 32})
    with pytest.raises(ConfigError, match="multiple of 32"):
        engine_config({"block_size": 16})
    assert engine_config({"block_size": 16, "num_gpus": 1})["block_size"] == 16  # GPUs take any size
    with pytest.raises(ConfigError, match="whole number"):
        engine_config({"kv_cache_space_gb": 0.5})
    with pytest.raises(ConfigError, match="hash_algo"):
        engine_config({"hash_algo": "md5"})
    with pytest.raises(ConfigError):
        app_config({"api_keys": "k"})
    assert cfg["proxy"] == "haproxy" and app_config({"proxy": "serve"})["proxy"] == "serve"
    with pytest.raises(ConfigError, match="proxy"):
        app_config({"proxy": "nginx"})


def test_each_local_haproxy_run_gets_its_own_files_and_ports():
    """Serve's HAProxy defaults are per machine (/tmp/haproxy-serve, stats 8404, metrics 9101): two
    local clusters (the test app and a `kvmesh serve` subprocess) failed to start side by side."""
    import shutil

    from kvmesh.deployments.app import _proxy_env

    a, b = _proxy_env("haproxy"), _proxy_env("haproxy")
    assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for k in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_STATS_PORT"):
        assert a[k] != b[k]
    assert Path(a["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent.is_dir()
    assert _proxy_env("serve") == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    for env in (a, b):
        shutil.rmtree(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])


def test_serve_config_file_round_trip(tmp_path):
    from kvmesh.deployments.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text("replicas: 4\npolicy: round_robin\nengine: {block_size: 64, max_model_len: 1024}\n")
    cfg = load_config(p)
    assert (cfg["replicas"], cfg["policy"], cfg["engine"]["max_model_len"]) == (4, "round_robin", 1024)
    p.write_text("- 1\n")
    with pytest.raises(ConfigError):
        load_config(p)


def test_serve_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    from kvmesh.deployments.cli import main

    assert main(["serve", "--policy", "nope"]) == 2
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad.yaml").write_text("engine: {block_size: 33}\n")
    assert main(["serve", "--config", str(tmp_path / "bad.yaml")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)


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


# ---------------------------------------------------------------------------- metrics
def test_metrics_text_has_token_and_request_weighted_hit_rates():
    m = ServingMetrics()
    m.record("r1", 100, 64, 4, 0.05)
    m.record("r1", 100, 0, 4, 0.2)
    m.record("r2", 50, 32, 1, None)
    m.record_error(400)
    snap = m.snapshot()
    assert snap["total"]["hit_rate_tokens"] == pytest.approx(96 / 250)
    assert snap["total"]["hit_rate_requests"] == pytest.approx(2 / 3)
    text = m.prometheus_text(PredictionLedger().snapshot(), {"index": {"lookups": 3}, "decisions": 3})
    assert 'kvmesh_hit_rate_tokens{replica="r1"} 0.32' in text
    assert 'kvmesh_ttft_seconds_bucket{replica="r1",le="0.1"} 1' in text
    assert 'kvmesh_http_errors_total{status="400"} 1' in text
    assert "kvmesh_hash_contract_alarm 0" in text and 'kvmesh_router_index_events_total{counter="lookups"} 3' in text


# ---------------------------------------------------------------------------- tiny model
def test_tiny_model_is_deterministic_and_idempotent(tmp_path):
    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import build_tiny_model

    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")

    def digest(d: Path) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digest(a) == digest(b)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a") == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    cfg = json.loads((a / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(a)
    assert cfg["vocab_size"] == len(tok) == 1024 and cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>hi<|end|><|assistant|>"
    ids = tok.encode("The cache remembers", add_special_tokens=False)
    assert tok.decode(ids) == "The cache remembers"
    assert build_tiny_model(tmp_path / "c", seed=1) != a
    assert digest(tmp_path / "c")["model.safetensors"] != digest(a)["model.safetensors"]


# ---------------------------------------------------------------------------- router with fake replicas
def fake_replica(rid: str, **stats):
    return SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats, node_id="n0", max_ongoing_requests=64
    )


def fake_request(ids, request_id, salt=None):
    req = {"request_id": request_id, "prompt_token_ids": ids, "cache_salt": salt, "params": {"max_tokens": 4}}
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id="i-" + request_id))


def make_router(**kw):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from kvmesh.deployments.router import KvmeshRouter

    r = KvmeshRouter(
        deployment_id=DeploymentID(name="EngineReplica", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(subscribe_events=False, **kw)
    return r


def test_router_ranks_the_prefix_holder_first_and_records_its_prediction(monkeypatch):
    from kvmesh.kvstore.hashing import block_hashes

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        ids = list(range(10, 10 + 200))
        pending = fake_request(ids, "q1", salt="s1")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))  # registers both replicas
        router.index.store("B", block_hashes(ids[:160], 32, cache_salt="s1"))
        ranked = await router.choose_replicas([a, b], pending)
        assert [g[0].replica_id.unique_id for g in ranked] == ["B", "A"]
        router._routed(pending, b.replica_id)
        assert local_state.LEDGER.prediction("q1") == 160
        # another tenant's salt shares nothing: no preference from the cache
        other = fake_request(ids, "q2", salt="s2")
        await router.choose_replicas([a, b], other)
        router._routed(other, a.replica_id)
        assert local_state.LEDGER.prediction("q2") == 0
        # a replica that leaves is forgotten by the index
        await router.choose_replicas([a], fake_request(ids, "q3"))
        assert router.index.replicas() == ["A"]
        router.on_request_completed(b.replica_id, "i-q1")
        assert "i-q1" not in router._inflight

    asyncio.run(scenario())


def test_router_commits_to_its_first_choice_before_serve_places_the_request(monkeypatch):
    """Serve may rank a burst of cold requests while it is still probing queue lengths for the first.
    The router credits its first choice when it ranks, so each of four cold requests of different
    groups sees the others' work and they spread; without that, all four go to one replica (the live
    peer benchmark's chat: prefill max/mean 1.45, docs/peers.md)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        reps = [fake_replica(n) for n in "ABCD"]
        burst = [fake_request([1000 * (k + 1) + i for i in range(300)], f"c{k}") for k in range(4)]
        firsts = []
        for p in burst:  # all ranked before any is placed
            firsts.append((await router.choose_replicas(reps, p))[0][0])
        assert len({r.replica_id.unique_id for r in firsts}) == 4
        # a request sharing c0's prompt, ranked before c0 is placed, already sees c0's blocks there
        twin = fake_request([1000 + i for i in range(300)] + [7], "twin")
        assert (await router.choose_replicas(reps, twin))[0][0] is firsts[0]
        for p, r in zip(burst + [twin], firsts + [firsts[0]]):
            router._routed(p, r.replica_id)
        assert router.fallbacks == 0

    asyncio.run(scenario())


def test_router_moves_its_commitment_when_serve_places_elsewhere(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        p = fake_request(list(range(300)), "m1")
        first = (await router.choose_replicas([a, b], p))[0][0]
        other = b if first is a else a
        work = router.policy.recent_work()
        assert work[first.replica_id.unique_id] > work[other.replica_id.unique_id]
        await router.choose_replicas([a, b], p)  # ranked again (no replica free): not counted twice
        assert router.policy.recent_work() == work
        router._routed(p, other.replica_id)  # Serve put it on the other replica
        moved = router.policy.recent_work()
        assert router.fallbacks == 1
        assert moved[other.replica_id.unique_id] == pytest.approx(work[first.replica_id.unique_id])
        assert moved[first.replica_id.unique_id] == pytest.approx(work[other.replica_id.unique_id])

    asyncio.run(scenario())


def test_router_non_engine_requests_go_to_any_replica():
    async def scenario():
        router = make_router(policy="round_robin")
        a, b = fake_replica("A"), fake_replica("B")
        assert await router.choose_replicas([a, b], None) == [[a, b]]
        assert await router.choose_replicas([a, b], SimpleNamespace(args=[], kwargs={})) == [[a, b]]

    asyncio.run(scenario())


def test_broken_hash_contract_raises_the_alarm_within_a_few_requests(monkeypatch):
    """The router hashing with another algorithm than the engines (index fed with sha256 keys, router
    hashing sha256_cbor) predicts 0 while engines deliver hits: the ledger alarms after 3 requests."""
    from kvmesh.kvstore.hashing import block_hashes

    ledger = PredictionLedger(alarm_after=3)
    monkeypatch.setattr(local_state, "LEDGER", ledger)

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, hash_algo="sha256_cbor", mismatch_alarm_after=3)
        a = fake_replica("A")
        for i in range(3):
            ids = [7 + i] * 130
            pending = fake_request(ids, f"r{i}")
            await router.choose_replicas([a], pending)
            router.index.store("A", block_hashes(ids, 32, algo="sha256"))  # what the engine's events say
            await router.choose_replicas([a], pending)
            router._routed(pending, a.replica_id)
            ledger.deliver(f"r{i}", 128)  # what the engine reports
        return ledger.snapshot()

    snap = asyncio.run(scenario())
    assert snap["alarm"] and snap["mismatches"] == 3 and snap["predicted_tokens"] == 0


def test_router_uses_the_tenant_policy_the_ingress_sets(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        firsts = []
        for i in range(4):
            pending = fake_request([5] * 64, f"t{i}")
            pending.args[0]["policy"] = "round_robin"
            ranked = await router.choose_replicas([a, b], pending)
            firsts.append(ranked[0][0].replica_id.unique_id)
            router._routed(pending, ranked[0][0].replica_id)
        assert sorted(firsts) == ["A", "A", "B", "B"]  # round robin ignores the shared prefix
        assert set(router._policies) == {"kvmesh", "round_robin"}
        assert all(st.policy.name == "round_robin" for st in router._inflight.values())

    asyncio.run(scenario())


def test_serve_flags_override_the_config_file(tmp_path):
    import argparse

    from kvmesh.deployments.cli import serve as serve_cmd

    p = tmp_path / "c.yaml"
    p.write_text("replicas: 4\npolicy: round_robin\nport: 9000\nengine: {block_size: 64}\n")
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    cfg = serve_cmd._build_config(
        parser.parse_args(
            ["--config", str(p), "--replicas", "2", "--api-key", "kvm-abcdefgh12345", "--block-size", "32"]
        )
    )
    assert (cfg["replicas"], cfg["policy"], cfg["port"]) == (2, "round_robin", 9000)
    assert cfg["engine"]["block_size"] == 32 and cfg["api_keys"] == ["kvm-abcdefgh12345"]
    assert cfg["proxy"] == "haproxy"
    assert serve_cmd._build_config(parser.parse_args(["--config", str(p), "--proxy", "serve"]))["proxy"] == "serve"
    generated = serve_cmd._build_config(parser.parse_args([]))["api_keys"]
    assert len(generated) == 1 and generated[0].startswith("kvm-") and len(generated[0]) > 20


def test_engine_args_carry_the_config(tiny_model_dir):
    from kvmesh.deployments.engine_driver import build_engine_args

    cfg = engine_config(
        {"block_size": 64, "stream_interval": 4, "hash_algo": "sha256_cbor", "num_gpu_blocks_override": 100}
    )
    args = build_engine_args(
        cfg,
        str(tiny_model_dir),
        {"endpoint": "tcp://*:5999", "topic": "kvmesh"},
        {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"},
    )
    assert (args.block_size, args.stream_interval, args.prefix_caching_hash_algo) == (64, 4, "sha256_cbor")
    assert args.enable_prefix_caching and args.num_gpu_blocks_override == 100
    assert args.kv_events_config.enable_kv_cache_events and args.kv_events_config.endpoint == "tcp://*:5999"
    assert args.kv_transfer_config.kv_connector == "LMCacheMPConnector"
    with pytest.raises(ConfigError):
        engine_config({"stream_interval": 0})


def test_embedded_tiny_model_runs_in_float32_unless_a_dtype_is_given(tiny_model_dir):
    """vLLM's CPU "auto" would cast the float32 tiny model to bfloat16, whose AMX attention kernel dies
    with SIGILL where the process is not granted AMX state; a dtype the operator sets is kept."""
    from kvmesh.deployments.config import engine_dtype
    from kvmesh.deployments.engine_driver import build_engine_args

    args = build_engine_args(engine_config({}), str(tiny_model_dir), None, None)
    assert args.dtype == "float32"
    assert build_engine_args(engine_config({"dtype": "bfloat16"}), str(tiny_model_dir), None, None).dtype == "bfloat16"
    assert engine_dtype("tiny", "auto") == "float32"
    assert engine_dtype("/models/llama-8b", "auto") == "auto"


def test_router_takes_back_a_placement_the_replica_rejected(monkeypatch):
    """Serve retries a request a replica rejected: the first placement's policy credit and its
    speculative blocks must not stay behind (they would count twice once the retry is placed)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))  # registers both replicas
        idle = dict(router.policy.recent_work())
        pending = fake_request(list(range(500, 800)), "q")
        first = (await router.choose_replicas([a, b], pending))[0][0]
        router._routed(pending, first.replica_id)
        rid = first.replica_id.unique_id
        assert router.policy.recent_work()[rid] > idle[rid]
        assert router.index.held_blocks(rid) > 0
        router._retried(pending)
        assert router.policy.recent_work() == pytest.approx(idle)
        assert router.index.held_blocks(rid) == 0 and "i-q" not in router._inflight

    asyncio.run(scenario())
