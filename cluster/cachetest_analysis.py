"""`kvmesh cachetest` analysis: a logged request as the engine sees it, and the attribution of every uncached
prompt token of every sent request to one reason (`cluster/miss_reasons.py`).

The fleet's history is rebuilt from what the test itself sent, in time order: a request's blocks count as
computed once its first token arrived (its prefill is done), so two concurrent requests with one prefix
are both `cold`. When the endpoint is kvmesh, the router's record of the placement
(`/kvmesh/explain/{request_id}`) splits the blocks computed before into `misrouted` (another replica or
tier held them) and `evicted` (none did); against a peer that part is `unknown`. The history is kept per
tenant and per model the request was sent as (`Sent.model`), not the model the log names: the runner
sends every request as the served model, so a log naming several models shows no `adapter` misses.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvmesh.cluster.block_cache import leading_held
from kvmesh.cluster.miss_reasons import attribute, drift_kind, text_units
from kvmesh.cluster.prefix_share import TokenizedRequest, _lcp, hash_requests
from kvmesh.cluster.request_log import (
    ChatRenderer,
    LoggedRequest,
    RequestLogError,
    logged_adds_special_tokens,
    message_texts,
    prompt_text,
    rendered_chat,
)


@dataclass
class Prepared:
    """A logged request with its token ids, hashes and message units (for drift)."""

    req: LoggedRequest
    tok: TokenizedRequest
    units: list = field(default_factory=list)  # [(unit key, token end)]
    origin: Prepared | None = None  # the logged prompt this one was derived from (the partial pass)
    _chain: list[int] | None = None

    @property
    def unit_chain(self) -> list[int]:
        """Per leading unit count j, one key for the first j units (compared across prompts)."""
        if self._chain is None:
            h, chain = 0, []
            for key, _ in self.units:
                h = hash((h, key))
                chain.append(h)
            self._chain = chain
        return self._chain


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: building hundreds of thousands of small lists and tuples
    (token ids, offsets, hashes) that never form cycles otherwise triggers full collections that cost
    as much as the work itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def prepare(reqs: Sequence[LoggedRequest], tokenizer, block_size: int, algo: str = "sha256") -> list[Prepared]:
    with paused_gc():
        return _prepare(reqs, tokenizer, block_size, algo)


def _prepare(reqs: Sequence[LoggedRequest], tokenizer, block_size: int, algo: str) -> list[Prepared]:
    """Tokenise every request as kvmesh's ingress does (a chat's template text without extra special tokens, a
    completion's text with them), hash it.

    Texts are encoded in one batch by the fast tokenizer's backend (with character offsets, which map
    messages to token positions for drift); a slow tokenizer encodes them one by one."""
    render = ChatRenderer(tokenizer)
    # a chat's units are the messages as its template got them (`template_messages`: its parts, the developer
    # role merged into the leading system message), found in the text in that order
    rendered = [rendered_chat(r, tokenizer, render) if r.is_chat else (None, prompt_text(r, tokenizer)) for r in reqs]
    texts = [(r, t) for r, (_, t) in zip(reqs, rendered) if t is not None]
    try:
        encoded = _encode(tokenizer, [(t, logged_adds_special_tokens(r)) for r, t in texts])
    except Exception:
        _refused_text(tokenizer, texts)
        raise
    out = []
    k = 0
    for i, (r, (conversation, text)) in enumerate(zip(reqs, rendered)):
        if text is None:
            ids = list(r.body["prompt"])
            units: list = []
        else:
            ids, offsets = encoded[k]
            k += 1
            if conversation is not None:
                contents: list = [(m["role"], message_texts(m["content"])) for m in conversation]
            else:
                contents = [("prompt", line) for line in text.split("\n") if line.strip()]
            units = text_units(text, contents, offsets)
        out.append(Prepared(r, TokenizedRequest(i, r.id, r.tenant, r.model, ids), units))
    hash_requests([p.tok for p in out], block_size, algo)
    return out


def _refused_text(tokenizer, texts: list[tuple[LoggedRequest, str]]) -> None:
    """`RequestLogError` naming the first request whose text the tokenizer refuses (a lone UTF-16 surrogate,
    which JSON allows and the ingress answers with a 400)."""
    for r, t in texts:
        try:
            _encode(tokenizer, [(t, logged_adds_special_tokens(r))])
        except Exception as exc:
            try:
                t.encode("utf-8")
                reason = " ".join(str(exc).split()) or type(exc).__name__
            except UnicodeEncodeError:
                reason = "it holds a lone UTF-16 surrogate"
            raise RequestLogError(f"{r.named}: the prompt cannot be tokenized: {reason}") from None


def _encode(tokenizer, texts: list[tuple[str, bool]]) -> list[tuple[list[int], list]]:
    """Each (text, with the model's special tokens?) as (ids, character offsets), in order."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:  # one batch per setting: a batch is far faster than one call per text
        out: list = [None] * len(texts)
        for special in (False, True):
            at = [i for i, (_, s) in enumerate(texts) if s is special]
            for i, e in zip(at, backend.encode_batch([texts[i][0] for i in at], add_special_tokens=special)):
                out[i] = (e.ids, e.offsets)
        return out
    result = []
    for t, special in texts:
        enc = tokenizer(t, add_special_tokens=special, return_offsets_mapping=True)
        result.append((list(enc["input_ids"]), enc["offset_mapping"]))
    return result


@dataclass
class Sent:
    """One request as a pass sent it and the server answered."""

    prepared: Prepared
    pass_name: str
    start_s: float  # on one clock for the whole test
    ready_s: float | None  # when its prefill was done (first token), None if it failed
    prompt_tokens: int
    cached_tokens: int | None
    replica: str
    error: str | None = None
    explain: dict | None = None  # the router's record (kvmesh), else None
    # the model it was sent as (the runner sends every request as the served model, whatever the log
    # names); the fleet's history is kept per (tenant, this), so None everywhere is one model
    model: str | None = None


class MissAnalyzer:
    """Walks sent requests in send order, keeping what the fleet has computed, and attributes misses."""

    def __init__(self, block_size: int, decode=None):
        self.block_size = block_size
        self.decode = decode  # token ids -> text, for the drift examples
        self.salted: dict[tuple, set[int]] = {}  # (tenant, model sent as) -> blocks computed
        self.unsalted: dict[str | None, set[int]] = {}  # tenant -> blocks computed (no salt)
        self.units: dict[str | None, dict[int, Prepared]] = {}  # tenant -> unit-chain key -> first prompt
        self.drifts: list[dict] = []

    def run(self, sent: Sequence[Sent]) -> list[dict[str, int]]:
        """Reasons per sent request (in the order given); every request's values sum to its uncached tokens."""
        order = sorted(range(len(sent)), key=lambda i: sent[i].start_s)
        ready = sorted((s.ready_s, i) for i, s in enumerate(sent) if s.ready_s is not None and s.error is None)
        out: list[dict[str, int]] = [{} for _ in sent]
        k = 0
        for i in order:
            s = sent[i]
            while k < len(ready) and ready[k][0] <= s.start_s:
                self._computed(sent[ready[k][1]])
                k += 1
            if s.error is None and s.cached_tokens is not None:
                out[i] = self.attribute(s)
        return out

    def _computed(self, s: Sent) -> None:
        """What `s` computed: its blocks under its tenant and the model it was sent as (not the logged
        model: a miss on blocks this test computed under the same model is no `adapter` miss)."""
        p = s.prepared
        t = p.tok
        self.salted.setdefault((t.tenant, s.model), set()).update(t.salted)
        self.unsalted.setdefault(t.tenant, set()).update(t.unsalted)
        chains = self.units.setdefault(t.tenant, {})
        for key in p.unit_chain:
            chains.setdefault(key, p)

    def attribute(self, s: Sent) -> dict[str, int]:
        t, B = s.prepared.tok, self.block_size
        n = s.prompt_tokens
        seen = leading_held(t.salted, self.salted.get((t.tenant, s.model), ()))
        isolated = max(
            (leading_held(t.unsalted, held) for ten, held in self.unsalted.items() if ten != t.tenant), default=0
        )
        adapter = max(
            (
                leading_held(t.salted, held)
                for (ten, model), held in self.salted.items()
                if ten == t.tenant and model != s.model
            ),
            default=0,
        )
        drift_end, twin, twin_end = self._drift(s.prepared)
        partial_end = 0
        for other in (twin, s.prepared.origin):
            if other is not None:
                partial_end = max(partial_end, _lcp(t.ids, other.tok.ids))
        elsewhere, tier = None, 0
        if s.explain is not None:
            elsewhere = int(s.explain.get("elsewhere_blocks", 0))
            tier = int(s.explain.get("tier_blocks", 0))
        reasons = attribute(
            n,
            s.cached_tokens or 0,
            B,
            seen_blocks=seen,
            isolated_blocks=isolated,
            adapter_blocks=adapter,
            drift_end=drift_end,
            partial_end=partial_end,
            elsewhere_blocks=elsewhere,
            tier_blocks=tier,
        )
        if reasons.get("drift") and twin is not None:
            self._record_drift(s, twin, partial_end, reasons["drift"], drift_end, twin_end)
        return reasons

    def _drift(self, p: Prepared) -> tuple[int, Prepared | None, int]:
        """(token end of the leading units whose text matches an earlier prompt's, that prompt, and the
        token end of the same units in it)."""
        chains = self.units.get(p.tok.tenant)
        if not chains or not p.units:
            return 0, None, 0
        end, twin, twin_end = 0, None, 0
        for j, key in enumerate(p.unit_chain, start=1):
            other = chains.get(key)
            if other is None or len(other.units) < j:
                break
            end, twin, twin_end = p.units[j - 1][1], other, other.units[j - 1][1]
        return end, twin, twin_end

    def _record_drift(self, s: Sent, twin: Prepared, at: int, tokens: int, end: int, twin_end: int) -> None:
        a, b = s.prepared.tok.ids, twin.tok.ids
        span_a = span_b = ""
        kind = "unknown"
        if self.decode is not None:
            span_a = self.decode(a[max(0, at - 12) : at + 12])
            span_b = self.decode(b[max(0, at - 12) : at + 12])
            kind = drift_kind(self.decode(a[at:end]), self.decode(b[at:twin_end]))
        self.drifts.append(
            {
                "id": s.prepared.req.id,
                "pass": s.pass_name,
                "tenant": s.prepared.tok.tenant,
                "matches": twin.req.id,
                "drift_tokens": tokens,
                "first_differing_token": at,
                "token_ids": [a[at] if at < len(a) else None, b[at] if at < len(b) else None],
                "text": span_a,
                "earlier_text": span_b,
                "kind": kind,
            }
        )
