"""bench_tenants' verdicts: a run with nothing measured is a miss, not full marks."""

import pytest

from kvmesh.benchmarks import bench_tenants


def test_no_trace_records_is_a_miss_not_isolation_keeping_everything(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("BENCH_JSON_DIR", raising=False)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(bench_tenants, "read_records", lambda name: [])
    with pytest.raises(SystemExit) as exc:
        bench_tenants.main()
    assert exc.value.code not in (0, None)
    assert "MISS: isolation keeps >= 90% of shared-salt hit rate" in capsys.readouterr().out


def test_the_figures_and_a_plot_are_written_under_bench_out(monkeypatch, tmp_path, capsys):
    """Under `make bench` nothing set BENCH_JSON_DIR, so bench_tenants wrote no file at all."""
    import json

    row = {"tenants": 64, "cache": "lru_4M_tokens", "shared_salt": 0.193, "isolated": 0.19, "cost": 0.003}
    rows = [{**row, "kept": 0.985}, {**row, "tenants": 512, "kept": None}]  # None: nothing to keep, not drawn
    saas = {
        "tenants": 16,
        "preamble_blocks": 4,
        "requests": 512,
        "no_common_text": {"shared_salt": 0.67, "isolated": 0.67},
        "public_preamble": {"shared_salt": 0.767, "isolated": 0.759, "groups_of_2": 0.763},
    }
    monkeypatch.delenv("BENCH_JSON_DIR", raising=False)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(bench_tenants, "mooncake_figures", lambda: rows)
    monkeypatch.setattr(bench_tenants, "saas_figures", lambda: saas)
    bench_tenants.main()
    report = json.loads((tmp_path / "tenants" / "bench_tenants.json").read_text())
    assert report == {"mooncake": rows, "saas": saas}
    assert (tmp_path / "tenants" / "bench_tenants.png").is_file()
