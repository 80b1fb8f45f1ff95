"""`kvmesh simulate` and `kvmesh trace` on bad input: one line on stderr and exit status 2, never a lost file,
a traceback, gigabytes of expanded blocks, a silently wrong result or a message that names the wrong thing.
Each case is one a tester hit: an output naming an input, sizes past what numpy or memory holds, trace
records with absurd numbers, write errors that named no file, `--shared-blocks` without `--shared`."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from cli_checks import refused

from kvmesh.cluster import workloads as wl
from kvmesh.deployments.cli import build_parser, main

RECORD = {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 2]}
SIM = ["simulate", "--replicas", "2", "--capacity-blocks", "100", "--policies", "round_robin", "--no-progress"]


def _trace(tmp_path, *records: dict, name: str = "trace.jsonl"):
    path = tmp_path / name
    rows = records or tuple(dict(RECORD, timestamp=i) for i in range(3))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ 1. an output that is an input is refused
@pytest.mark.parametrize(
    "case, message",
    [
        ("json_is_trace", "--json trace.jsonl is the trace being read (--trace)"),
        ("json_is_trace_by_symlink", "--json ./trace.jsonl is the trace being read (--trace)"),
        ("json_is_trace_by_hard_link", "--json hard.jsonl is the trace being read (--trace)"),
        ("json_is_cost_model", "--json cm.json is the cost model being read (--cost-model)"),
        ("json_is_plot", "--json same.png and --plot same.png are the same file"),
    ],
)
def test_simulate_refuses_an_output_that_is_an_input_or_its_other_output(tmp_path, monkeypatch, capsys, case, message):
    """`--json` over the trace or the cost model destroyed the input (exit 0); `--json x.png --plot x.png`
    replaced the JSON by the PNG. Paths are compared by real path and by file identity (a hard link)."""
    monkeypatch.chdir(tmp_path)
    trace = _trace(tmp_path)
    (tmp_path / "cm.json").write_text("{}")
    (tmp_path / "link.jsonl").symlink_to(trace)
    os.link(trace, tmp_path / "hard.jsonl")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    argv = {
        "json_is_trace": ["--trace", "trace.jsonl", "--json", "trace.jsonl"],
        "json_is_trace_by_symlink": ["--trace", "link.jsonl", "--json", "./trace.jsonl"],
        "json_is_trace_by_hard_link": ["--trace", "trace.jsonl", "--json", "hard.jsonl"],
        "json_is_cost_model": ["--trace", "trace.jsonl", "--cost-model", "cm.json", "--json", "cm.json"],
        "json_is_plot": ["--trace", "trace.jsonl", "--json", "same.png", "--plot", "same.png"],
    }[case]
    assert message in refused(capsys, *SIM, *argv)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written, nothing lost
    # distinct files are written as before
    assert main([*SIM, "--trace", "trace.jsonl", "--cost-model", "cm.json", "--json", "out.json"]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == 3


# ---------------------------------------------------------------- 2. sizes past numpy's reach: parser limits
@pytest.mark.parametrize(
    "argv, message",
    [
        ([*SIM, "--trace", "TRACE", "--tokens-per-block", "1" + "0" * 20], "--tokens-per-block: must be <= 8,192"),
        (
            [*SIM, "--trace", "TRACE", "--host-blocks", "10", "--tier-chunk-blocks", str(2**63)],
            "--tier-chunk-blocks: must be <= 10,000,000",
        ),
        ([*SIM, "--trace", "HUGE", "--block-size", "1" + "0" * 20], "--block-size: must be <= 8,192"),
        (["trace", "bounds", "--trace", "TRACE", "--block-size", "1" + "0" * 20], "--block-size: must be <= 8,192"),
        (
            ["trace", "bounds", "--trace", "TRACE", "--tokens-per-block", "1" + "0" * 20],
            "--tokens-per-block: must be <= 8,192",
        ),
    ],
)
def test_sizes_that_overflowed_are_one_line_exit_2(tmp_path, capsys, argv, message):
    """`simulate`'s were OverflowError tracebacks (exit 1) from numpy; `trace bounds` took any size (exit 0), a
    huge --block-size refused only as not dividing --tokens-per-block. Replay's cap (8,192) is theirs now."""
    trace = _trace(tmp_path)
    huge = _trace(tmp_path, dict(RECORD, input_length=10**20, hash_ids=[1]), name="huge.jsonl")
    argv = [{"TRACE": str(trace), "HUGE": str(huge)}.get(a, a) for a in argv]
    assert message in refused(capsys, *argv)


