"""kvmesh.kvstore.hashing's own properties: salts, incremental and memoised hashing, argument checks.

Byte-identity with vLLM's functions and with a real engine's KV events is in
tests/integration/test_hashing_matches_vllm.py.
"""

from __future__ import annotations

import os
import random

import pytest

from kvmesh.kvstore.hashing import (
    BlockHasher,
    HashMemo,
    block_hashes,
    block_hashes_full,
    to_event_hash,
)


@pytest.fixture(autouse=True)
def _fixed_seed(monkeypatch):
    """Engines and router share PYTHONHASHSEED in every deployment; xxhash needs it."""
    if "PYTHONHASHSEED" not in os.environ:
        monkeypatch.setenv("PYTHONHASHSEED", "0")


def rand_tokens(rng, n):
    return [rng.randrange(0, 50_000) for _ in range(n)]


def test_salt_changes_every_block_and_only_first_block_carries_it():
    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, cache_salt="s")
    assert all(a != b for a, b in zip(plain, salted))  # chained: block 0 differs, so all do
    assert block_hashes(tokens, 16, cache_salt="") == plain  # vLLM ignores empty salts


def test_event_form_is_low_64_bits():
    full = block_hashes_full(list(range(32)), 16)
    assert [to_event_hash(h) for h in full] == block_hashes(list(range(32)), 16)
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(32)), 16))


def test_incremental_equals_one_shot_for_any_split():
    rng = random.Random(3)
    tokens = rand_tokens(rng, 700)
    want = block_hashes(tokens, 32, cache_salt="t")
    for _ in range(20):
        hasher = BlockHasher(32, cache_salt="t")
        got, i = [], 0
        while i < len(tokens):
            step = rng.randrange(1, 90)
            got += hasher.extend(tokens[i : i + step])
            i += step
        assert got == want == hasher.hashes
        assert hasher.num_tokens == len(tokens)


def test_continuing_from_a_parent():
    tokens = list(range(100, 260))
    whole = block_hashes_full(tokens, 32, cache_salt="x")
    head = block_hashes_full(tokens[:64], 32, cache_salt="x")
    tail = block_hashes(tokens[64:], 32, parent=head[-1], cache_salt="x")
    assert tail == [to_event_hash(h) for h in whole[2:]]
    with pytest.raises(ValueError):
        block_hashes(tokens, 32, parent=123)


def test_memo_gives_identical_hashes_and_counts_hits():
    rng = random.Random(5)
    system = rand_tokens(rng, 512)
    memo = HashMemo(max_entries=1000)
    a = block_hashes(system + rand_tokens(rng, 100), 16, memo=memo)
    b_tokens = system + rand_tokens(rng, 100)
    b = block_hashes(b_tokens, 16, memo=memo)
    assert b == block_hashes(b_tokens, 16)
    assert a[:32] == b[:32] and memo.hits == 32
    small = HashMemo(max_entries=10)
    want = block_hashes(system, 16)
    assert block_hashes(system, 16, memo=small) == want
    assert 0 < len(small) <= 10  # bounded
    assert block_hashes(system, 16, memo=small) == want  # evicted entries recomputed, kept ones reused
    assert small.hits > 0 and small.misses > 32
    with pytest.raises(ValueError):
        HashMemo(max_entries=1)


def test_prefix_match_unit_view():
    """Engine hashing at a finer unit than its cache block: event hash = chain hash at block end."""
    tokens = list(range(256))
    fine = block_hashes(tokens, 32)
    assert block_hashes(tokens, 128, hash_block_size=32) == [fine[3], fine[7]]
    with pytest.raises(ValueError):
        block_hashes(tokens, 100, hash_block_size=32)


def test_bad_arguments():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 16, algo="md5")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 16, lora_name="x")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 16, mm_keys=[("a", 5, 10), ("b", 8, 2)])


def test_numpy_tokens_hash_like_python_ints():
    np = pytest.importorskip("numpy")
    tokens = list(range(64))
    assert block_hashes(np.array(tokens, dtype=np.int64), 16) == block_hashes(tokens, 16)


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


# ---------------------------------------------------------------- against a real engine's KV events


def test_memo_and_incremental_agree_with_plain_hashing_randomly():
    """Memo hits, ageing, partial prefixes, salt and arbitrary splits never change a hash."""
    rng = random.Random(21)
    for _ in range(150):
        memo = HashMemo(rng.choice([2, 3, 10, 1000]))
        salt = rng.choice([None, "s"])
        base = rand_tokens(rng, rng.randrange(0, 300))
        for _ in range(3):
            x = base[: rng.randrange(0, len(base) + 1)] + rand_tokens(rng, rng.randrange(0, 100))
            want = block_hashes(x, 16, cache_salt=salt)
            assert block_hashes(x, 16, cache_salt=salt, memo=memo) == want
            hasher, got, i = BlockHasher(16, cache_salt=salt, memo=memo), [], 0
            while i < len(x):
                step = rng.randrange(1, 40)
                got += hasher.extend(x[i : i + step])
                i += step
            assert got == want
            assert len(memo) <= memo.max_entries
