"""Mooncake-form JSONL traces: the record form, its one reader and checker, bundled names, load scaling.

One record per line: `timestamp` (ms since trace start), `input_length` and `output_length` (tokens),
`hash_ids` (one id per `block_size`-token block of the prompt, the last one possibly partial; an id
always follows the same parent, so it names its whole prefix). Extra keys are kept as they are
(`tenant` is passed on to policies, `user` orders a replay's turns). A malformed line, or one with a
number past its limit (`MAX_TRACE_TOKENS`, `MAX_TIMESTAMP_MS`, `MAX_HASH_ID`), raises `TraceError` naming
the file, line and field, which the CLI prints as one line (exit 2).

Two forms of one record, one conversion between them: the JSONL record (a dict, `read_records`) is
what workloads generate, the replay client sends and files hold; `TraceRequest.from_record` is what
the simulator and the bounds take (`load_trace` for a file as it is, `workloads.engine_trace` after
scaling to an engine's block size).

Both keep tenants apart the same way (`tenant_block_ids`): live, kvmesh salts a tenant's block hashes, so two
tenants' prompts never share a cached block even where their trace ids are equal.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources

from kvmesh.policies.cost_model import finite_number

BUNDLED = {
    "conversation": "mooncake_conversation_trace.jsonl",
    "synthetic": "mooncake_synthetic_trace.jsonl",
}
SOURCE_BLOCK_TOKENS = 512  # Mooncake's block size: one hash id per 512 prompt tokens
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
# Upper limits on a record's numbers, far above any real trace's: past them a simulation's times lose the
# milliseconds a TTFT is made of (an output_length of 1e18 decodes for 2.5e16 s at 25 ms a token, where a
# float steps by 4 s: the run reported 0.00 utilisation, and a request queued behind it a TTFT of 2.5e16 s,
# with exit 0), or a number no other tool holds. Tokens: a thousand times the longest context windows (1M
# tokens; 10M at most); 10^9 tokens at the cost model's slowest 10 s a token still keep microseconds.
# Timestamps (ms): 10^15 is ~31,700 years, where a float still steps by 0.125 ms. Hash ids: int64, as vLLM
# and LMCache hold block hashes.
MAX_TRACE_TOKENS = 10**9
MAX_TIMESTAMP_MS = 10**15
MAX_HASH_ID = 2**63 - 1
_MAXIMA = {"timestamp": MAX_TIMESTAMP_MS, "input_length": MAX_TRACE_TOKENS, "output_length": MAX_TRACE_TOKENS}


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file and line."""


class BlockFitError(TraceError):
    """A record whose `input_length` does not fit its hash ids at the block size it was read with (a trace
    recorded at another block size, or read at the wrong one)."""


@dataclass(slots=True)
class TraceRequest:
    """One record as the simulator and the bounds take it (`from_record`); extra keys stay in the record."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    tenant: str | None = None

    @classmethod
    def from_record(cls, rec: dict) -> TraceRequest:
        """The request of a checked record (`check_record`): the one place a record becomes a request."""
        tenant = rec.get("tenant")
        return cls(
            float(rec["timestamp"]),
            int(rec["input_length"]),
            int(rec["output_length"]),
            list(rec["hash_ids"]),
            None if tenant is None else str(tenant),
        )


@dataclass
class Trace:
    name: str
    requests: list[TraceRequest]
    block_size: int = SOURCE_BLOCK_TOKENS
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0


def resolve(name_or_path: str | os.PathLike) -> str:
    """A bundled trace name ('conversation', 'synthetic') -> its packaged file; a path -> itself, if it exists and
    is not a folder. Not only a regular file: a pipe (`--trace <(zcat t.jsonl.gz)`, /dev/stdin) or a device
    (/dev/null) is taken too, since every reader (`read_records`, `load_trace`) reads the trace once, line by
    line; one that cannot be read is refused by that reader ("cannot read")."""
    name_or_path = os.fspath(name_or_path)
    if name_or_path in BUNDLED:
        return str(resources.files("kvmesh.cluster") / "traces" / BUNDLED[name_or_path])
    if os.path.isdir(name_or_path):
        raise TraceError(
            f"trace {name_or_path!r}: is a folder, not a trace file (a JSONL file, or one of: {', '.join(BUNDLED)})"
        )
    if not os.path.exists(name_or_path):
        raise TraceError(f"trace {name_or_path!r}: no such file (or use one of: {', '.join(BUNDLED)})")
    return name_or_path


def trace_name(name_or_path: str | os.PathLike) -> str:
    """How outputs name a trace: a bundled trace by its name, a file by its file name (extension kept)."""
    name_or_path = os.fspath(name_or_path)
    return name_or_path if name_or_path in BUNDLED else os.path.basename(name_or_path)


def brief(text: str) -> str:
    """A value's text for a one-line message, a number thousands of digits long cut to its first ones."""
    return text if len(text) <= 40 else text[:24] + f"... ({len(text)} characters)"


