"""bench_tenants' verdicts: a run with nothing measured is a miss, not full marks."""

import pytest

from kvmesh.benchmarks import bench_tenants


def test_no_trace_records_is_a_miss_not_isolation_keeping_everything(monkeypatch, capsys):
    monkeypatch.delenv("BENCH_JSON_DIR", raising=False)
    monkeypatch.setattr(bench_tenants, "read_records", lambda name: [])
    with pytest.raises(SystemExit) as exc:
        bench_tenants.main()
    assert exc.value.code not in (0, None)
    assert "MISS: isolation keeps >= 90% of shared-salt hit rate" in capsys.readouterr().out
