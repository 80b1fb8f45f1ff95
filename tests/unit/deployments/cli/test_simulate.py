"""`kvmesh simulate`: the JSON document's shape, the table, the PNG, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import FIXTURES

from kvmesh.deployments.cli import main
from kvmesh.policies.registry import POLICY_NAMES

ENV = dict(os.environ, PYTHONHASHSEED="0")


def _cli(*args):
    """The real console entry (a subprocess), to see exactly what a user sees."""
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.deployments.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )


def test_json_shape_table_and_plot(tmp_path, capsys):
    out, png = tmp_path / "o" / "sim.json", tmp_path / "sim.png"
    rc = main(
        [
            "simulate",
            "--trace",
            "conversation",
            "--replicas",
            "4",
            "--capacity-blocks",
            "500",
            "--limit",
            "600",
            "--policies",
            "all",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {"trace", "replicas", "capacity_blocks", "requests", "bounds", "policies"} <= set(doc)
    assert (doc["trace"], doc["replicas"], doc["capacity_blocks"], doc["requests"]) == ("conversation", 4, 500, 600)
    assert set(doc["bounds"]) == {"global_infinite", "merged_lru"}
    assert list(doc["policies"]) == list(POLICY_NAMES)
    for m in doc["policies"].values():
        for key in (
            "hit_rate_tokens",
            "hit_rate_requests",
            "imbalance",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "throughput_tokens_s",
            "blended_cost",
        ):
            assert isinstance(m[key], float), key
    assert doc["policies"]["kvmesh"]["hit_rate_tokens"] > doc["policies"]["round_robin"]["hit_rate_tokens"]
    table = capsys.readouterr().out
    assert "merged_lru=" in table and all(n in table for n in POLICY_NAMES)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_tiers_load_and_cost_model_options(tmp_path):
    out = tmp_path / "t.json"
    rc = main(
        [
            "simulate",
            "--trace",
            "synthetic",
            "--replicas",
            "2",
            "--capacity-blocks",
            "100",
            "--host-blocks",
            "400",
            "--shared",
            "--tier-store-at",
            "computed",
            "--tier-chunk-blocks",
            "2",
            "--load",
            "0.9",
            "--limit",
            "300",
            "--policies",
            "kvmesh",
            "--cost-model",
            '{"prefill_s_per_token": 0.0002}',
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["load"] == pytest.approx(0.9)
    assert doc["config"]["cost_model"]["prefill_s_per_token"] == 0.0002
    assert doc["config"]["tier_store_at"] == "computed" and doc["config"]["tier_chunk_blocks"] == 2
    assert "merged_lru_with_host" in doc["bounds"]
    tiers = doc["policies"]["kvmesh"]["hit_tokens_by_tier"]
    assert tiers["host"] + tiers["shared"] > 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--trace", "conversation", "--replicas", "0", "--capacity-blocks", "10"], "--replicas: must be >= 1"),
        (["--trace", "conversation", "--replicas", "two", "--capacity-blocks", "10"], "--replicas"),
        (["--trace", "conversation", "--replicas", "2"], "--capacity-blocks"),
        (["--trace", "nope.jsonl", "--replicas", "2", "--capacity-blocks", "10"], "no such file"),
        (
            ["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--policies", "kvmesh,zzz"],
            "unknown policy 'zzz'",
        ),
        (["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--load", "-1"], "--load"),
        (
            ["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--cost-model", '{"bogus": 1}'],
            "unknown keys",
        ),
        (["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--plot", "x.jpg"], ".png"),
        (
            ["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--tier-store-at", "later"],
            "--tier-store-at",
        ),
        (
            ["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--tier-chunk-blocks", "0"],
            "--tier-chunk-blocks",
        ),
        (
            "--trace conversation --replicas 2 --capacity-blocks 10 --shared --tier-store-at computed "
            "--routers 2 --limit 50".split(),
            "one-router simulator only",
        ),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


BASE = ["simulate", "--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--limit", "20"]
# every constant given (no defaults filled in), none pricing prefill: --load squeezed every arrival to t = 0
NO_PREFILL = json.dumps(
    {
        "prefill_s_per_token": 0,
        "prefill_base_s": 0,
        "attention_s_per_token_pair": 0,
        "decode_s_per_token": 0.025,
        "host_load_s_per_token": 0,
        "shared_load_s_per_token": 0,
        "max_batch": 64,
    }
)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--uncached-rate", "nan"], "--uncached-rate: must be a finite number"),
        (["--cached-rate", "inf"], "--cached-rate: must be a finite number"),
        (["--uncached-rate", "-1"], "--uncached-rate: must be >= 0"),
        (["--cost-model", '{"prefill_s_per_token": NaN}'], "prefill_s_per_token must be a finite number >= 0"),
        (["--cost-model", '{"prefill_s_per_token": 1e400}'], "prefill_s_per_token must be a finite number >= 0"),
        (["--cost-model", '{"max_batch": 1.5}'], "max_batch must be a whole number"),
        (["--cost-model", "[" * 100_000], "--cost-model: not valid JSON (nested too deeply)"),
        (["--capacity-blocks", "99999999999999999999999"], "--capacity-blocks: must be <= 9,223,372,036,854,775,807"),
        (["--host-blocks", "99999999999999999999999"], "--host-blocks: must be <="),
        (["--shared", "--shared-blocks", "99999999999999999999999"], "--shared-blocks: must be <="),
        (["--replicas", "100000000"], "--replicas: must be <= 100,000"),
        (["--routers", "100000000"], "--routers: must be <= 1,000"),
        (["--load", "0.5", "--cost-model", NO_PREFILL], "cannot scale the trace to a load: the cost model prices no"),
    ],
)
def test_values_that_crashed_or_hung_are_one_line_exit_2(extra, message, capsys):
    """NaN passed the rate and cost checks (NaN costs, other placements); sizes past int64 overflowed numpy,
    and a huge fleet or router count ran for ever."""
    assert main(BASE + extra + ["--policies", "round_robin", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_a_calibrators_result_file_is_its_cost_model(tmp_path):
    """docs/calibration.md says the calibrators' output is what --cost-model takes; the file they write with
    --json (constants under "cost_model", beside "measured" and "defaults") was refused for its unknown keys."""
    constants = {"prefill_s_per_token": 2.6e-5, "prefill_base_s": 0.0, "decode_s_per_token": 0.01}
    calibrated, out = tmp_path / "accelerator.json", tmp_path / "sim.json"
    calibrated.write_text(json.dumps({"cost_model": constants, "measured": {"device": "H200"}, "defaults": {}}))
    argv = BASE + ["--cost-model", str(calibrated), "--policies", "round_robin", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["config"]["cost_model"]["prefill_s_per_token"] == 2.6e-5


TIME_GOES_BACK = (
    '{"timestamp": 100, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}\n'
    '{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]}\n'
)


@pytest.mark.parametrize(
    "text, extra, message",
    [
        (TIME_GOES_BACK, [], "back.jsonl line 2: timestamp 0 goes back in time (previous 100)"),
        (TIME_GOES_BACK, ["--tokens-per-block", "512"], "back.jsonl line 2: timestamp 0 goes back in time"),
        (TIME_GOES_BACK, ["--tokens-per-block", "512", "--load", "0.5"], "line 2: timestamp 0 goes back in time"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2], "user": [1]}\n', [], "'user'"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2], "tenant": {"a": 1}}\n',
            ["--tokens-per-block", "512"],
            "'tenant' must be a string, a finite number or null",
        ),
        ("[" * 100_000 + "\n", [], "back.jsonl line 1: not valid JSON (nested too deeply)"),
        (
            '{"timestamp": %s, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}\n' % ("9" * 400),
            ["--tokens-per-block", "512"],
            "back.jsonl line 1: field 'timestamp' must be a number >= 0",
        ),
    ],
)
def test_trace_lines_that_crashed_or_misled_are_one_line_exit_2(tmp_path, capsys, text, extra, message):
    """Both ways of reading a trace (as it is, or expanded with --tokens-per-block) refuse the same lines: time
    going back was a negative span (`load: null`, or "all timestamps equal" with --load) when expanded."""
    path = tmp_path / "back.jsonl"
    path.write_text(text)
    argv = ["simulate", "--trace", str(path), "--replicas", "2", "--capacity-blocks", "100", *extra]
    assert main(argv + ["--policies", "round_robin", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_malformed_trace_line_is_reported_with_its_number(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]}\n'
        '{"timestamp": 2, "input_length": 600, "output_length": 3, "hash_ids": [0, 2}\n'
    )
    r = _cli("--trace", str(p), "--replicas", "2", "--capacity-blocks", "10")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "bad.jsonl line 3" in r.stderr and "not valid JSON" in r.stderr


def test_single_request_trace_has_no_load_and_strict_json(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                "conversation",
                "--replicas",
                "2",
                "--capacity-blocks",
                "10",
                "--limit",
                "1",
                "--policies",
                "kvmesh",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert doc["config"]["load"] is None and doc["requests"] == 1
    assert "load=n/a" in capsys.readouterr().out


FIXTURE = str(FIXTURES / "pileup-repro.jsonl")


def test_live_block_size_and_closed_loop_sending(tmp_path):
    """A Mooncake file (512 tokens per id) simulated as the live replay runs it: ids expanded to 64
    tokens, engine blocks of 32, six requests in flight with each user's turns in order."""
    out = tmp_path / "sim.json"
    rc = main(
        [
            "simulate",
            "--trace",
            FIXTURE,
            "--tokens-per-block",
            "64",
            "--block-size",
            "32",
            "--replicas",
            "3",
            "--capacity-blocks",
            "100000",
            "--concurrency",
            "6",
            "--policies",
            "kvmesh,round_robin",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["block_size"] == 32 and doc["config"]["closed_loop_concurrency"] == 6
    k, rr = doc["policies"]["kvmesh"], doc["policies"]["round_robin"]
    assert k["hit_rate_tokens"] > rr["hit_rate_tokens"] + 0.1 and k["imbalance"] <= 1.25
    # the same file without expansion is read at 512 tokens per id, as before
    plain = _cli("--trace", FIXTURE, "--replicas", "3", "--capacity-blocks", "1000", "--policies", "kvmesh")
    assert plain.returncode == 0, plain.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens-per-block", "48", "--block-size", "32"], "must be a multiple of --block-size"),
        (["--concurrency", "4", "--load", "0.5"], "not both"),
        (["--concurrency", "4", "--reply-wait", "off"], "drop --reply-wait off"),
        (["--block-size", "64"], "does not fit"),
    ],
)
def test_live_shape_options_reject_bad_combinations(args, message):
    r = _cli("--trace", FIXTURE, "--replicas", "3", "--capacity-blocks", "100", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_users_turns_wait_for_their_replies_unless_told_not_to(tmp_path):
    """A chat trace whose turns are stamped 1 ms apart: by default each turn is sent after the previous
    reply ends, as a chat client can, so none queues behind its own previous turn; `--reply-wait off`
    sends each at its stamp. The multi-router model sends the same way, and takes --concurrency too."""
    trace = tmp_path / "chat.jsonl"
    history: list[int] = []
    lines = []
    for turn in range(4):
        history = history + [10 * turn + k for k in range(4)]
        rec = {"timestamp": turn, "input_length": 512 * len(history), "output_length": 64, "hash_ids": history}
        lines.append(json.dumps(dict(rec, user="u0")))
    trace.write_text("\n".join(lines) + "\n")
    base = ["simulate", "--trace", str(trace), "--replicas", "1", "--capacity-blocks", "1000", "--no-progress"]
    docs = {}
    for extra in ([], ["--reply-wait", "off"], ["--routers", "2"], ["--routers", "2", "--concurrency", "2"]):
        out = tmp_path / f"{len(docs)}.json"
        assert main([*base, "--policies", "kvmesh", *extra, "--json", str(out)]) == 0
        docs[" ".join(extra)] = json.loads(out.read_text())
    waits, stamps = docs[""], docs["--reply-wait off"]
    assert waits["config"]["send"] == "timed, turns after replies" and stamps["config"]["send"] == "timestamps"
    assert waits["policies"]["kvmesh"]["ttft_p90_s"] < 0.5 * stamps["policies"]["kvmesh"]["ttft_p90_s"]
    routed = docs["--routers 2"]["policies"]["kvmesh"]
    assert routed["ttft_p90_s"] == pytest.approx(waits["policies"]["kvmesh"]["ttft_p90_s"])
    assert docs["--routers 2 --concurrency 2"]["config"]["closed_loop_concurrency"] == 2


@pytest.mark.parametrize("every", ["60", "1e-300"])
def test_a_churn_interval_far_below_the_gaps_between_requests_runs(every, tmp_path, capsys):
    """A quiet trace churning every minute is a fleet replaced between requests, not an error; 1e-300 s
    looped span / interval times (for ever): only the last churn of each replica between two requests counts."""
    rows = [{"timestamp": i * 600_000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]} for i in range(4)]
    trace = tmp_path / "quiet.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["simulate", "--trace", str(trace), "--replicas", "2", "--capacity-blocks", "100", "--routers", "2"]
    assert main([*args, "--policies", "kvmesh", "--churn-every-s", every, "--no-progress"]) == 0


