"""bench_simulator's tier verdicts: each tier variant is judged against no tiers, the shared one too."""

from kvmesh.benchmarks import bench_simulator
from kvmesh.benchmarks.targets import Targets


def _figures(hit, p90):
    return {
        "hit_rate_tokens": hit,
        "prompt_tokens": 100,
        "hit_tokens_by_tier": {"hbm": 100 * hit, "host": 0, "shared": 0},
        "ttft_p90_s": p90,
        "ttft_p50_s": p90 / 2,
    }


def test_a_shared_tier_that_lowers_the_hit_rate_is_a_miss(monkeypatch):
    def fake(trace, cfg, policy):
        if cfg.shared:
            return _figures(0.2, 5.0)  # worse than no tiers on both counts
        return _figures(0.6, 0.8) if cfg.host_blocks else _figures(0.5, 1.0)

    monkeypatch.setattr(bench_simulator, "simulate_policy", fake)
    targets = Targets()
    bench_simulator.bench_tiers([], "/tmp", targets)
    assert len(targets.missed) == 1 and "host + shared" in targets.missed[0]
