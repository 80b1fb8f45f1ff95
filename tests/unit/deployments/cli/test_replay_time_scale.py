"""`kvmesh replay --time-scale`: a scale that would stretch the trace past a day is refused as bad input
before anything is sent; it slept (trace timestamp x scale) before its first request, for ever at 1e300."""

from __future__ import annotations

import math

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.deployments.cli import main
from kvmesh.deployments.replay import ReplayConfig, ReplayError

DAY_S = 86_400

# nothing listens on port 1: a replay that got as far as the network says "cannot reach" instead
UNREACHABLE = "http://127.0.0.1:1"


def _trace(tmp_path, stamps_ms: list[int]) -> str:
    path = tmp_path / "t.jsonl"
    wl.write_jsonl(
        [{"timestamp": t, "input_length": 512, "output_length": 4, "hash_ids": [i]} for i, t in enumerate(stamps_ms)],
        path,
    )
    return str(path)


@pytest.mark.parametrize("scale", ["1e300", str(DAY_S * 1000 / 4000 * 1.001)])
def test_a_scaled_span_beyond_a_day_is_one_line_and_exit_2_before_any_request(tmp_path, capsys, scale):
    out = tmp_path / "o.json"
    trace = _trace(tmp_path, [0, 2000, 4000])  # a 4 s trace
    rc = main(
        ["replay", "--url", UNREACHABLE, "--trace", trace, "--json", str(out), "--no-progress", "--time-scale", scale]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "more than a day" in err and "cannot reach" not in err, err
    assert not out.exists()


def test_a_scaled_span_of_a_day_goes_on_to_the_network(tmp_path, capsys):
    """The limit refuses only what is beyond it: a day exactly gets as far as the (unreachable) server."""
    trace = _trace(tmp_path, [0, 4000])
    scale = str(DAY_S / 4)
    argv = ["replay", "--url", UNREACHABLE, "--trace", trace, "--json", str(tmp_path / "o.json"), "--no-progress"]
    assert main([*argv, "--time-scale", scale]) == 2
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize("scale", [math.inf, math.nan, 1e300])
def test_the_library_refuses_what_the_flag_refuses(scale):
    from kvmesh.deployments.replay import check_schedule

    records = [{"timestamp": 0}, {"timestamp": 1000}]
    cfg = ReplayConfig(url=UNREACHABLE, time_scale=scale)
    with pytest.raises(ReplayError, match="time scale"):
        cfg.check()
        check_schedule(records, cfg)