def test_the_size_limits_accept_their_largest_value():
    sim = build_parser("simulate").parse_args(
        ["simulate", "--trace", "t", "--replicas", "1", "--capacity-blocks", "1", "--tokens-per-block", "8192"]
        + ["--block-size", "8192", "--tier-chunk-blocks", "10000000"]
    )
    assert (sim.tokens_per_block, sim.block_size, sim.tier_chunk_blocks) == (8192, 8192, 10_000_000)
    bounds = build_parser("trace").parse_args(
        ["trace", "bounds", "--trace", "t", "--tokens-per-block", "8192", "--block-size", "8192"]
    )
    assert (bounds.tokens_per_block, bounds.block_size) == (8192, 8192)


# ------------------------------------------------- 3. an expansion past the engine-block limit, before it is made
@pytest.mark.parametrize("command", ["simulate", "bounds"])
def test_an_expansion_past_the_engine_block_limit_is_refused_before_it_is_made(tmp_path, monkeypatch, capsys, command):
    """`--tokens-per-block 1000000 --block-size 1` took 4 GB and more than 30 s on a three-line trace (and
    `trace bounds` a MemoryError): the blocks a trace expands to are counted first. The limit is lowered here
    so that the run it refuses would be a short one."""
    monkeypatch.setattr(wl, "MAX_ENGINE_BLOCKS", 400, raising=False)
    trace = _trace(tmp_path)  # per record: 2 full ids x 64 one-token blocks + a 76-token tail scaled to 10
    shape = ["--tokens-per-block", "64", "--block-size", "1"]
    argv = [*SIM, "--trace", str(trace)] if command == "simulate" else ["trace", "bounds", "--trace", str(trace)]
    err = refused(capsys, *argv, *shape)
    assert (
        "3 requests at 64 tokens per trace block and engine blocks of 1 tokens make 414 engine blocks, more than 400"
        in err
    )
    monkeypatch.setattr(wl, "MAX_ENGINE_BLOCKS", 414, raising=False)
    assert main([*argv, *shape]) == 0


@pytest.mark.parametrize("command", ["simulate", "bounds"])
def test_a_trace_as_large_unexpanded_is_not_refused_by_the_expansion_limit(tmp_path, monkeypatch, command):
    """The limit is on what expanding makes: a million-request trace (20M ids) at one engine block per id was
    refused by `trace bounds` though nothing grew. Lowered here: 3 records of 3 ids, limit 5."""
    monkeypatch.setattr(wl, "MAX_ENGINE_BLOCKS", 5, raising=False)
    trace = _trace(tmp_path)
    argv = [*SIM, "--trace", str(trace)] if command == "simulate" else ["trace", "bounds", "--trace", str(trace)]
    assert main([*argv, "--tokens-per-block", "512", "--block-size", "512"]) == 0


def test_the_bundled_trace_at_an_absurd_ratio_is_refused_at_once(capsys):
    """At the real limit: 2.3 billion engine blocks refused in well under a second, not a MemoryError."""
    err = refused(
        capsys, "trace", "bounds", "--trace", "conversation", "--tokens-per-block", "8192", "--block-size", "1"
    )
    assert "make 2,316,701,168 engine blocks, more than 10,000,000" in err


# ------------------------------------------------------------ 4. trace records with absurd numbers are refused
@pytest.mark.parametrize(
    "absurd, message",
    [
        ({"output_length": 10**18}, "line 2: field 'output_length' must be <= 1,000,000,000, got 1000000000000000000"),
        ({"timestamp": 1e300}, "line 2: field 'timestamp' must be <= 1,000,000,000,000,000, got 1e+300"),
        ({"hash_ids": [1, 2, 2**70]}, "line 2: 'hash_ids' must be <= 2^63-1, got 1180591620717411303424"),
    ],
)
@pytest.mark.parametrize("how", ["as recorded", "expanded", "bounds"])
def test_trace_records_past_the_limits_are_refused_naming_line_and_field(tmp_path, capsys, absurd, message, how):
    """An output_length of 1e18 was simulated with exit 0 (a 2.5e16 s decode, where a float steps by seconds:
    0.00 utilisation, a p90 TTFT of 2.5e16 s behind it); a timestamp of 1e300 or an id past int64 were taken
    as they were. Both ways of
    reading a trace for the simulator, and `trace bounds`, refuse the same records."""
    later = dict(RECORD, timestamp=max(2, absurd.get("timestamp", 0)))
    trace = _trace(tmp_path, RECORD, dict(RECORD, **{"timestamp": 1, **absurd}), later, name="absurd.jsonl")
    argv = {
        "as recorded": [*SIM, "--trace", str(trace)],
        "expanded": [*SIM, "--trace", str(trace), "--tokens-per-block", "32"],
        "bounds": ["trace", "bounds", "--trace", str(trace)],
    }[how]
    assert f"absurd.jsonl {message}" in refused(capsys, *argv)


