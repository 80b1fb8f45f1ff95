"""Block hashes exactly as vLLM 0.32 computes them for prefix caching, without importing vLLM.

Why: the router must name a request's KV blocks with the same keys the engines publish in their KV
events (BlockStored.block_hashes), or no prefix ever matches. vLLM (`v1/core/kv_cache_utils.py`,
`utils/hashing.py`) chains, per full block of `block_size` tokens:

    h_i = hash_fn((h_{i-1} or NONE_HASH, tuple(block_tokens), extra_keys or None))

- `hash_fn`: `sha256` = SHA-256 of `pickle.dumps(obj, HIGHEST_PROTOCOL)` (default); `sha256_cbor` =
  SHA-256 of canonical CBOR; `xxhash` / `xxhash_cbor` = XXH3-128 of the same serialisations.
- `NONE_HASH = hash_fn(seed)`: seed = `PYTHONHASHSEED` if set, else "vllm-none-hash" for the sha256
  algorithms; the xxhash algorithms then use a random per-process seed, which no router can
  reproduce, so we refuse them unless a seed is known.
- extra keys, in this order: `("lora", name, path)`; `("mm", identifier, offset_in_block)` for each
  multimodal item overlapping the block; `("cache_salt", salt)` on the first block only.
- only full blocks are hashed; events carry the low 64 bits (`int.from_bytes(h, "big") & 2**64-1`).

Prompt-embedding inputs are not supported (the router never sees embeddings).
`BlockHasher` keeps full-width parent hashes so a conversation's next turn hashes only its new
blocks; `HashMemo` memoises (parent, block tokens) -> hash across requests, so a prompt whose prefix
was seen before costs a dict probe per known block instead of a pickle + SHA-256.
"""

from __future__ import annotations

import array
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1
_PROTO = pickle.HIGHEST_PROTOCOL
_W = array.array("I").itemsize  # bytes per token in memo keys


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTO)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PROTO))


def _xxhash_cbor(obj: Any) -> bytes:
    import cbor2
    import xxhash

    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}
_NONE_HASHES: dict[tuple[str, str], bytes] = {}


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    """vLLM's `prefix_caching_hash_algo` by name."""
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {ALGOS}") from None


def resolve_seed(algo: str, seed: str | None = None) -> str:
    """The NONE_HASH seed the engine uses (vLLM `resolve_none_hash_seed`), or an error if unknowable."""
    hash_fn(algo)
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if algo.startswith("xxhash"):
        raise ValueError(
            f"{algo}: vLLM seeds NONE_HASH randomly per process when PYTHONHASHSEED is unset; "
            "set the same PYTHONHASHSEED for engines and router (or pass none_hash_seed)"
        )
    return DEFAULT_NONE_HASH_SEED


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent hash of every first block."""
    key = (algo, resolve_seed(algo, seed))
    h = _NONE_HASHES.get(key)
    if h is None:
        h = _NONE_HASHES[key] = hash_fn(algo)(key[1])
    return h


def to_event_hash(full: bytes) -> int:
    """The 64-bit form vLLM's KV events carry (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)."""
    return int.from_bytes(full, "big") & _MASK64


def _check_mm(mm_keys):
    items = [(str(i), int(o), int(n)) for i, o, n in (mm_keys or ())]
    if any(b[1] < a[1] + a[2] for a, b in zip(items, items[1:])):
        raise ValueError("mm_keys must be (identifier, offset, length) sorted by offset, non-overlapping")
    return items


