"""EngineReplica's own bookkeeping around the engine, with kvmesh's driver interface faked (no vLLM)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV, ChannelError, write_channel_secret
from kvmesh.deployments import engine_driver
from kvmesh.deployments.engine import EngineReplica
from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text


class _FakeDriver:
    def __init__(self):
        self.load = engine_driver._LoadCounter()
        self.broken_internals = False
        self.steps = 12
        self.external_hit_tokens = 96

    def num_blocks(self) -> int:
        return 64

    def kv_usage(self) -> float:
        if self.broken_internals:
            raise AttributeError("'InprocClient' object has no attribute 'engine_core'")
        return 0.25

    def healthy(self) -> bool:
        return True


def _replica(monkeypatch, tmp_path, on_build=None, **engine) -> EngineReplica:
    """A replica whose driver is fake; `on_build(kv_events)` runs where vLLM would bind its publisher."""
    if not os.environ.get(CHANNEL_SECRET_FILE_ENV):
        monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(write_channel_secret(tmp_path / "run")))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)  # the replica sets it: unset again after the test

    def build_engine_args(cfg, model_path, kv_events, kv_transfer):
        return kv_events

    def make_driver(mode, kv_events, **_):
        if on_build is not None:
            on_build(kv_events)
        return _FakeDriver()

    monkeypatch.setattr(engine_driver, "build_engine_args", build_engine_args)
    monkeypatch.setattr(engine_driver, "make_driver", make_driver)
    return EngineReplica({"model": str(tmp_path), **engine})


def test_vllm_publishes_privately_and_routers_are_told_the_relay(monkeypatch, tmp_path):
    """vLLM's own publisher (its BlockStored events carry prompt token ids) binds ipc sockets in a folder
    only this user can open; routing stats advertise the relay's CURVE endpoints on the node address."""
    seen = {}
    r = _replica(monkeypatch, tmp_path, seen.update)
    folder = os.path.dirname(seen["endpoint"].removeprefix("ipc://"))
    try:
        assert seen["endpoint"].startswith("ipc://") and seen["replay_endpoint"].startswith(f"ipc://{folder}/")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        stats = r.record_routing_stats()
        assert stats["events_auth"] == "curve"
        assert stats["steps"] == 12  # the driver's step count, for requests per step
        assert stats["external_hit_tokens"] == 96  # what it loaded through LMCache
        assert stats["kv_events_endpoint"] == r.events_relay.endpoint
        assert stats["replay_endpoint"] == r.events_relay.replay_endpoint
        assert stats["kv_events_endpoint"].startswith("tcp://127.0.0.1:")  # outside Ray: the loopback node
    finally:
        r._release()
    assert not os.path.exists(folder)


def test_an_engine_without_a_channel_secret_refuses_to_start(monkeypatch, tmp_path):
    monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(tmp_path / "no-such-secret"))
    with pytest.raises(ChannelError, match="no-such-secret"):
        _replica(monkeypatch, tmp_path)


def test_routing_stats_survive_a_failing_read_of_engine_internals(monkeypatch, tmp_path, caplog):
    """If vLLM's internals change shape, the replica still publishes its KV-event endpoint and load
    (routing keeps its prefix view), counts the failure for /metrics, logs it, and tries again."""
    r = _replica(monkeypatch, tmp_path)
    assert r.record_routing_stats()["kv_usage"] == 0.25
    r.driver.broken_internals = True
    with caplog.at_level(logging.ERROR, logger="ray.serve.kvmesh"):
        stats = r.record_routing_stats()
    assert "cannot read its KV usage" in caplog.text
    assert stats["kv_events_endpoint"] == r.kv_events_endpoint and stats["replay_endpoint"] == r.replay_endpoint
    assert stats["stats_errors"] == 1 and stats["kv_usage"] == 0.0
    assert r.record_routing_stats()["stats_errors"] == 2  # retried on every report
    text = failure_metrics_text(FailureCounters(), {"routing_stats": {r.replica_id: r.record_routing_stats()}})
    assert f'kvmesh_replica_stats_errors_total{{replica="{r.replica_id}"}} 3' in text
    r.driver.broken_internals = False
    assert r.record_routing_stats()["kv_usage"] == 0.25


