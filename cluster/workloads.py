"""Synthetic workloads in Mooncake JSONL form, and their expansion to an engine's block size.

Why synthetic traces: the bundled Mooncake traces have no tenants and no explicit conversations, so
they cannot show what multi-tenant, multi-turn chat does to a prefix cache. These generators make
that workload with known structure (who shares what) and stay in the same record form, so the
simulator and the live replay client read them unchanged:

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...],
     "tenant": "t0", "user": "t0-g1-u2"}

`hash_ids` follow the Mooncake rule: one id per `source_block_tokens` (512) tokens, and an id always
follows the same parent, so an id names the whole prefix before it. The last block may be partial
(`(n-1)*512 < input_length <= n*512`); a partial block is never cached, but a later request that
carries the same id as a full block shares its first tokens.

`engine_trace` expands records to the engine's granularity (tokens per trace block after scaling,
engine block size) for the simulator and for the bounds (`kvmesh.cluster.bounds.record_bounds`).
"""

from __future__ import annotations

import json
import os
import random
from array import array
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass

from kvmesh.cluster.trace import SOURCE_BLOCK_TOKENS, Trace, TraceRequest, tenant_block_ids, users_meta
from kvmesh.cluster.whole_file import atomic_write


# --------------------------------------------------------------------------------------- records
def write_jsonl(records: Iterable[dict], path: str | os.PathLike, progress: bool = False) -> int:
    """Write records one per line, whole or not at all (`atomic_write`); returns the count. Creates parent
    folders. `progress`: a progress bar on standard error when it is a terminal (a million records take
    seconds)."""
    if progress:
        from tqdm import tqdm

        total = len(records) if isinstance(records, Sized) else None
        records = tqdm(records, total=total, unit="req", desc="writing", leave=False, disable=None, mininterval=0.5)
    n = 0
    with atomic_write(path) as fh:
        for rec in records:
            fh.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
            n += 1
    return n


def scaled_block_lengths(rec: dict, tokens_per_block: int, source_block_tokens: int = SOURCE_BLOCK_TOKENS) -> list[int]:
    """Tokens each hash id contributes once a trace block of `source_block_tokens` becomes
    `tokens_per_block` tokens: full blocks give all of them, the trailing partial block its share
    (rounded, at least 1). The replay client expands ids into exactly these lengths."""
    return [tokens_per_block] * (len(rec["hash_ids"]) - 1) + [_tail_tokens(rec, tokens_per_block, source_block_tokens)]


def _tail_tokens(rec: dict, tokens_per_block: int, source_block_tokens: int) -> int:
    """The tokens the last (possibly partial) hash id of `rec` contributes (`scaled_block_lengths`)."""
    tail = rec["input_length"] - (len(rec["hash_ids"]) - 1) * source_block_tokens
    return min(tokens_per_block, max(1, round(tail * tokens_per_block / source_block_tokens)))


def scaled_output_length(rec: dict, tokens_per_block: int, source_block_tokens: int = SOURCE_BLOCK_TOKENS) -> int:
    """Output length scaled like the prompt (at least 1 token)."""
    return max(1, round(rec["output_length"] * tokens_per_block / source_block_tokens))


def replayed_output_length(
    rec: dict, tokens_per_block: int, max_tokens: int | None, source_block_tokens: int = SOURCE_BLOCK_TOKENS
) -> int:
    """The output tokens a replay asks for: the scaled output length, capped at `max_tokens` (None: no cap), as
    `kvmesh replay` sends `max_tokens = min(--max-tokens, scaled output_length)`; the one rule of the replay
    client and of `engine_trace`, so a simulation decodes what the live run it predicts decodes."""
    n = scaled_output_length(rec, tokens_per_block, source_block_tokens)
    return n if max_tokens is None else min(max_tokens, n)


# ----------------------------------------------------------------------------- chat workload
@dataclass(frozen=True)
class ChatSpec:
    """A multi-tenant multi-turn chat workload.

    `tenants` x `groups` system prompts (one per group; groups never share across tenants), each group
    with `users` users; every user holds a conversation of `turns` turns whose prompt is the group's
    system prompt + the whole history so far + the new user message. Users start spread over
    `start_spread_ms`; between turns a user thinks for `think_ms` (x uniform 0.5..1.5), so turns
    interleave across users. Sizes are in trace blocks (512 tokens each in the record form).
    """

    tenants: int = 2
    groups: int = 2
    users: int = 4
    turns: int = 4
    system_blocks: int = 8
    user_blocks: tuple[int, int] = (1, 2)  # min, max blocks of a new user message
    reply_blocks: tuple[int, int] = (1, 2)  # min, max blocks of an assistant reply (output_length)
    start_spread_ms: int = 20_000
    think_ms: int = 10_000
    seed: int = 0

    def check(self) -> None:
        for name in ("tenants", "groups", "users", "turns", "system_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("user_blocks", "reply_blocks"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must satisfy 1 <= min <= max")
        if self.start_spread_ms < 0 or self.think_ms < 0:
            raise ValueError("start_spread_ms and think_ms must be >= 0")


