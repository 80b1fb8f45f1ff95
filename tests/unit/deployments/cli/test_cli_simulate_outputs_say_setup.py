"""`kvmesh simulate`'s and `kvmesh trace bounds`' outputs say what produced them. The table's header and the
plot's titles left out the routers, event delay, churn, tiers and how requests were sent; a closed-loop run
printed the trace's load, which it never offered; the JSON `config` had no tokens per block, limit or router
setup, and lost the trace's `.jsonl` with --tokens-per-block; `trace bounds` with --warmup or --limit said
"N requests" without saying which, and its JSON had no trace, warm-up or limit."""

from __future__ import annotations

import json

import matplotlib.figure

from kvmesh.deployments.cli import main

SIM = ["simulate", "--replicas", "3", "--capacity-blocks", "100", "--policies", "kvmesh,round_robin", "--no-progress"]


def _trace(tmp_path):
    rows = [
        {
            "timestamp": 100 * i,
            "input_length": 1500,
            "output_length": 8,
            "hash_ids": [0, 1, 10 + i],
            "user": f"u{i % 3}",
        }
        for i in range(12)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_header_json_and_plot_say_the_routers_tiers_and_sending(tmp_path, capsys, monkeypatch):
    titles = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        titles.append(
            " | ".join([fig._suptitle.get_text() if fig._suptitle else ""] + [a.get_title() for a in fig.axes])
        )
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    flags = ["--routers", "2", "--event-delay-ms", "100", "--router-sync", "off", "--churn-every-s", "5"]
    flags += ["--host-blocks", "10", "--shared", "--tokens-per-block", "64", "--block-size", "16", "--limit", "10"]
    rc = main([*SIM, "--trace", _trace(tmp_path), *flags, "--json", str(out), "--plot", str(png)])
    table = capsys.readouterr().out
    assert rc == 0
    setup = table.splitlines()[1]
    for word in (
        "block_size=16",
        "tokens_per_block=64",
        "limit=10",
        "host=10/node",
        "shared=unbounded",
        "routers=2",
        "event_delay_ms=100",
        "router_sync=off",
        "churn_every_s=5",
        "send=timed,turns-after-replies",
    ):
        assert word in setup, (word, setup)
        assert word in titles[0], (word, titles)
    doc = json.loads(out.read_text())
    assert doc["trace"] == "chat.jsonl"
    cfg = doc["config"]
    assert (cfg["block_size"], cfg["tokens_per_block"], cfg["limit"]) == (16, 64, 10)
    assert (cfg["routers"], cfg["event_delay_s"], cfg["router_sync"], cfg["churn_every_s"]) == (2, 0.1, False, 5.0)


def test_a_closed_loop_run_says_it_offered_no_load_of_the_trace(tmp_path, capsys):
    rc = main([*SIM, "--trace", _trace(tmp_path), "--concurrency", "4"])
    header = capsys.readouterr().out.splitlines()[0]
    assert rc == 0
    assert header.endswith("load=n/a (closed loop, concurrency 4)"), header


def test_the_one_router_default_says_so_in_the_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main([*SIM, "--trace", _trace(tmp_path), "--json", str(out)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["routers"], cfg["event_delay_s"], cfg["router_sync"], cfg["churn_every_s"]) == (1, 0.0, True, None)
    assert (cfg["tokens_per_block"], cfg["limit"]) == (512, None)  # each trace id as its 512 tokens, all requests


def test_trace_bounds_says_which_requests_it_counted(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["trace", "bounds", "--trace", _trace(tmp_path), "--warmup", "2", "--limit", "8", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert text.startswith("6 requests (the first 8 of the trace less 2 warm-up requests"), text
    doc = json.loads(out.read_text())
    assert (doc["trace"], doc["requests"], doc["warmup"], doc["limit"]) == ("chat.jsonl", 6, 2, 8)