def test_event_folders_of_dead_replicas_are_removed(tmp_path):
    import subprocess
    import sys

    from kvmesh.deployments.engine import PRIVATE_DIR_PREFIX, remove_dead_private_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{PRIVATE_DIR_PREFIX}{int(dead.stdout)}-abc"
    alive = tmp_path / f"{PRIVATE_DIR_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "kvmesh-events-notapid"
    for d in (gone, alive, other):
        d.mkdir()
    (gone / "pub").write_text("")
    assert remove_dead_private_dirs(str(tmp_path)) == 1
    assert not gone.exists() and alive.exists() and other.exists()


def test_what_vllm_leaves_in_the_temp_folder_goes_to_the_replica_folder_and_with_it(monkeypatch, tmp_path):
    """vLLM's engine start creates a torch.distributed file store (`vllm_dist_<hex>`) in the temp folder,
    and a separate engine-core process binds its IPC sockets under VLLM_RPC_BASE_PATH; neither is
    removed by vLLM. Both land in the replica's private folder, which goes when the replica does, and
    the process's temp folder is /tmp's again once the engine has started."""
    import tempfile

    before = tempfile.gettempdir()
    seen = {}

    def build(kv_events):
        store = os.path.join(tempfile.gettempdir(), "vllm_dist_0123")
        open(store, "w").close()
        # an engine-core child process (AsyncLLM) finds its temp folder through TMPDIR
        child = subprocess.run(
            [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], capture_output=True, text=True
        )
        seen.update(
            store=store, rpc=os.environ.get("VLLM_RPC_BASE_PATH"), events=kv_events["endpoint"], child=child.stdout
        )

    monkeypatch.delenv("TMPDIR", raising=False)
    r = _replica(monkeypatch, tmp_path, build)
    folder = r._private_dir
    assert folder and os.path.dirname(seen["store"]) == folder == seen["rpc"] == seen["child"].strip()
    assert seen["events"] == f"ipc://{folder}/pub"
    assert tempfile.gettempdir() == before and "TMPDIR" not in os.environ
    r._release()
    assert not os.path.exists(seen["store"]) and not os.path.exists(folder)


def test_a_requests_unset_sampling_settings_are_the_models_own():
    """The model's generation_config fills what the request leaves out, as on vLLM's own server; what the
    request sets wins."""
    from kvmesh.deployments.engine import EngineReplica, model_sampling_defaults

    model_config = SimpleNamespace(get_diff_sampling_param=lambda: {"temperature": 0.6, "top_p": 0.9, "max_tokens": 9})
    driver = SimpleNamespace(engine=SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config)))
    replica = object.__new__(EngineReplica)
    replica.sampling_defaults = model_sampling_defaults(driver)
    unset = replica._sampling_params({"max_tokens": 4})
    assert (unset.temperature, unset.top_p, unset.max_tokens) == (0.6, 0.9, 4)
    assert replica._sampling_params({"max_tokens": 4, "temperature": 0.0}).temperature == 0.0
    assert model_sampling_defaults(SimpleNamespace()) == {}


