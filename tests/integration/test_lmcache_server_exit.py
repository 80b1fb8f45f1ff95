"""A real LMCache server that exits at once (a flag it rejects after its imports) is reported as failed."""

import pytest

from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.tiers import (
    TierConfig,
)

pytestmark = pytest.mark.integration


SAMPLE = """# HELP lmcache_mp_lookup_hit_l1_tokens_total x
# TYPE lmcache_mp_lookup_hit_l1_tokens_total counter
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="/m"} 1152.0
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="s1",model_name="/m"} 48.0
lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="/m"} 576.0
lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="/m"} 1776.0
lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="/m"} 2720.0
lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 49.0
lmcache_mp_l1_read_chunks_total{l1_tag="_default"} 36.0
lmcache_mp_l1_memory_usage_bytes{backend="dram",l1_tag="_default"} 3.211264e+06
lmcache_mp_l1_usage_ratio{backend="dram",l1_tag="_default"} 0.0598
lmcache_mp_l2_store_completed_objects_total{l2_name="resp"} 49.0
"""


def test_server_that_exits_at_once_is_reported(tmp_path):
    cfg = TierConfig.from_dict({"extra_args": ["--no-such-flag"], "start_timeout_s": 60})
    srv = LMCacheServer(cfg, tmp_path / "srv.log")
    from kvmesh.kvstore.lmcache_server import LMCacheServerError

    with pytest.raises(LMCacheServerError, match="exited"):
        srv.start()
    assert not srv.alive()