def _int_field(rec: dict, key: str, where: str, minimum: int = 0) -> float:
    """The checked field: a number from minimum to its upper limit (`_MAXIMA`), whole except the timestamp
    (an int or an integral float)."""
    v = rec.get(key)
    if not finite_number(v) or v < minimum:
        raise TraceError(f"{where}: field {key!r} must be a number >= {minimum}, got {brief(repr(v))}")
    if v > _MAXIMA[key]:
        raise TraceError(f"{where}: field {key!r} must be <= {_MAXIMA[key]:,}, got {brief(repr(v))}")
    if isinstance(v, float) and key != "timestamp" and not v.is_integer():
        raise TraceError(f"{where}: field {key!r} must be a whole number of tokens, got {v!r}")
    return v


def check_record(rec, where: str = "record", block_size: int = SOURCE_BLOCK_TOKENS) -> dict:
    """Check one record (a parsed JSONL line); raise TraceError naming `where` (e.g. 'chat.jsonl line 12')."""
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in FIELDS if k not in rec]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    _int_field(rec, "timestamp", where)
    n_in = _int_field(rec, "input_length", where, minimum=1)
    _int_field(rec, "output_length", where)
    ids = rec["hash_ids"]
    if (
        not isinstance(ids, list)
        or not ids
        # a list of plain ints passes at C speed; anything else is checked id by id
        or (
            not (set(map(type, ids)) == {int} and min(ids) >= 0)
            and not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids)
        )
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a non-empty list of non-negative integers")
    if max(ids) > MAX_HASH_ID:
        raise TraceError(f"{where}: 'hash_ids' must be <= 2^63-1, got {brief(str(max(ids)))}")
    if not (len(ids) - 1) * block_size < n_in <= len(ids) * block_size:
        raise BlockFitError(f"{where}: input_length {n_in} does not fit {len(ids)} hash ids of {block_size} tokens")
    for key in ("tenant", "user"):  # dict keys and cache salts: a list or an object cannot be either
        v = rec.get(key)
        if not (v is None or isinstance(v, str) or finite_number(v)):
            raise TraceError(f"{where}: field {key!r} must be a string, a finite number or null, got {brief(repr(v))}")
    return rec


def _iter_records(path: str, block_size: int, limit: int | None) -> Iterator[tuple[str, dict]]:
    """(where, checked record) per non-blank line, at most `limit` records."""
    count = 0
    base = os.path.basename(path)
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            where = f"{base} line {lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise TraceError(f"{where}: not valid JSON (nested too deeply)") from None
            except ValueError:  # an integer of more than 4300 digits (Python's limit on int parsing)
                raise TraceError(f"{where}: not valid JSON (a number with too many digits)") from None
            count += 1
            yield where, check_record(rec, where, block_size)


def _read(name_or_path: str, path: str, block_size: int, limit: int | None) -> Iterator[tuple[str, dict]]:
    try:
        yield from _iter_records(path, block_size, limit)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {name_or_path!r}: cannot read ({exc})") from None