class HashMemo:
    """Bounded memo of block hashes keyed by (parent hash, block tokens, extra keys).

    A full-width parent hash names the whole prefix before a block (its algorithm, seed and salt
    included), so a hit is exact. The key is the parent's bytes followed by the block's tokens as
    uint32 bytes: building and probing it costs ~0.3 us, against ~1.5 us for pickle + SHA-256 of a
    16-token block. Pays off for shared system prompts and multi-turn chats, where most of a
    prompt's blocks were hashed on an earlier request. Use one memo per (algorithm, block size).

    Two generations of plain dicts instead of an LRU list: inserts go to the young one; when it
    holds max_entries/2 the old one is dropped and the young one ages; a hit in the old one is
    copied forward. Recently used entries survive, at most max_entries are held, and a miss costs one
    batched dict insert: most blocks of a new prompt miss, and after a block misses every later block of
    that prompt does too (its parent is new), so lookups stop there.
    """

    def __init__(self, max_entries: int = 200_000):
        if max_entries < 2:
            raise ValueError("max_entries must be at least 2")
        self.max_entries = max_entries
        self._young: dict[Any, tuple[bytes, int]] = {}  # key -> (full hash, event form)
        self._old: dict[Any, tuple[bytes, int]] = {}
        self.hits = 0
        self.misses = 0

    def _age(self, force: bool = False) -> None:
        """Invariant: young < max_entries/2 <= old's bound, so at most max_entries are held."""
        if force or len(self._young) >= self.max_entries // 2:
            self._old, self._young = self._young, {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


class BlockHasher:
    """Incremental chained hashing of one token sequence: `extend` hashes only new full blocks.

    Keeps the partial tail between calls, so feeding a conversation turn by turn yields the same
    hashes as hashing the whole token list at once.
    """

    def __init__(
        self,
        block_size: int,
        *,
        algo: str = "sha256",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_keys: Sequence[tuple[str, int, int]] | None = None,
        parent: bytes | None = None,
        start_token: int | None = None,
        none_hash_seed: str | None = None,
        memo: HashMemo | None = None,
    ):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if (lora_name is None) != (lora_path is None):
            raise ValueError("LoRA hashing needs both lora_name and lora_path (vLLM keys on both)")
        if parent is not None and not isinstance(parent, bytes):
            raise ValueError("parent must be a full-width hash (bytes), not the 64-bit event form")
        self.block_size = block_size
        self.algo = algo
        self._fn = hash_fn(algo)
        self._none = none_hash(algo, none_hash_seed)
        self._salt = cache_salt or None  # vLLM skips empty salts
        self._lora = ("lora", lora_name, lora_path) if lora_name is not None else None
        self._mm = _check_mm(mm_keys)
        if start_token is None:
            if parent is not None and self._mm:
                raise ValueError("continuing from a parent with mm_keys needs start_token")
            start_token = 0 if parent is None else block_size
        self._pos = start_token  # token index of the first unhashed token
        self._parent = parent
        self._tail: list[int] = []
        self._memo = memo
        self.full_hashes: list[bytes] = []
        self.hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self._pos + len(self._tail)

    @property
    def parent(self) -> bytes | None:
        """Full-width hash of the last full block (None before the first)."""
        return self._parent

    def _extra(self, start: int, end: int) -> tuple | None:
        keys: list[tuple] = []
        if self._lora is not None:
            keys.append(self._lora)
        for ident, off, length in self._mm:
            if off >= end:
                break
            if off + length > start:
                keys.append(("mm", ident, off - start))
        if start == 0 and self._salt:
            keys.append(("cache_salt", self._salt))
        return tuple(keys) if keys else None

    def extend(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens; return the 64-bit hashes of the blocks this completed."""
        if hasattr(tokens, "tolist"):
            tokens = tokens.tolist()  # numpy ints would pickle differently
        buf = self._tail + list(tokens) if self._tail else list(tokens)
        bs = self.block_size
        n_full = len(buf) // bs
        if self._lora is not None or self._mm:  # per-block extra keys: rare, no memo
            full = self._chain_general(buf, n_full)
            evs = [int.from_bytes(h, "big") & _MASK64 for h in full]
        else:
            memo = self._memo
            packed = self._pack(buf, n_full * bs) if memo is not None else None
            if memo is not None and packed is not None:
                full, evs = self._memo_prefix(memo, buf, n_full, packed)
            else:
                full, evs = [], []
            k = len(full)
            before = full[-1] if k else self._parent
            new = self._chain_plain(buf, k, n_full, before)
            new_evs = [int.from_bytes(h, "big") & _MASK64 for h in new]
            if memo is not None and packed is not None:
                if k < n_full:
                    memo.misses += n_full - k
                    self._memo_store(memo, packed, k, [before or self._none] + new[:-1], new, new_evs)
                memo.hits += k
            full += new
            evs += new_evs
        if full:
            self._parent = full[-1]
        self._pos += n_full * bs
        self._tail = buf[n_full * bs :]
        self.full_hashes.extend(full)
        self.hashes.extend(evs)
        return evs

    def _salt_key(self, b: int):
        """Extra keys of relative block b in the plain case: the salt, on the sequence's first block."""
        if self._salt and self._pos + b * self.block_size == 0:
            return (("cache_salt", self._salt),)
        return None

    def _chain_plain(self, buf: list[int], first: int, end: int, parent: bytes | None) -> list[bytes]:
        """Hashes of relative blocks first..end-1 (no LoRA/mm keys) in a tight loop."""
        bs = self.block_size
        parent = parent or self._none
        out: list[bytes] = []
        if first < end and self._salt_key(first) is not None:
            parent = self._fn((parent, tuple(buf[first * bs : (first + 1) * bs]), self._salt_key(first)))
            out.append(parent)
            first += 1
        if self.algo == "sha256":  # the default: inlined, no Python call per block
            dumps, sha, proto = pickle.dumps, hashlib.sha256, _PROTO
            for i in range(first * bs, end * bs, bs):
                parent = sha(dumps((parent, tuple(buf[i : i + bs]), None), proto)).digest()
                out.append(parent)
        else:
            fn = self._fn
            for i in range(first * bs, end * bs, bs):
                parent = fn((parent, tuple(buf[i : i + bs]), None))
                out.append(parent)
        return out

    def _memo_prefix(self, memo: HashMemo, buf: list[int], n_full: int, packed: bytes) -> tuple[list[bytes], list[int]]:
        """Leading blocks found in the memo. After the first miss every later key has a parent
        never seen before, so the walk stops there."""
        young, old = memo._young, memo._old
        step = self.block_size * _W
        parent = self._parent or self._none
        full: list[bytes] = []
        evs: list[int] = []
        for b in range(n_full):
            block_key = parent + packed[b * step : (b + 1) * step]
            extra = self._salt_key(b) if b == 0 else None
            key: bytes | tuple[bytes, tuple] = block_key if extra is None else (block_key, extra)
            hit = young.get(key)
            if hit is None:
                hit = old.get(key)
                if hit is None:
                    break
                young[key] = hit  # copied forward: recently used survives the next ageing
                if len(young) >= memo.max_entries // 2:
                    memo._age()
                    young, old = memo._young, memo._old
            parent = hit[0]
            full.append(parent)
            evs.append(hit[1])
        return full, evs

    def _memo_store(
        self, memo: HashMemo, packed: bytes, first: int, parents: list[bytes], hashes: list[bytes], evs: list[int]
    ) -> None:
        """Insert the new blocks' keys (only the leading ones if they exceed half the memo: a chain
        is only ever found from its start)."""
        half = memo.max_entries // 2
        if len(parents) > half - len(memo._young) and memo._young:
            memo._age(force=True)
        n = min(len(parents), half)
        step = self.block_size * _W
        keys: list[bytes | tuple[bytes, tuple]] = [
            parents[i] + packed[(first + i) * step : (first + i + 1) * step] for i in range(n)
        ]
        extra = self._salt_key(first)
        if extra is not None and keys:
            keys[0] = (parents[0] + packed[first * step : (first + 1) * step], extra)
        memo._young.update(zip(keys, zip(hashes[:n], evs[:n])))
        memo._age()

    def _chain_general(self, buf: list[int], n_full: int) -> list[bytes]:
        """Per-block extra keys (LoRA, multimodal, salt) exactly as vLLM builds them."""
        bs, fn = self.block_size, self._fn
        parent, pos = self._parent or self._none, self._pos
        out: list[bytes] = []
        for b in range(n_full):
            parent = fn((parent, tuple(buf[b * bs : (b + 1) * bs]), self._extra(pos, pos + bs)))
            out.append(parent)
            pos += bs
        return out

    @staticmethod
    def _pack(buf: list[int], n: int) -> bytes | None:
        """Tokens as uint32 bytes for memo keys; None (no memo) if an id does not fit."""
        try:
            return array.array("I", buf[:n]).tobytes()
        except (OverflowError, TypeError):
            return None


def block_hashes_full(token_ids: Sequence[int], block_size: int, **kw) -> list[bytes]:
    """Full-width (bytes) chained hashes of every full block; keywords as for `block_hashes`."""
    hasher = BlockHasher(block_size, **kw)
    hasher.extend(token_ids)
    return hasher.full_hashes


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    mm_keys: Sequence[tuple[str, int, int]] | None = None,
    parent: bytes | None = None,
    hash_block_size: int | None = None,
    none_hash_seed: str | None = None,
    memo: HashMemo | None = None,
) -> list[int]:
    """64-bit event-form hashes of the full blocks of `token_ids`, as in vLLM's BlockStored events.

    `hash_block_size` mirrors vLLM's `prefix_match_unit`: when the engine hashes at a finer unit
    than its cache block, an event's hash for a block is the chain hash at that block's last unit.
    `mm_keys` are (identifier, offset, length) per multimodal item, sorted by offset.
    """
    unit = hash_block_size or block_size
    for size in (block_size, unit):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"block sizes must be positive ints, got {size!r}")
    if block_size % unit:
        raise ValueError(f"block_size {block_size} is not a multiple of hash_block_size {unit}")
    hasher = BlockHasher(
        unit,
        algo=algo,
        cache_salt=cache_salt,
        lora_name=lora_name,
        lora_path=lora_path,
        mm_keys=mm_keys,
        parent=parent,
        none_hash_seed=none_hash_seed,
        memo=memo,
    )
    out = hasher.extend(token_ids)
    step = block_size // unit
    return out if step == 1 else out[step - 1 :: step]