def test_a_simulated_replay_decodes_at_most_the_replays_max_tokens(tmp_path):
    """With --tokens-per-block the simulation is of a replay, which asks each request for min(--max-tokens,
    scaled output length) tokens, 16 by default: so does the simulation (it decoded every scaled output token,
    holding sequence slots and each user's next turn longer than the live run it predicts). Without it the
    trace's output lengths are used as recorded unless --max-tokens is given."""
    from kvmesh.cluster.workloads import ChatSpec, synth_chat, write_jsonl

    chat = tmp_path / "chat.jsonl"  # replies of 1-2 trace blocks: 64-128 tokens at 64 tokens per block
    write_jsonl(synth_chat(ChatSpec(tenants=1, groups=2, users=3, turns=3)), chat)
    docs = {}
    for extra in ([], ["--max-tokens", "1000"], ["--max-tokens", "1"]):
        out = tmp_path / f"{len(docs)}.json"
        args = ["simulate", "--trace", str(chat), "--tokens-per-block", "64", "--block-size", "32"]
        args += ["--replicas", "3", "--capacity-blocks", "100000", "--concurrency", "6", "--policies", "round_robin"]
        assert main([*args, *extra, "--json", str(out), "--no-progress"]) == 0
        docs[" ".join(extra)] = json.loads(out.read_text())
    assert [d["config"]["max_tokens"] for d in docs.values()] == [16, 1000, 1]
    spans = {k: d["policies"]["round_robin"]["throughput_tokens_s"] for k, d in docs.items()}
    assert len(set(spans.values())) == 3  # the decode each request asks for sets the pace
    plain = tmp_path / "plain.json"
    base = ["simulate", "--trace", FIXTURE, "--replicas", "3", "--capacity-blocks", "1000", "--policies", "kvmesh"]
    assert main([*base, "--json", str(plain), "--no-progress"]) == 0
    assert json.loads(plain.read_text())["config"]["max_tokens"] is None
    assert main([*base, "--max-tokens", "16", "--json", str(plain), "--no-progress"]) == 0
    assert json.loads(plain.read_text())["config"]["max_tokens"] == 16
