"""The replay client (deployments/replay.py, `kvmesh replay`) on plain data: prompt expansion, result
aggregation, argument and connection errors. Replays against a real vLLM server are in
tests/integration/test_replay_vllm_server.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.cluster.ports import free_port
from kvmesh.deployments.cli import main as cli
from kvmesh.deployments.replay import (
    PromptBuilder,
    ReplayConfig,
    ReplayError,
    ReplayReport,
    RequestResult,
    format_table,
    one_token_words,
)


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


def _fleet(replicas: int, busy: dict[str, tuple[int, int, int]]) -> dict:
    """A summary whose per-replica rows are idle but for `busy` (replica -> requests, prompt, cached)."""
    rows = {}
    for i in range(replicas):
        n, prompt, cached = busy.get(f"r{i}", (0, 0, 0))
        hit = cached / prompt if prompt else 0.0
        rows[f"r{i}"] = {
            "requests": n,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "uncached_prompt_tokens": prompt - cached,
            "hit_rate_tokens": hit,
        }
    return {"requests": 3, "per_replica_known": True, "per_replica": rows}


def test_a_large_fleets_per_replica_figures_are_a_bounded_summary():
    """`kvmesh demo --simulate --replicas 100000` listed every replica on one line (megabytes)."""
    s = _fleet(100_000, {"r7": (2, 1000, 800), "r99999": (1, 500, 0)})
    table = format_table({"kvmesh": s, "round_robin": s})
    assert len(table) < 4000, f"{len(table):,} characters for two runs"
    line = next(x for x in table.splitlines() if x.startswith("  kvmesh per replica"))
    assert "100,000 replicas" in line
    assert "requests 0/0/2" in line and "hit 0%/0%/80%" in line and "uncached 0/0/500" in line  # min/median/max
    assert line.index("r7: 2 req 80% hit 200 uncached") < line.index("r99999: 1 req 0% hit 500 uncached")


def test_a_small_fleets_replicas_are_each_listed():
    table = format_table({"kvmesh": _fleet(16, {"r3": (4, 100, 25)})})
    line = next(x for x in table.splitlines() if "per replica" in x)
    assert line.count(" req ") == 16 and "r3: 4 req 25% hit 75 uncached" in line and "r0: 0 req 0% hit" in line


def test_summary_without_cached_counts_reports_none():
    s = ReplayReport([_res(0, 100, None, 0.1, "unknown")], wall_s=1.0).summary()
    assert s["hit_rate_tokens"] is None and s["uncached_prompt_tokens"] is None
    assert s["per_replica_known"] is False


def test_a_replicas_row_counts_only_requests_whose_cached_tokens_came_back():
    """As the totals do: a request without the count says nothing of its hits; counted as 0 cached, it
    made that replica look colder than it was (a fleet where some servers do not report the field)."""
    s = ReplayReport([_res(0, 100, 80, 0.1, "a"), _res(1, 100, None, 0.1, "a")], wall_s=1.0).summary()
    assert s["hit_rate_tokens"] == pytest.approx(0.8)
    assert s["per_replica"]["a"]["hit_rate_tokens"] == pytest.approx(0.8) and s["per_replica"]["a"]["requests"] == 2


def test_cli_unreachable_url_is_one_line_exit_2(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    wl.write_jsonl([_rec([1, 2])], trace)
    port = free_port()
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
CHAT = wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, system_blocks=6, seed=11)


def _sent_body(rec: dict, **cfg_kw) -> dict:
    """The body `_one_request` sends for `rec` (captured; no server)."""
    import asyncio

    from kvmesh.deployments.replay import _one_request

    captured: dict = {}

    class Captured(Exception):
        pass

    class Client:
        def stream(self, method, url, json=None, headers=None):
            captured.update(json)
            raise Captured

    cfg = ReplayConfig(url="http://x", model="tiny", **cfg_kw)
    result = asyncio.run(_one_request(Client(), cfg, "tiny", rec, 0, PromptBuilder(cfg), 0.0))
    assert result.error is not None and "Captured" in result.error
    return captured


def test_a_logged_body_is_sent_greedy_whatever_sampling_it_logged():
    """cachetest's correctness check compares warm outputs with cold's: a logged temperature 0.7 and top_p
    overrode the client's temperature 0, so both passes sampled and differed by chance."""
    logged = {
        "model": "app-model",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "n": 2,
        "max_tokens": 8,
        "presence_penalty": 0.5,
        "stop": ["\n"],
    }
    body = _sent_body({"body": logged, "tenant": "a", "user": "a/c0"})
    assert body["temperature"] == 0.0 and body["model"] == "app-model"
    assert not {"top_p", "top_k", "seed", "n"} & set(body)
    assert body["max_tokens"] == 8 and body["presence_penalty"] == 0.5 and body["stop"] == ["\n"]
    assert body["stream"] is True
    # a caller that wants the log's sampling says so
    assert _sent_body({"body": logged}, greedy=False)["temperature"] == 0.7
    # a trace record was and is sent at temperature 0
    assert _sent_body(_rec([1, 2]))["temperature"] == 0.0