def test_a_unary_answer_says_how_long_the_engine_worked_after_its_first_output(monkeypatch):
    """What the ingress takes from its own end-to-end time to measure a unary request's time to first token
    as a stream's (a duration: no clock is compared across processes). On a clock the fake engine moves
    itself: the durations are exact, whatever the machine's load."""
    import asyncio

    from kvmesh.deployments import engine as engine_module

    now = [100.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    replica = object.__new__(EngineReplica)

    async def generate(request):
        for delay, finish in ((0.05, None), (0.1, None), (0.1, "length")):
            now[0] += delay  # the engine's work before this output
            yield {"text": "x", "token_ids": [1], "finish_reason": finish, "num_cached_tokens": 0, "replica": "r"}

    replica.generate = generate
    answer = asyncio.run(replica.generate_full({"request_id": "q"}))
    assert answer["text"] == "xxx" and answer["finish_reason"] == "length"
    assert answer["ttft_s"] == pytest.approx(0.05) and answer["after_first_output_s"] == pytest.approx(0.2)


def test_a_finished_chunk_says_what_stopped_it():
    """The ingress leaves the text of the stop token that ended a moved stream out, as vLLM does: it needs
    vLLM's stop_reason (the stop token's id, None for EOS or a length, the string for a stop string)."""
    import asyncio

    replica = object.__new__(EngineReplica)
    replica.replica_id = "r"
    replica._sampling_params = lambda params: None

    def out(ids, finish, stop_reason, finished):
        comp = SimpleNamespace(text="", token_ids=ids, finish_reason=finish, stop_reason=stop_reason, logprobs=None)
        return SimpleNamespace(outputs=[comp], finished=finished, num_cached_tokens=0, prompt_logprobs=None)

    priorities = []

    async def generate(prompt, params, rid, priority=0):
        priorities.append(priority)
        yield out([5], None, None, False)
        yield out([20], "stop", 20, True)

    replica.driver = SimpleNamespace(generate=generate, healthy=lambda: True)

    async def chunks(**extra):
        return [c async for c in replica.generate({"request_id": "q", "prompt_token_ids": [1, 2], **extra})]

    got = asyncio.run(chunks())
    assert [(c["finish_reason"], c["stop_reason"]) for c in got] == [(None, None), ("stop", 20)]
    asyncio.run(chunks(priority=-4))  # a request's priority reaches the engine's driver (0 when it has none)
    assert priorities == [0, -4]


def test_log_probabilities_reach_the_ingress_as_plain_rows_in_vllms_order_whole_or_by_chunk():
    """vLLM's per-token dicts of Logprob (the sampled token first, then the top ones by rank) cross to the
    ingress as (id, logprob, rank, decoded) rows in the same order; a unary answer carries all of them."""
    import asyncio

    from vllm.logprobs import Logprob

    replica = object.__new__(EngineReplica)
    replica.replica_id = "r"
    replica._sampling_params = lambda params: None
    steps = [
        [{7: Logprob(-0.1, 1, "a"), 3: Logprob(-2.5, 2, "b")}],
        [{9: Logprob(-4.0, 3, None), 3: Logprob(-0.2, 1, "c")}],
    ]

    # the prompt's, with the first output only (vLLM's delta outputs): none for its first token
    prompt_steps = [None, {2: Logprob(-3.0, 5, "p"), 8: Logprob(-1.0, 1, "q")}]

    async def generate(prompt, params, rid, priority=0):
        for k, (tid, step) in enumerate(zip((7, 9), steps)):
            comp = SimpleNamespace(text="t", token_ids=[tid], finish_reason="length", stop_reason=None, logprobs=step)
            prompt_logprobs = prompt_steps if k == 0 else None
            yield SimpleNamespace(outputs=[comp], finished=k == 1, num_cached_tokens=0, prompt_logprobs=prompt_logprobs)

    replica.driver = SimpleNamespace(generate=generate, healthy=lambda: True)

    async def chunks():
        return [c async for c in replica.generate({"request_id": "q", "prompt_token_ids": [1, 2]})]

    rows = [[(7, -0.1, 1, "a"), (3, -2.5, 2, "b")], [(9, -4.0, 3, None), (3, -0.2, 1, "c")]]
    prompt_rows = [[], [(2, -3.0, 5, "p"), (8, -1.0, 1, "q")]]
    got = asyncio.run(chunks())
    assert [c["logprobs"] for c in got] == [rows[:1], rows[1:]]
    assert [c["prompt_logprobs"] for c in got] == [prompt_rows, None]
    whole = asyncio.run(replica.generate_full({"request_id": "q", "prompt_token_ids": [1, 2]}))
    assert whole["logprobs"] == rows and whole["prompt_logprobs"] == prompt_rows


class _NodeServerActors:
    """This node's LMCache server actor as Ray's get_if_exists=True hands it out: created once, with the config
    of the engine that came first; later engines get it as it is. Its server is not started."""

    def __init__(self, created_with: dict):
        from kvmesh.kvstore.tiers import TierConfig

        self.running = TierConfig.from_dict(created_with)

    def options(self, **_):
        import dataclasses

        running = self.running
        call = lambda value: SimpleNamespace(remote=lambda: value)  # noqa: E731  the reply is its own ref
        handle = SimpleNamespace(
            settings=call(dataclasses.asdict(running)),
            shape=call({"chunk_size": running.chunk_size, "l2": running.l2}),  # what the previous version asked
            endpoint=call(("ipc:///tmp/kvmesh-test/requests", 1)),
        )
        return SimpleNamespace(remote=lambda config, log_dir: handle)


def test_routers_are_told_the_host_tier_of_the_nodes_server_not_the_one_the_config_asks_for(
    monkeypatch, tmp_path, caplog
):
    """A server started by an earlier config (KubeRay updating Serve in place) keeps its 1 GB host tier; an
    engine whose config asks for 2 GB connects to it, tells routers 1 GB, and says so once in its log."""
    import json

    import ray

    from kvmesh.deployments import engine as engine_module
    from kvmesh.kvstore import node_server

    config = {"num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 2, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(node_server, "_actor_cls", lambda: _NodeServerActors({"l1_size_gb": 1, "chunk_size": 256}))
    monkeypatch.setattr(node_server, "patch_llvmlite_dunder_lookup", lambda: True)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: list(refs))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.setattr(engine_module, "_L1_WARNED", set(), raising=False)  # warned of by no earlier test
    lmcache = {"l1_size_gb": 2, "chunk_size": 256}
    bytes_per_block = 2 * 2 * 4 * 64 * 32 * 2  # K and V, layers, KV heads, head size, block of 32, 16-bit
    with caplog.at_level(logging.WARNING, logger="ray.serve.kvmesh"):
        replicas = [_replica(monkeypatch, tmp_path, block_size=32, lmcache=lmcache) for _ in range(2)]
    try:
        for r in replicas:
            host_blocks = (1 << 30) // bytes_per_block  # the server's 1 GB
            assert r.tier_info == {"chunk_blocks": 8, "shared": False, "host_capacity_blocks": host_blocks}
            assert r.record_routing_stats()["tiers"] == r.tier_info
    finally:
        for r in replicas:
            r._release()
    warnings = [rec.getMessage() for rec in caplog.records if "l1_size_gb" in rec.getMessage()]
    assert len(warnings) == 1, warnings  # once, not per engine
    assert "l1_size_gb=1" in warnings[0] and "l1_size_gb=2" in warnings[0] and "until it is restarted" in warnings[0]


def test_routing_stats_report_the_block_size_vllm_runs_with(monkeypatch, tmp_path):
    """vLLM may run with another block size than configured (hybrid models, some attention backends); its
    events' hashes cover blocks of that size, so that is the size routers are told to hash with."""
    cache_config = SimpleNamespace(block_size=16, num_gpu_blocks=64)
    monkeypatch.setattr(
        _FakeDriver, "engine", SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache_config)), raising=False
    )
    r = _replica(monkeypatch, tmp_path, block_size=32)
    try:
        assert r.record_routing_stats()["block_size"] == 16
    finally:
        r._release()
    monkeypatch.delattr(_FakeDriver, "engine")  # no vLLM config to read: the configured size
    r = _replica(monkeypatch, tmp_path, block_size=32)
    try:
        assert r.record_routing_stats()["block_size"] == 32
    finally:
        r._release()