class FreshIds:
    """Hands out fresh hash ids: each id is created for exactly one position, so its parent is fixed."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def synth_chat(spec: ChatSpec = ChatSpec()) -> list[dict]:
    """Generate the chat workload, sorted by timestamp (ties by user); deterministic in `spec.seed`.

    The last block of each new user message is partial (a random share of 512 tokens), as in real
    traces; the next turn carries that id as a full block, then the reply, then the next message.
    The records of `ChatRecords(spec)`, all at once.
    """
    return list(ChatRecords(spec))


class ChatRecords:
    """`synth_chat`'s records, made one at a time in the same order (`len()` is their count), so that a
    trace of millions of requests is written as it is made (`write_jsonl`) instead of held whole: a record
    lists its prompt's whole history, ~0.7 kB each at the default sizes (100M requests: ~70 GB).

    Why two passes: the random draws must come in `synth_chat`'s order (user by user, turn by turn) for the
    same records, while the records go out in time order, which interleaves the users. The first pass makes
    the draws and keeps, per request, only what its record is made from (timestamp, where its prompt's ids
    end, the partial block's tokens, the reply's blocks: 32 bytes, ~50 during the sort); a sort of those by
    (timestamp, user) gives the order; the second pass makes each record in that order. A user's own ids are
    consecutive (its messages and replies are taken in turn, nothing between them), so a prompt is its
    group's system ids and a range of the user's."""

    def __init__(self, spec: ChatSpec = ChatSpec()) -> None:
        spec.check()
        self.spec = spec

    def __len__(self) -> int:
        s = self.spec
        return s.tenants * s.groups * s.users * s.turns

    def __iter__(self) -> Iterator[dict]:
        import numpy as np

        s = self.spec
        rng = random.Random(s.seed)
        system_start, user_start = array("q"), array("q")  # per group, per user: the first id
        stamps, ends, tails, replies = array("q"), array("q"), array("l"), array("l")  # per request
        next_id = 0
        for _ in range(s.tenants * s.groups):  # the draws and ids in synth_chat's order
            system_start.append(next_id)
            next_id += s.system_blocks
            for _ in range(s.users):
                user_start.append(next_id)
                clock = rng.uniform(0, s.start_spread_ms)
                for _ in range(s.turns):
                    next_id += rng.randint(*s.user_blocks)  # the new message
                    tails.append(rng.randint(SOURCE_BLOCK_TOKENS // 8, SOURCE_BLOCK_TOKENS))
                    reply = rng.randint(*s.reply_blocks)
                    stamps.append(int(clock))
                    ends.append(next_id)
                    replies.append(reply)
                    next_id += reply
                    clock += s.think_ms * rng.uniform(0.5, 1.5)
        # request j is user j // turns's turn j % turns: sorted by (timestamp, user's name, turn), as
        # synth_chat's stable sort by (timestamp, user) leaves a user's turns of one timestamp in turn order
        n = len(stamps)
        order = np.lexsort((_user_order(s) * s.turns + np.arange(n) % s.turns, np.frombuffer(stamps, np.int64)))
        for lo in range(0, n, 1 << 16):  # the order's Python ints a chunk at a time
            for j in order[lo : lo + (1 << 16)].tolist():
                u = j // s.turns
                t, g = divmod(u // s.users, s.groups)
                first = system_start[u // s.users]
                prompt = [*range(first, first + s.system_blocks), *range(user_start[u], ends[j])]
                yield {
                    "timestamp": stamps[j],
                    "input_length": (len(prompt) - 1) * SOURCE_BLOCK_TOKENS + tails[j],
                    "output_length": replies[j] * SOURCE_BLOCK_TOKENS,
                    "hash_ids": prompt,
                    "tenant": f"t{t}",
                    "user": f"t{t}-g{g}-u{u % s.users}",
                }


def _user_order(s: ChatSpec):
    """Per request (user by user, turn by turn), its user's place among all users in the order of their names
    ("t{t}-g{g}-u{u}", as `sorted` compares them): that order is the names' numbers compared as strings, tenant
    first, then group, then user ('-' sorts before every digit, so "t1-..." comes before "t10-..."). Numbers as
    strings are ranked with numpy, a few bytes each, not as Python strings."""
    import numpy as np

    def ranks(n: int):
        r = np.empty(n, np.int64)
        r[np.argsort(np.arange(n).astype("S"), kind="stable")] = np.arange(n)
        return r

    t, g, u = ranks(s.tenants), ranks(s.groups), ranks(s.users)
    user = ((t[:, None] * s.groups + g[None, :])[:, :, None] * s.users + u[None, None, :]).ravel()
    return np.repeat(user, s.turns)


def synth_flood(
    requests: int = 64,
    system_blocks: int = 8,
    unique_blocks: int = 1,
    interval_ms: float = 50.0,
    output_blocks: int = 1,
    tenant: str = "t0",
    seed: int = 0,
) -> list[dict]:
    """A shared-system-prompt flood (the hot-spot workload): `requests` single-turn requests from
    distinct users, all starting with one system prompt of `system_blocks` blocks, each followed by
    `unique_blocks` blocks of its own (last one partial), arriving every `interval_ms`. A policy that
    only chases the longest prefix puts all of them on one replica; a good one spreads the load.
    The records of `flood_records`, all at once."""
    return list(flood_records(requests, system_blocks, unique_blocks, interval_ms, output_blocks, tenant, seed))


def flood_records(
    requests: int = 64,
    system_blocks: int = 8,
    unique_blocks: int = 1,
    interval_ms: float = 50.0,
    output_blocks: int = 1,
    tenant: str = "t0",
    seed: int = 0,
) -> Iterator[dict]:
    """`synth_flood`'s records made one at a time (they are made in time order), so that `write_jsonl` writes
    a large flood as it is made; ValueError for bad sizes at the call, before any record."""
    if requests < 1 or system_blocks < 1 or unique_blocks < 1 or output_blocks < 1 or interval_ms < 0:
        raise ValueError("requests, system_blocks, unique_blocks, output_blocks must be >= 1; interval_ms >= 0")
    return _flood(requests, system_blocks, unique_blocks, interval_ms, output_blocks, tenant, seed)


def _flood(
    requests: int,
    system_blocks: int,
    unique_blocks: int,
    interval_ms: float,
    output_blocks: int,
    tenant: str,
    seed: int,
) -> Iterator[dict]:
    rng = random.Random(seed)
    ids = FreshIds()
    system = ids.take(system_blocks)
    for i in range(requests):
        prompt = system + ids.take(unique_blocks)
        tail = rng.randint(SOURCE_BLOCK_TOKENS // 8, SOURCE_BLOCK_TOKENS)
        yield {
            "timestamp": int(i * interval_ms),
            "input_length": (len(prompt) - 1) * SOURCE_BLOCK_TOKENS + tail,
            "output_length": output_blocks * SOURCE_BLOCK_TOKENS,
            "hash_ids": prompt,
            "tenant": tenant,
            "user": f"{tenant}-flood-{i}",
        }


def check_parent_rule(records: Iterable[dict]) -> None:
    """Raise ValueError if some hash id follows two different parents (the Mooncake rule)."""
    parent: dict[int, int | None] = {}
    for n, rec in enumerate(records):
        prev = None
        for i in rec["hash_ids"]:
            if parent.setdefault(i, prev) != prev:
                raise ValueError(f"record {n}: id {i} follows {prev}, earlier {parent[i]}")
            prev = i


# ------------------------------------------------------------------------------ engine granularity
# Engine blocks a trace may expand to (`engine_trace`): ~100 bytes each once made, ~230 bytes and ~5 us each
# in a simulation (the conversation trace's first 50 requests at 8,192 tokens per id and 1-token blocks, 9.6M
# blocks: 2.2 GB and 45 s for one policy). The whole bundled conversation trace at 512 tokens per id and
# vLLM's 16-token blocks is 9.1M. Before this limit, a ratio of tokens per block to block size far beyond any
# engine's (1,000,000 / 1: 42M blocks from three records) took 4 GB and more than 30 s.
MAX_ENGINE_BLOCKS = 10_000_000


def engine_blocks(
    records: Iterable[dict], tokens_per_block: int, block_size: int, source_block_tokens: int = SOURCE_BLOCK_TOKENS
) -> int:
    """How many engine blocks `engine_trace` makes of `records`, counted without making them."""
    full = -(-tokens_per_block // block_size)  # a full trace block's engine blocks
    total = 0
    for rec in records:
        tail = _tail_tokens(rec, tokens_per_block, source_block_tokens)
        total += (len(rec["hash_ids"]) - 1) * full + -(-tail // block_size)
    return total


def engine_trace(
    records: Sequence[dict],
    tokens_per_block: int,
    block_size: int | None = None,
    source_block_tokens: int = SOURCE_BLOCK_TOKENS,
    name: str = "workload",
    salt_by_tenant: bool = True,
    max_tokens: int | None = None,
) -> Trace:
    """The records as a `kvmesh.cluster.trace.Trace` at the engine's block size, for the simulator and the
    bounds: one id per engine block (with `salt_by_tenant`, tenants never share one, as their salts keep
    them apart live: `trace.tenant_block_ids`, the rule `load_trace` keeps too), lengths scaled like the
    replay client's prompts; `meta["tokens_per_block"]` says the scale. `max_tokens`: each request decodes
    min(`max_tokens`, scaled output length) tokens, as `kvmesh replay --max-tokens` asks of the engine (the
    replay's `max_tokens` of every request); None (the default) decodes the whole scaled output length, and
    `meta["max_tokens"]` says which. Lets a policy change be checked
    on the live benchmarks' workloads in seconds (tests/unit/benchmarks/test_peers.py). ValueError when
    the expansion would make more than `MAX_ENGINE_BLOCKS` blocks and more than the trace's own ids, before
    any is made (a million-request trace is as large without expansion, and its bounds cost far less)."""
    block_size = block_size or tokens_per_block
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    total = engine_blocks(records, tokens_per_block, block_size, source_block_tokens)
    trace_ids = sum(len(rec["hash_ids"]) for rec in records)
    if total > MAX_ENGINE_BLOCKS and total > trace_ids:  # a trace as large unexpanded is the caller's to bound
        raise ValueError(
            f"{len(records):,} requests at {tokens_per_block:,} tokens per trace block and engine blocks of "
            f"{block_size:,} tokens make {total:,} engine blocks, more than {MAX_ENGINE_BLOCKS:,} "
            f"({total / max(1, trace_ids):.0f} per trace block): use fewer tokens per block or a larger block size"
        )
    # the tenant as a request carries it (`TraceRequest.tenant`, a string): tenants 1 and "1" are one
    salts = [None if rec.get("tenant") is None or not salt_by_tenant else str(rec["tenant"]) for rec in records]
    salted = tenant_block_ids(salts, [rec["hash_ids"] for rec in records])
    ids: dict[tuple, int] = {}
    out = []
    for rec, block_ids in zip(records, salted):
        lengths = scaled_block_lengths(rec, tokens_per_block, source_block_tokens)
        hashes = [
            ids.setdefault((hid, j), len(ids) + 1)
            for hid, n in zip(block_ids, lengths)
            for j in range(-(-n // block_size))
        ]
        out.append(
            TraceRequest.from_record(
                {
                    "timestamp": rec["timestamp"],
                    "input_length": sum(lengths),
                    "output_length": replayed_output_length(rec, tokens_per_block, max_tokens, source_block_tokens),
                    "hash_ids": hashes,
                    "tenant": rec.get("tenant"),
                }
            )
        )
    meta = {
        "tokens_per_block": tokens_per_block,
        "max_tokens": max_tokens,
        **users_meta([r.get("user") for r in records]),
    }
    return Trace(name, out, block_size=block_size, meta=meta)


def fit_context(
    records: Iterable[dict],
    tokens_per_block: int,
    max_prompt_tokens: int,
    source_block_tokens: int = SOURCE_BLOCK_TOKENS,
) -> list[dict]:
    """The records whose scaled prompt fits `max_prompt_tokens` (a tiny model's context), in order."""
    return [
        r for r in records if sum(scaled_block_lengths(r, tokens_per_block, source_block_tokens)) <= max_prompt_tokens
    ]


def conversation_slice(
    records: Sequence[dict],
    conversations: int = 24,
    min_turns: int = 3,
    tokens_per_block: int = 32,
    max_prompt_tokens: int = 1900,
    source_block_tokens: int = SOURCE_BLOCK_TOKENS,
) -> list[dict]:
    """The first `conversations` multi-turn conversations of a Mooncake conversation trace, in trace
    order, each request tagged `user: conv-<id>` so a replay keeps its turns in order.

    Why not a plain slice: in that trace every request starts with one shared block (id 0) and a
    conversation's turns are minutes apart, so a short contiguous slice holds almost no reuse. A
    conversation is identified by its first two hash ids (the shared block and the conversation's own
    first block); only conversations with >= `min_turns` requests that all fit `max_prompt_tokens`
    after scaling are kept, so a tiny model's context can serve them.
    """
    groups: dict[tuple, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(tuple(rec["hash_ids"][:2]), []).append(i)
    picked: list[int] = []
    chosen = 0
    for key, idx in sorted(groups.items(), key=lambda kv: kv[1][0]):
        if chosen >= conversations:
            break
        if len(idx) < min_turns or len(key) < 2:
            continue
        if any(
            sum(scaled_block_lengths(records[i], tokens_per_block, source_block_tokens)) > max_prompt_tokens
            for i in idx
        ):
            continue
        picked.extend(idx)
        chosen += 1
    return [dict(records[i], user=f"conv-{records[i]['hash_ids'][1]}") for i in sorted(picked)]
