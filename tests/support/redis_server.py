"""Test fixture helper: a real Debian `redis-server` on a free loopback port (see kvstore/redis_process.py).

with RedisServer(tmp_path) as redis:      # or redis = RedisServer(tmp_path).start(); ...; redis.stop()
    cfg = {"l2": redis.url}
"""

from kvmesh.kvstore.redis_process import RedisServer

__all__ = ["RedisServer"]