@pytest.mark.parametrize(
    "model_dtype, cache_dtype, vllm_block, per_elem",
    [("torch.float32", "auto", 32, 4), ("torch.bfloat16", "auto", 16, 2), ("torch.bfloat16", "fp8_e4m3", 32, 1)],
    ids=["float32_model", "vllm_block_size", "fp8_cache"],
)
def test_the_host_tier_is_sized_in_the_blocks_and_dtype_vllm_runs_with(
    monkeypatch, tmp_path, model_dtype, cache_dtype, vllm_block, per_elem
):
    """The configured dtype "auto" says nothing of the KV cache's width (a float32 model, the tiny one, runs in
    float32: 4 bytes an element, not 2), and vLLM may run other blocks than configured: the host tier's
    capacity in blocks, and a chunk in blocks, are those of vLLM's cache as it runs."""
    import json

    import ray

    from kvmesh.deployments import engine as engine_module
    from kvmesh.kvstore import node_server

    config = {"num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 2, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(node_server, "_actor_cls", lambda: _NodeServerActors({"l1_size_gb": 1, "chunk_size": 256}))
    monkeypatch.setattr(node_server, "patch_llvmlite_dunder_lookup", lambda: True)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: list(refs))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.setattr(engine_module, "_L1_WARNED", set(), raising=False)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=vllm_block, cache_dtype=cache_dtype, num_gpu_blocks=64),
        model_config=SimpleNamespace(dtype=model_dtype),
    )
    monkeypatch.setattr(_FakeDriver, "engine", SimpleNamespace(vllm_config=vllm_config), raising=False)
    r = _replica(monkeypatch, tmp_path, block_size=32, dtype="auto", lmcache={"l1_size_gb": 1, "chunk_size": 256})
    try:
        bytes_per_block = 2 * 2 * 4 * 64 * vllm_block * per_elem  # K and V, layers, KV heads, head size, block
        want = {
            "chunk_blocks": 256 // vllm_block,
            "shared": False,
            "host_capacity_blocks": (1 << 30) // bytes_per_block,
        }
        assert r.tier_info == want
    finally:
        r._release()