def test_a_prompt_past_the_token_limit_is_refused(tmp_path, capsys):
    """1.5e9 prompt tokens (183,106 ids of 8,192 tokens) were simulated as they were (a 150,000 s p90 TTFT);
    an input_length past 10^9 tokens, a thousand times any context window, is refused by name."""
    one = dict(RECORD, hash_ids=[0])  # 1,100 tokens in one 8,192-token id
    huge = dict(RECORD, timestamp=1, input_length=1_500_000_000, hash_ids=list(range(10, 10 + 183_106)))
    trace = _trace(tmp_path, one, huge, dict(one, timestamp=2), name="long.jsonl")
    err = refused(capsys, *SIM, "--trace", str(trace), "--block-size", "8192")
    assert "long.jsonl line 2: field 'input_length' must be <= 1,000,000,000, got 1500000000" in err


def test_trace_generators_refuse_timestamps_the_simulator_would_refuse(tmp_path, monkeypatch, capsys):
    """`trace flood` and `trace synth` write only traces the simulator reads: their last timestamp is checked
    before anything is made."""
    out = str(tmp_path / "f.jsonl")
    flood = ["trace", "flood", "--out", out, "--requests", "1002", "--interval-ms", "1e12"]
    assert "timestamps up to 1,001,000,000,000,000 ms, more than 1,000,000,000,000,000" in refused(capsys, *flood)
    assert not os.path.exists(out)
    monkeypatch.setattr(wl, "ChatRecords", lambda spec: [])  # the limit is checked before any record is made
    monkeypatch.setattr(wl, "write_jsonl", lambda records, path, progress=False: 0)
    synth = ["trace", "synth", "--out", out, "--tenants", "1", "--groups", "1", "--users", "1", "--turns", "700"]
    assert "more than 1,000,000,000,000,000" in refused(capsys, *synth, "--think-ms", "1000000000000")
    assert main([*synth, "--think-ms", "10000"]) == 0


# ---------------------------------------------------------- 5. messages name the path, and what is wrong with it
def test_a_write_that_fails_names_the_file_not_none():
    """`trace flood --out /dev/stdout | head -1` said `Broken pipe: None`."""
    p = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.deployments.cli", "trace", "flood", "--out", "/dev/stdout", "--requests"]
        + ["20000"],  # megabytes: far more than a pipe holds, so the writer is still writing when the reader goes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONHASHSEED="0"),
    )
    assert p.stdout is not None and p.stdout.readline().startswith("{")
    p.stdout.close()  # as `head -1` exits
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert err == "error: kvmesh trace: /dev/stdout: Broken pipe\n"


def test_a_failed_write_without_a_file_name_names_the_output(tmp_path, monkeypatch, capsys):
    """`--out /proc/version` said `Input/output error: None` (an error at write or close carries no file)."""

    def fail(records, path, progress=False):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(wl, "write_jsonl", fail)
    out = str(tmp_path / "x.jsonl")
    assert refused(capsys, "trace", "flood", "--out", out) == f"error: kvmesh trace: {out}: Input/output error\n"


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_empty_output_path_is_called_empty(tmp_path, capsys, flag):
    """It said `argument --json:  is a directory, not a file` (the empty path read as the current folder)."""
    err = refused(capsys, *SIM, "--trace", str(_trace(tmp_path)), flag, "")
    assert f"argument {flag}: empty path: name a file" in err


@pytest.mark.parametrize("command", [["trace", "synth", "--out"], ["trace", "flood", "--out"], [*SIM, "--json"]])
def test_an_output_below_a_file_says_the_file_is_not_a_folder(tmp_path, monkeypatch, capsys, command):
    """`trace synth --out file.jsonl/x.jsonl` said `File exists: file.jsonl` after generating the whole trace."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.jsonl").write_text("kept")
    argv = [*command, "file.jsonl/x.jsonl"]
    if command[0] == "simulate":
        argv += ["--trace", str(_trace(tmp_path))]
    err = refused(capsys, *argv)
    assert f"file.jsonl/x.jsonl: cannot be written here: {tmp_path / 'file.jsonl'} is a file, not a folder" in err
    assert (tmp_path / "file.jsonl").read_text() == "kept"


# --------------------------------------------------------------------- 6. --shared-blocks needs --shared
def test_shared_blocks_without_a_shared_tier_is_refused(tmp_path, capsys):
    """`--shared-blocks 5` without `--shared` was silently ignored (exit 0, no shared tier)."""
    trace = str(_trace(tmp_path))
    assert "--shared-blocks sizes the shared tier: add --shared" in refused(
        capsys, *SIM, "--trace", trace, "--shared-blocks", "5"
    )
    out = tmp_path / "o.json"
    assert main([*SIM, "--trace", trace, "--shared", "--shared-blocks", "5", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["shared_blocks"] == 5
    with pytest.raises(SystemExit):
        build_parser("simulate").parse_args(["simulate", "--help"])
    assert "refused without --shared" in " ".join(capsys.readouterr().out.split())