def _in_time_order(items: Iterator[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    """The records as they come, as a simulation reads them; TraceError at the first whose timestamp is earlier
    than the one before (why: a simulation of such a trace has a negative span and no load, and nothing says
    so), or whose hash ids break the parent rule (`ParentRule`)."""
    last_ts = -math.inf
    check = ParentRule().check
    for where, rec in items:
        ts = float(rec["timestamp"])
        if ts < last_ts:
            raise TraceError(f"{where}: timestamp {ts:g} goes back in time (previous {last_ts:g})")
        last_ts = ts
        check(rec, where)
        yield where, rec


# the parent `ParentRule` keeps for a prompt's first id: no hash id is negative, and a dict lookup's None is
# left to mean "not seen"
_START = -1


class ParentRule:
    """The Mooncake rule, record by record: an id always follows the same parent (the id before it in a prompt,
    none for the first), so it names its whole prefix, and a prompt holds each id once. Kept per tenant, as
    `tenant_block_ids` keeps tenants apart (tenants 1 and "1" are one): two tenants' equal ids are different
    blocks, each tenant's own ids must keep the rule. Why checked: a prompt that repeats an id ([7, 7, 7, 8]) or
    an id that follows two parents is counted by the simulator's prefix match as the same cached block
    wherever it appears, while the bounds count each id once, so a policy "beat" the infinite-cache bound.

    Cheap at a million records: a prompt's ids seen before are looked up and compared with their expected
    parents at C speed (in a chat trace most of a prompt is history); only its new ids, at its end, are
    walked one by one."""

    __slots__ = ("_parents",)

    def __init__(self) -> None:
        self._parents: dict = {}  # tenant (None or its string) -> {id: the id before it, or _START}

    def check(self, rec: dict, where: str) -> None:
        """TraceError naming `where` if `rec`'s hash ids break the rule, with themselves or the records before."""
        ids = rec["hash_ids"]
        tenant = rec.get("tenant")
        key = None if tenant is None else str(tenant)
        parents = self._parents.get(key)
        if parents is None:
            parents = self._parents[key] = {}
        seen = list(map(parents.get, ids))  # each id's parent so far, None where the id is new
        expected = [_START, *ids]
        expected.pop()
        if seen == expected:
            return
        # ids seen before, up to the first new one, must follow their parents (no id twice among them then:
        # a repeat would follow two parents, back to the prompt's start)
        k = seen.index(None) if None in seen else len(ids)
        if seen[:k] != expected[:k]:
            self._refuse(ids, parents, where, key)
        new: dict = {}
        for i in range(k, len(ids)):
            h, p = ids[i], expected[i]
            old = parents.get(h, new.get(h))
            if old is None:
                new[h] = p
            elif old != p:  # a second parent, or the id twice in this prompt
                self._refuse(ids, parents, where, key)
        parents.update(new)

    @staticmethod
    def _refuse(ids: list[int], parents: dict, where: str, tenant: str | None) -> None:
        seen: set = set()
        prev = _START
        for h in ids:
            if h in seen:
                raise TraceError(
                    f"{where}: hash id {h} appears twice in one prompt (an id names its whole prefix, so a prompt "
                    "holds each id once)"
                )
            if h in parents and parents[h] != prev:
                first = "the start of a prompt"
                raise TraceError(
                    f"{where}: hash id {h} follows {first if prev == _START else f'id {prev}'} here but "
                    f"{first if parents[h] == _START else f'id {parents[h]}'} earlier"
                    + ("" if tenant is None else f" (tenant {brief(repr(tenant))})")
                    + " (an id always follows the same parent: it names its whole prefix)"
                )
            seen.add(h)
            prev = h
        raise TraceError(f"{where}: its hash ids break the parent rule")  # not reached: the loop names the id


def read_records(
    name_or_path: str | os.PathLike,
    limit: int | None = None,
    block_size: int = SOURCE_BLOCK_TOKENS,
    in_time_order: bool = False,
) -> list[dict]:
    """The checked records of a trace (bundled name or path) in file order, extra keys kept; TraceError if bad.
    With `in_time_order` (the records of a simulation), a timestamp that goes back is bad too, and so is a hash
    id that breaks the parent rule (`ParentRule`), as `load_trace` checks."""
    items = _read(os.fspath(name_or_path), resolve(name_or_path), block_size, limit)
    return [rec for _, rec in (_in_time_order(items) if in_time_order else items)]


def users_meta(users: list) -> dict:
    """`Trace.meta`'s "users" entry (per request: its record's user, a conversation's turns, for a client
    model such as `ClosedLoop.replying`), or nothing when no request names a user."""
    return {"users": users} if any(u is not None for u in users) else {}


def tenant_block_ids(tenants: Sequence, id_lists: Sequence[list[int]]) -> list[list[int]]:
    """Per request, its hash ids with tenants kept apart: a block is a (tenant, trace id) pair, as kvmesh's
    per-tenant salt makes it live (a request without a tenant is unsalted: a tenant of its own). `tenants`
    (any hashable values, None for no tenant) and `id_lists` go request by request.

    The tenant that uses an id first keeps it; another tenant's use of the same id becomes a fresh id above
    every id of the trace (below 2^63, as `MAX_HASH_ID`), the same fresh id wherever that tenant uses it. So
    a trace whose tenants never share an id (every generated one), or with one tenant or none, keeps every
    id, and the lists come back as they were given. The one rule of `load_trace` and `workloads.engine_trace`
    (so `kvmesh simulate` and `kvmesh trace bounds` agree)."""
    out = list(id_lists)
    per_tenant: dict = {}  # tenant -> the ids it uses
    for t, ids in zip(tenants, id_lists):
        used = per_tenant.get(t)
        if used is None:
            used = per_tenant[t] = set()
        used.update(ids)
    if len(per_tenant) < 2 or sum(map(len, per_tenant.values())) == len(set().union(*per_tenant.values())):
        return out  # no id used by two tenants (at C speed: a million-request trace lists tens of millions)
    del per_tenant
    keys: dict = {}  # tenant -> a small int: None must not read as "no owner yet" below
    tenant_keys = [keys.setdefault(t, len(keys)) for t in tenants]
    owner: dict[int, int] = {}  # id -> the tenant key that used it first
    clashes: list[int] = []  # requests holding an id another tenant used first
    for k, (t, ids) in enumerate(zip(tenant_keys, id_lists)):
        seen = set(map(owner.get, ids))
        seen.discard(None)
        if seen and seen != {t}:
            clashes.append(k)
            for h in ids:
                owner.setdefault(h, t)
        else:
            owner.update(dict.fromkeys(ids, t))
    if not clashes:
        return out
    fresh_ids = _unused_ids(owner)
    fresh: dict[tuple[int, int], int] = {}
    for k in clashes:
        t = tenant_keys[k]
        salted = []
        for h in id_lists[k]:
            if owner[h] != t:
                if (t, h) not in fresh:
                    fresh[t, h] = next(fresh_ids)
                h = fresh[t, h]
            salted.append(h)
        out[k] = salted
    return out


def _unused_ids(used: dict) -> Iterator[int]:
    """Ids no key of `used` holds, from above the largest up to `MAX_HASH_ID`, then upwards from 0."""
    top = max(used)
    yield from range(top + 1, MAX_HASH_ID + 1)
    yield from (h for h in itertools.count() if h not in used)


def load_trace(name_or_path: str, block_size: int = SOURCE_BLOCK_TOKENS, limit: int | None = None) -> Trace:
    """Load and validate a whole trace (bundled name or path) for the simulator: timestamps must not go
    back, and each tenant's hash ids must keep the parent rule (`ParentRule`). Raises TraceError; empty traces
    too. Tenants are kept apart (`tenant_block_ids`). `meta` holds the path, `limit`, and where records name a
    `user`, "users" (`users_meta`)."""
    if block_size < 1:
        raise TraceError("block size must be >= 1")
    path = resolve(name_or_path)
    reqs: list[TraceRequest] = []
    users: list = []
    for _, rec in _in_time_order(_read(name_or_path, path, block_size, limit)):
        reqs.append(TraceRequest.from_record(rec))
        users.append(rec.get("user"))
    if not reqs:
        raise TraceError(f"trace {name_or_path!r}: no requests")
    for r, ids in zip(reqs, tenant_block_ids([r.tenant for r in reqs], [r.hash_ids for r in reqs])):
        r.hash_ids = ids
    return Trace(trace_name(name_or_path), reqs, block_size, {"path": path, "limit": limit, **users_meta(users)})


def tile(trace: Trace, copies: int) -> Trace:
    """`copies` back-to-back copies with disjoint hash ids (a relabelled workload of the same shape),
    used to make million-request runs from the bundled traces."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    offset = 1 + max(h for r in trace.requests for h in r.hash_ids)
    span_ms = trace.span_s * 1000.0 + 1.0
    out: list[TraceRequest] = []
    for k in range(copies):
        for r in trace.requests:
            out.append(
                TraceRequest(
                    r.timestamp_ms + k * span_ms,
                    r.input_length,
                    r.output_length,
                    [h + k * offset for h in r.hash_ids],
                    r.tenant,
                )
            )
    meta = dict(trace.meta, tiled=copies)
    if "users" in meta:  # each copy's conversations are new ones
        meta["users"] = [None if u is None else f"{u}#{k}" for k in range(copies) for u in trace.meta["users"]]
    return Trace(f"{trace.name}x{copies}", out, trace.block_size, meta)


def scale_to_load(
    trace: Trace,
    replicas: int,
    load: float,
    prefill_s_per_token: float,
    prefill_base_s: float = 0.0,
    attention_s_per_token_pair: float = 0.0,
) -> tuple[list[float], float]:
    """Arrival times (s) stretched or squeezed so that the offered prefill work equals `load` x the
    fleet's prefill capacity over the trace's span:

        load = sum_i prefill_s(input_i, nothing cached) / (replicas * span_s)

    i.e. load 1.0 saturates the fleet if no prompt token were ever reused. Returns (arrivals, factor).
    ValueError where the cost model prices no prefill work: no span then gives that load (every arrival
    would be squeezed to t = 0 and the run reported at a load it never had)."""
    if load <= 0:
        raise ValueError("load must be > 0")
    t0 = trace.requests[0].timestamp_ms
    base = [(r.timestamp_ms - t0) / 1000.0 for r in trace.requests]
    work = offered_work_s(trace.requests, prefill_s_per_token, prefill_base_s, attention_s_per_token_pair)
    span = base[-1]
    if span <= 0:
        raise ValueError("trace has no time span (all timestamps equal); cannot scale to a load")
    if not work > 0:
        raise ValueError(
            "cannot scale the trace to a load: the cost model prices no prefill work (prefill_s_per_token, "
            "prefill_base_s and attention_s_per_token_pair are all 0); give one of them a value, or drop --load"
        )
    factor = work / (replicas * load * span)
    return [t * factor for t in base], factor


def offered_work_s(
    requests: Sequence[TraceRequest],
    prefill_s_per_token: float,
    prefill_base_s: float = 0.0,
    attention_s_per_token_pair: float = 0.0,
) -> float:
    """Seconds of prefill the requests ask for with nothing cached (`CostModel.prefill_s` of each)."""
    work = sum(r.input_length for r in requests) * prefill_s_per_token + len(requests) * prefill_base_s
    if attention_s_per_token_pair:
        work += sum(float(r.input_length) ** 2 for r in requests) * 0.5 * attention_s_per_token_pair
    return work