def test_without_vllms_config_the_kv_dtype_is_the_one_kvmesh_hands_vllm():
    from kvmesh.deployments.engine import kv_cache_dtype

    assert kv_cache_dtype(object(), {"model": "tiny", "dtype": "auto"}) == "float32"  # engine_dtype's choice
    assert kv_cache_dtype(object(), {"model": "/models/llama", "dtype": "bfloat16"}) == "bfloat16"


def test_blocks_vllm_chose_that_do_not_divide_the_lmcache_chunk_leave_the_replica_serving_without_a_tier(
    monkeypatch, tmp_path
):
    """The configured block size was checked against the chunk, but vLLM may run another one (here 24 tokens
    against a 256-token chunk): the check raised in the replica's constructor, once the engine ran, and Serve
    restarted the replica over and over. It serves now, says so once, and routers are told of no tier."""
    import json

    import ray

    from kvmesh.deployments import engine as engine_module
    from kvmesh.kvstore import node_server

    config = {"num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 2, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(node_server, "_actor_cls", lambda: _NodeServerActors({"l1_size_gb": 1, "chunk_size": 256}))
    monkeypatch.setattr(node_server, "patch_llvmlite_dunder_lookup", lambda: True)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: list(refs))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.setattr(engine_module, "_L1_WARNED", set(), raising=False)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=24, cache_dtype="auto", num_gpu_blocks=64),
        model_config=SimpleNamespace(dtype="torch.float32"),
    )
    monkeypatch.setattr(_FakeDriver, "engine", SimpleNamespace(vllm_config=vllm_config), raising=False)
    # heard on the replicas' logger itself: once Ray's logging is set up, "ray" and "ray.serve" pass nothing on
    # to the root logger, where caplog listens
    heard: list[logging.LogRecord] = []

    class Listener(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record)

    listener = Listener(logging.WARNING)
    replica_log = logging.getLogger("ray.serve.kvmesh")
    replica_log.addHandler(listener)
    try:
        r = _replica(monkeypatch, tmp_path, block_size=32, lmcache={"l1_size_gb": 1, "chunk_size": 256})
    finally:
        replica_log.removeHandler(listener)
    try:
        assert r.tier_info is None and r.record_routing_stats()["tiers"] is None
        assert r.record_routing_stats()["block_size"] == 24
        said = [rec.getMessage() for rec in heard if "chunk_size" in rec.getMessage()]
        assert len(said) == 1 and "KV blocks of 24 tokens" in said[0] and "chunk_size 256" in said[0], said
    finally:
        r._release()
