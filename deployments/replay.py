"""Replay a Mooncake-form trace against a live OpenAI-compatible endpoint and measure what the cache did.

Works against kvmesh's ingress, a plain vLLM OpenAI server (`--enable-prompt-tokens-details`), and
peer routers in front of such servers (vllm-router, sglang-router). Per request it records TTFT (time
to the first streamed chunk carrying output: non-empty text, not an empty choice sent before it), the server-reported
`usage.prompt_tokens_details.cached_tokens` (asked for with `stream_options.include_usage`), and the
replica that served it (`x-kvmesh-replica` header; peers lack it, then a fixed `label` stands in and
per-replica figures are unknown).

Prompts. Each hash id expands to a deterministic pseudo-random block of `tokens_per_block` tokens
seeded by the id, so shared id prefixes are identical token prefixes and a cache can hit. Pick
`tokens_per_block` as a multiple of the engine's block size so trace blocks align with engine blocks.
Two prompt forms:
- `tokens`: token ids (the exact form; vLLM, kvmesh and vllm-router accept them).
- `text`: for endpoints that only take text (sglang-router). Each token becomes one word from the
  tokenizer's own vocabulary chosen so that " word" encodes to exactly one token and a run of such
  words encodes word by word (byte-level BPE splits before each space). Text is then prefix-stable:
  a shared word prefix is a shared token prefix. The server may prepend BOS, shifting every block by
  one token; hits are still counted by the server, only alignment with trace blocks is lost.

Ordering. Requests of one `user` (multi-turn chat) are sent one after another: a user cannot send
turn k+1 before turn k's reply arrived. Otherwise arrivals follow a fixed concurrency, or the trace's
timestamps scaled by `time_scale`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from kvmesh.cluster.stats import nearest_rank
from kvmesh.cluster.workloads import SOURCE_BLOCK_TOKENS, replayed_output_length, scaled_block_lengths
from kvmesh.deployments.openai_protocol import shown

# Token ids drawn for `tokens` prompts when no tokenizer is given: inside the 256-byte alphabet of any
# byte-level BPE and past the usual special-token ids, so valid for any such model.
DEFAULT_TOKEN_RANGE = (10, 260)
# A trace block (512 tokens as recorded) expands to at most 16x that: 16 such blocks already fill a 128K
# context, and a typo (an extra digit) would otherwise build one block of gigabytes before any request
MAX_TOKENS_PER_BLOCK = 8192
# Expanded blocks kept for reuse, counted in tokens: a fixed count of blocks would hold gigabytes once
# blocks are large (each token is an int in a tuple)
BLOCK_CACHE_TOKENS = 1 << 22
# The longest a replay at the trace's timestamps may take to send its last request, in seconds: a day, far
# beyond any measured run (the bundled traces span about an hour at time scale 1), where a scale with an extra
# digit or exponent (1e300) would sleep forever before its first send, with nothing said
MAX_SCALED_SPAN_S = 86_400.0


class ReplayError(Exception):
    """The replay cannot start (bad config, endpoint unreachable)."""


@dataclass
class ReplayConfig:
    url: str
    tokens_per_block: int = 32
    source_block_tokens: int = SOURCE_BLOCK_TOKENS
    concurrency: int | None = None  # fixed number of requests in flight (default 4 if no time_scale)
    time_scale: float | None = None  # send at timestamp_ms / 1000 * time_scale seconds
    api_key: str | None = None
    tenant_keys: dict[str, str] = field(default_factory=dict)  # trace `tenant` -> API key
    prompt_form: str = "tokens"  # or "text"
    max_tokens: int = 16  # cap on each request's (scaled) output length
    model: str | None = None  # default: the first id in GET /v1/models
    tokenizer: str | None = None  # HF tokenizer dir: token range for `tokens`, word list for `text`
    token_range: tuple[int, int] | None = None
    # a request's deadline, from its send to its stream's end: keep-alive comments or a trickle of tokens do not
    # extend it (httpx's own timeout is per read, restarted by every byte)
    timeout_s: float = 300.0
    label: str | None = None  # per-replica key when the server sends no x-kvmesh-replica header
    seed: int = 0  # folded into every block's token draw (0 = the canonical expansion)
    progress: bool = True
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    max_errors: int | None = None  # stop sending after this many failures (the rest count as errors)
    # a logged OpenAI body (`cluster/request_log.py`) is sent greedy: its sampling settings are replaced after
    # the merge (`greedy_body`), so two runs' outputs can be compared (cachetest's correctness check);
    # False sends them as logged. Trace records are always sent at temperature 0 (unless `extra_body` says)
    greedy: bool = True

    def check(self) -> None:
        if self.prompt_form not in ("tokens", "text"):
            raise ReplayError(f"prompt form must be 'tokens' or 'text', got {self.prompt_form!r}")
        if self.prompt_form == "text" and not self.tokenizer:
            raise ReplayError("the text prompt form needs a tokenizer (--tokenizer DIR)")
        if self.tokens_per_block < 1 or self.max_tokens < 1:
            raise ReplayError("tokens per block and max tokens must be >= 1")
        if self.tokens_per_block > MAX_TOKENS_PER_BLOCK:
            raise ReplayError(f"tokens per block must be <= {MAX_TOKENS_PER_BLOCK:,}, got {self.tokens_per_block:,}")
        if not self.timeout_s > 0:
            raise ReplayError(f"the request timeout must be > 0 s, got {self.timeout_s}")
        if self.concurrency is not None and self.time_scale is not None:
            raise ReplayError("give either a concurrency or a time scale, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ReplayError("concurrency must be >= 1")
        if self.time_scale is not None and not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ReplayError(f"time scale must be a finite number >= 0, got {self.time_scale}")
        if self.token_range and not 0 <= self.token_range[0] < self.token_range[1]:
            raise ReplayError("token range must satisfy 0 <= low < high")
        check_url(self.url)


def check_schedule(records: Sequence[dict], cfg: ReplayConfig) -> None:
    """Refuse (ReplayError) a replay at scaled timestamps whose last request would be sent more than
    `MAX_SCALED_SPAN_S` after its first: checked before anything is sent."""
    if cfg.time_scale is None or not records:
        return
    stamps = [r["timestamp"] for r in records]
    span_s = (max(stamps) - min(stamps)) / 1000.0 * cfg.time_scale
    if not span_s <= MAX_SCALED_SPAN_S:
        raise ReplayError(
            f"at time scale {cfg.time_scale:g} the trace's {(max(stamps) - min(stamps)) / 1000.0:,.3f} s would "
            f"take {span_s:.3g} s to send, more than a day ({MAX_SCALED_SPAN_S:,.0f} s): lower the time scale"
        )


def check_url(url: str) -> str:
    """`url` if it is an http(s) base URL requests can be sent to, else ReplayError saying what is wrong.

    Why checked before any request: httpx reports a port out of range as "ExceptionGroup: unhandled errors
    in a TaskGroup", and a trailing newline only at the first request, in a message split over two lines."""
    from urllib.parse import urlsplit

    if not url:
        raise ReplayError("the URL is empty (e.g. http://127.0.0.1:8000)")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ReplayError(f"{shown(url)}: a URL has no whitespace or control characters")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed IPv6 bracket
        raise ReplayError(f"{shown(url)}: not a URL ({exc})") from None
    try:
        port = parts.port
    except ValueError:  # out of range, or not a number
        port = 0
    if port is not None and not 1 <= port <= 65535:
        raise ReplayError(f"{shown(url)}: the port must be a whole number 1-65535")
    if parts.scheme.lower() not in ("http", "https"):
        raise ReplayError(f"{shown(url)}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    if not parts.hostname:
        raise ReplayError(f"{shown(url)}: no host")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ReplayError(f"{shown(url)}: a base URL has no query (?) or fragment (#)")
    return url


@dataclass
class RequestResult:
    index: int
    user: str | None
    tenant: str | None
    prompt_tokens: int  # as the server reported (else as sent)
    cached_tokens: int | None  # None when the server did not report it
    output_tokens: int
    ttft_s: float | None
    latency_s: float
    replica: str
    error: str | None = None
    start_s: float = 0.0  # when it was sent, seconds after the run started
    output_text: str = ""  # the streamed text (greedy outputs of two runs can be compared)
    request_id: str | None = None  # the server's id for it (`x-kvmesh-request-id`), e.g. for /kvmesh/explain


# ------------------------------------------------------------------------------- prompt building
class PromptBuilder:
    """Expands a record's hash ids into a prompt (token ids or text), block by block, deterministically."""

    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.words: list[str] | None = None
        lo_hi = cfg.token_range
        if cfg.tokenizer:
            tok = load_tokenizer(cfg.tokenizer)
            if cfg.prompt_form == "text":
                self.words = one_token_words(tok)
                if len(self.words) < 16:
                    raise ReplayError(f"tokenizer {cfg.tokenizer} has only {len(self.words)} one-token words")
            elif lo_hi is None:
                special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
                first = max([i for i in special if i < 300], default=-1) + 1
                lo_hi = (first, len(tok))
        self.lo, self.hi = lo_hi or DEFAULT_TOKEN_RANGE
        blocks = min(65536, max(64, BLOCK_CACHE_TOKENS // cfg.tokens_per_block))
        self._block = lru_cache(maxsize=blocks)(self._block_uncached)

    def _block_uncached(self, hash_id: int) -> tuple:
        rng = random.Random(hash_id * 1_000_003 + self.cfg.seed)
        n = self.cfg.tokens_per_block
        if self.words is not None:
            return tuple(rng.choice(self.words) for _ in range(n))
        return tuple(rng.randrange(self.lo, self.hi) for _ in range(n))

    def prompt(self, rec: dict) -> list[int] | str:
        lengths = scaled_block_lengths(rec, self.cfg.tokens_per_block, self.cfg.source_block_tokens)
        parts: list = []
        for hid, n in zip(rec["hash_ids"], lengths):
            parts.extend(self._block(hid)[:n])
        if self.words is not None:
            return "".join(" " + w for w in parts)
        return parts

    def prompt_len(self, rec: dict) -> int:
        if "body" in rec:  # a logged OpenAI body: its length as the caller tokenised it, if known
            return int(rec.get("prompt_tokens") or 0)
        return sum(scaled_block_lengths(rec, self.cfg.tokens_per_block, self.cfg.source_block_tokens))


def load_tokenizer(path: str):
    """The tokenizer in a local model folder. Checked as a folder first: a missing path would otherwise
    be taken for a Hugging Face hub id and fail with the hub's message, and nothing here loads from a hub."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        why = "not a folder" if Path(path).exists() else "no such folder"
        raise ReplayError(f"tokenizer {path}: {why} (a tokenizer is a local model folder)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"tokenizer {path}: cannot load ({one_line(str(exc))})") from None


def one_token_words(tokenizer) -> list[str]:
    """Letters-only words w for which " w" encodes to exactly one token (sorted, deterministic)."""
    words = set()
    for piece in tokenizer.get_vocab():
        text = tokenizer.convert_tokens_to_string([piece])
        if len(text) > 1 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
            words.add(text[1:])
    return sorted(w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1)


# -------------------------------------------------------------------------------------- client
# What makes an OpenAI request's output depend on chance (or on more than one sampled choice): dropped by
# `greedy_body`. Penalties, logit biases and stops stay: they change the output deterministically.
SAMPLING_KEYS = ("top_p", "top_k", "min_p", "typical_p", "seed", "n", "best_of")


def greedy_body(body: dict) -> dict:
    """`body` decoded greedily: temperature 0, one choice, no sampling settings (`SAMPLING_KEYS`)."""
    out = {k: v for k, v in body.items() if k not in SAMPLING_KEYS}
    out["temperature"] = 0.0
    return out


async def _one_request(
    client, cfg: ReplayConfig, model: str, rec: dict, index: int, builder: PromptBuilder, run_t0: float
) -> RequestResult:
    path = "/v1/completions"
    if "body" in rec:  # a logged OpenAI request (`cluster/request_log.py`): sent as logged, streamed, greedy
        path = rec.get("endpoint") or ("/v1/chat/completions" if "messages" in rec["body"] else path)
        body = {"model": model, "temperature": 0.0, **rec["body"], **cfg.extra_body}
        if cfg.greedy:  # after the merge: the log's own temperature or top_p would otherwise sample
            body = greedy_body(body)
        body.update(stream=True, stream_options={"include_usage": True})
    else:
        body = {
            "model": model,
            "prompt": builder.prompt(rec),
            "max_tokens": replayed_output_length(rec, cfg.tokens_per_block, cfg.max_tokens, cfg.source_block_tokens),
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **cfg.extra_body,
        }
    user, tenant = rec.get("user"), rec.get("tenant")
    # by the tenant's string form, as `--tenant-key TENANT=KEY` names it and `TraceRequest.from_record` keeps it
    # (tenants 1 and "1" are one): a numeric tenant went out under --api-key, or with no key at all
    key = cfg.tenant_keys.get(str(tenant)) if tenant is not None else None
    key = key or cfg.api_key
    hdrs = {}
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    sent = builder.prompt_len(rec)
    t0 = time.perf_counter()
    start = t0 - run_t0
    ttft = None  # at the first chunk carrying output (`_other_output`, or text), not an empty one before it
    first_choice = None  # the first chunk with a choice: TTFT when no chunk carried any text
    usage = None
    replica = cfg.label or "unknown"
    out_chunks = 0
    text: list[str] = []
    request_id = None
    deadline = asyncio.timeout(cfg.timeout_s)  # the whole request, stream included (`ReplayConfig.timeout_s`)
    error: str | None = None  # why the request failed
    try:
        async with deadline, client.stream("POST", cfg.url.rstrip("/") + path, json=body, headers=hdrs) as resp:
            replica = resp.headers.get("x-kvmesh-replica", replica)
            request_id = resp.headers.get("x-kvmesh-request-id") or resp.headers.get("x-request-id")
            if resp.status_code != 200:
                err = (await resp.aread()).decode("utf-8", "replace")
                raise _HttpError(f"HTTP {resp.status_code}: {_error_message(err)}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _HttpError(f"stream error: {_error_message(data)}")
                if chunk.get("choices"):
                    out_chunks += 1
                    choice = chunk["choices"][0]
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    text.append(piece)
                    if first_choice is None:
                        first_choice = time.perf_counter() - t0
                    if ttft is None and (piece or _other_output(choice)):
                        ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
        counts = None if usage is None else usage_counts(usage, sent, out_chunks)
    except (_HttpError, ValueError) as exc:
        error = str(exc)
    except TimeoutError:
        if not deadline.expired():
            raise  # not the deadline's: the caller's safety net reports it
        error = f"timed out after {cfg.timeout_s:g} s"
    except Exception as exc:  # transport errors: timeouts, resets -- counted, never fatal to the run
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        return RequestResult(index, user, tenant, sent, None, 0, ttft, time.perf_counter() - t0, replica, error, start)
    latency = time.perf_counter() - t0
    if ttft is None:  # output that streamed no text (a token that decodes to nothing): its first choice
        ttft = first_choice
    if counts is None:
        return RequestResult(
            index, user, tenant, sent, None, out_chunks, ttft, latency, replica, "no usage in the stream", start
        )
    prompt_tokens, cached, completion_tokens = counts
    return RequestResult(
        index,
        user,
        tenant,
        prompt_tokens,
        cached,
        completion_tokens,
        ttft,
        latency,
        replica,
        None,
        start,
        "".join(text),
        request_id,
    )


class _HttpError(Exception):
    pass


def _token_count(value: object) -> int | None:
    """A token count as a server reports it: a whole number >= 0 (an integral float too), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value >= 0 else None


def usage_counts(usage: object, sent: int, out_chunks: int) -> tuple[int, int | None, int]:
    """(prompt, cached or None, completion) tokens of a stream's `usage`; a count it leaves out is what was sent
    (streamed chunks for the completion). ValueError "malformed usage: ..." for one that is not a count (null,
    "n/a", -1): that request counts as an error, the others go on."""
    if not isinstance(usage, dict):
        raise ValueError(f"malformed usage: {one_line(json.dumps(usage), 120)}")
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        raise ValueError(f"malformed usage: prompt_tokens_details {one_line(json.dumps(details), 80)}")

    def count(name: str, value: object) -> int:
        got = _token_count(value)
        if got is None:
            raise ValueError(f"malformed usage: {name} {one_line(json.dumps(value), 80)}, not a token count")
        return got

    prompt = count("prompt_tokens", usage.get("prompt_tokens", sent))
    cached = (details or {}).get("cached_tokens")
    cached_count = None if cached is None else count("cached_tokens", cached)
    return prompt, cached_count, count("completion_tokens", usage.get("completion_tokens", out_chunks))


def _other_output(choice: dict) -> bool:
    """Whether a streamed choice carries output other than text: a chat delta's reasoning or tool calls. Why
    asked: an OpenAI-compatible server may stream an empty choice (a chat role delta, "" text) before the first
    token, and TTFT taken there measured the connection, not the prefill."""
    delta = choice.get("delta") or {}
    return bool(delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"))


def one_line(text: str, limit: int = 300) -> str:
    """`text` as one line of at most `limit` characters, for a one-line message."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_message(text: str) -> str:
    """An error body's message, one line: a JSON error's `message`, else the text with any HTML head and tags
    dropped (an error page is many lines of markup around one sentence)."""
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message", err) if isinstance(err, dict) else err
        return one_line(str(msg))
    except ValueError:
        return one_line(re.sub(r"<[^>]*>", " ", re.sub(r"(?is)<(head|script|style)\b.*?</\1\s*>", " ", text)))


async def _discover_model(client, cfg: ReplayConfig, headers: dict) -> str:
    hdrs = dict(headers)
    if cfg.api_key or cfg.tenant_keys:
        hdrs["Authorization"] = f"Bearer {cfg.api_key or next(iter(cfg.tenant_keys.values()))}"
    try:
        resp = await client.get(cfg.url.rstrip("/") + "/v1/models", headers=hdrs)
    except Exception as exc:
        raise ReplayError(f"cannot reach {cfg.url}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ReplayError(f"GET {cfg.url}/v1/models: HTTP {resp.status_code}: {_error_message(resp.text)}")
    try:
        listing = resp.json()
    except ValueError:
        listing = None
    models = listing.get("data") if isinstance(listing, dict) else None
    if isinstance(models, list) and not models:
        raise ReplayError(f"{cfg.url} serves no model")
    first = models[0] if isinstance(models, list) else None
    if not (isinstance(first, dict) and isinstance(first.get("id"), str) and first["id"]):
        excerpt = _error_message(resp.text)[:120] or "an empty body"
        raise ReplayError(
            f"GET {cfg.url}/v1/models answered with no OpenAI model list ({excerpt}): is the URL an OpenAI-compatible "
            "server's base? --model NAME skips the look-up"
        )
    return first["id"]


async def replay_async(
    records: Sequence[dict], cfg: ReplayConfig, on_result: Callable[[RequestResult], None] | None = None
) -> ReplayReport:
    """Send every record; return the per-request results and the run's wall time. Cancelled once the sends
    have started (Ctrl-C under `asyncio.run`), it stops the requests in flight and returns the ones answered
    so far, the report marked `interrupted` (its summary `partial`): minutes of answered requests are not lost."""
    import httpx

    cfg.check()
    check_schedule(records, cfg)
    builder = PromptBuilder(cfg)
    concurrency = cfg.concurrency if cfg.time_scale is None else None
    if cfg.time_scale is None and concurrency is None:
        concurrency = 4
    # at the trace's timestamps nothing caps the requests in flight: neither may the pool, or a request would
    # wait for a connection inside its measured TTFT (and time out as a server error)
    pool = None if concurrency is None else concurrency + 4
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=(concurrency or 256) + 4)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s))
    results: list[RequestResult | None] = [None] * len(records)
    bar = _progress(len(records)) if cfg.progress else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = cfg.model or await _discover_model(client, cfg, {})
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        previous_of_user: dict[str, asyncio.Event] = {}
        t0 = time.perf_counter()
        base_ts = min((r["timestamp"] for r in records), default=0)

        failures = 0

        def failed(i: int, rec: dict, error: str) -> RequestResult:
            try:
                sent = builder.prompt_len(rec)
            except (TypeError, ValueError):  # a logged body's own prompt_tokens that is not a count
                sent = 0
            return RequestResult(
                i, rec.get("user"), rec.get("tenant"), sent, None, 0, None, 0.0, cfg.label or "unknown", error
            )

        async def attempt(i: int, rec: dict) -> RequestResult:
            if cfg.max_errors is not None and failures >= cfg.max_errors:  # checked once it may go
                return failed(i, rec, f"not sent: {failures} errors before it")
            try:
                return await _one_request(client, cfg, model, rec, i, builder, t0)
            except Exception as exc:  # whatever one answer did, it is that request's error, never the run's end
                return failed(i, rec, f"{type(exc).__name__}: {one_line(str(exc))}")

        async def send(i: int, rec: dict, after: asyncio.Event | None, done: asyncio.Event) -> None:
            nonlocal failures
            try:
                if cfg.time_scale is not None:
                    delay = (rec["timestamp"] - base_ts) / 1000.0 * cfg.time_scale - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                if after is not None:
                    await after.wait()
                if gate is not None:
                    async with gate:
                        res = await attempt(i, rec)
                else:
                    res = await attempt(i, rec)
                if res.error is not None:
                    failures += 1
                results[i] = res
                if bar is not None:
                    bar.update(1)
                if on_result is not None:
                    on_result(res)
            finally:
                done.set()

        tasks = []
        for i, rec in enumerate(records):
            done = asyncio.Event()
            user = rec.get("user")
            after = previous_of_user.get(user) if user is not None else None
            if user is not None:
                previous_of_user[user] = done
            tasks.append(asyncio.create_task(send(i, rec, after, done)))
        interrupted = False
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C (`asyncio.run` cancels this task): keep what was answered
            interrupted = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if (me := asyncio.current_task()) is not None:
                me.uncancel()  # handled here: the report of the answered requests is the result
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return ReplayReport(
        [r for r in results if r is not None], wall, model, cfg.label, concurrency, interrupted, len(records)
    )


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", leave=False, dynamic_ncols=True)


def replay(records: Sequence[dict], cfg: ReplayConfig, keep_partial: bool = False) -> ReplayReport:
    """Blocking wrapper around `replay_async` (own event loop). Ctrl-C raises KeyboardInterrupt, as it did,
    unless `keep_partial`: then the report of the requests answered before it comes back, marked
    `interrupted` (`kvmesh replay` writes it and exits 130)."""
    report = asyncio.run(replay_async(records, cfg))
    if report.interrupted and not keep_partial:
        raise KeyboardInterrupt
    return report


# ------------------------------------------------------------------------------------- results
@dataclass
class ReplayReport:
    results: list[RequestResult]
    wall_s: float
    model: str = ""
    label: str | None = None
    concurrency: int | None = None  # requests in flight it was run with (None: at the trace's timestamps)
    interrupted: bool = False  # stopped (Ctrl-C) before every request was answered: `results` are those that were
    records: int | None = None  # the requests it was asked to send (`results` holds fewer when interrupted)

    def summary(self, replicas: int | Sequence[str] | None = None) -> dict:
        """The JSON the CLI writes. Hit rates count successful requests only; `hit_rate_tokens` is
        Σ cached / Σ prompt tokens, `hit_rate_requests` the mean of per-request ratios; None where
        the server reported no cached-token counts. Throughput is (prompt + output tokens) / wall.

        `replicas`: the fleet that served the run, when the caller knows it (its replica ids, or their
        count). A replica that answered no request then counts with 0 uncached tokens in
        `uncached_max_over_mean` (everything on 1 of 2 replicas is 2.00, not 1.00), and `idle_replicas`
        says how many there were; listed by id, each gets a row of zeros in `per_replica`. Without it
        only the replicas that answered are known, and the figure is over those."""
        ok = [r for r in self.results if r.error is None]
        known = [(r.prompt_tokens, r.cached_tokens) for r in ok if r.cached_tokens is not None]  # (prompt, cached)
        ratios = [c / p for p, c in known if p]  # a request of 0 prompt tokens has no hit rate
        prompt = sum(p for p, _ in known)
        cached = sum(c for _, c in known)
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        per_replica: dict[str, dict] = {}
        for r in ok:
            row = per_replica.setdefault(r.replica, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            row["requests"] += 1
            if r.cached_tokens is not None:  # as the totals: a request without the count says nothing of its hits
                row["prompt_tokens"] += r.prompt_tokens
                row["cached_tokens"] += r.cached_tokens
        for row in per_replica.values():
            row["uncached_prompt_tokens"] = row["prompt_tokens"] - row["cached_tokens"]
            row["hit_rate_tokens"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        errors = [r.error for r in self.results if r.error is not None]
        known_replicas = any(r.replica != (self.label or "unknown") for r in ok)
        idle = None  # replicas of the fleet that answered nothing: known only when the caller gave the fleet
        if replicas is not None and (known_replicas or not ok):
            if isinstance(replicas, int):
                idle = max(0, replicas - len(per_replica))
            else:
                missing = [rid for rid in replicas if rid not in per_replica]
                for rid in missing:
                    per_replica[rid] = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
                    per_replica[rid].update(uncached_prompt_tokens=0, hit_rate_tokens=0.0)
                idle = len(missing)
        uncached = [row["uncached_prompt_tokens"] for row in per_replica.values()]
        if idle and isinstance(replicas, int):
            uncached += [0] * idle
        return {
            "requests": len(self.results),
            "errors": len(errors),
            "error_samples": sorted(set(errors))[:5],
            "hit_rate_tokens": cached / prompt if known and prompt else None,
            "hit_rate_requests": statistics.fmean(ratios) if ratios else None,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": cached if known else None,
            "uncached_prompt_tokens": prompt - cached if known else None,
            "output_tokens": sum(r.output_tokens for r in ok),
            "ttft_p50_s": nearest_rank(ttfts, 0.5) if ttfts else None,
            "ttft_p90_s": nearest_rank(ttfts, 0.9) if ttfts else None,
            "ttft_p99_s": nearest_rank(ttfts, 0.99) if ttfts else None,
            "throughput_tokens_s": (
                sum(r.prompt_tokens + r.output_tokens for r in ok) / self.wall_s if self.wall_s > 0 else None
            ),
            "wall_s": self.wall_s,
            "model": self.model,
            "per_replica_known": known_replicas,
            "uncached_max_over_mean": (
                max(uncached) / statistics.fmean(uncached) if uncached and statistics.fmean(uncached) > 0 else None
            ),
            "per_replica": per_replica,
            **({} if idle is None else {"idle_replicas": idle}),
            # stopped before the end (Ctrl-C): the figures are of the requests answered before it
            **({"partial": True, "records": self.records} if self.interrupted else {}),
        }

    def to_json(self, per_request: bool = False, replicas: int | Sequence[str] | None = None) -> dict:
        out = self.summary(replicas)
        if per_request:
            out["per_request"] = [asdict(r) for r in self.results]
        return out


def format_table(summaries: dict[str, dict]) -> str:
    """Side-by-side table: one column per run (e.g. {"kvmesh": s1, "round_robin": s2})."""

    def fmt(v, kind):
        if v is None:
            return "n/a"
        return {"pct": f"{100 * v:.1f}%", "int": f"{v:,}", "s": f"{1000 * v:.1f} ms", "f": f"{v:.2f}"}[kind]

    rows = [
        ("requests", "requests", "int"),
        ("errors", "errors", "int"),
        ("hit rate (tokens)", "hit_rate_tokens", "pct"),
        ("hit rate (requests)", "hit_rate_requests", "pct"),
        ("prompt tokens", "prompt_tokens", "int"),
        ("uncached prompt tokens", "uncached_prompt_tokens", "int"),
        ("TTFT p50", "ttft_p50_s", "s"),
        ("TTFT p90", "ttft_p90_s", "s"),
        ("throughput tok/s", "throughput_tokens_s", "f"),
        ("uncached max/mean replica", "uncached_max_over_mean", "f"),
    ]
    names = list(summaries)
    width = max(12, *(len(n) for n in names))
    lines = [f"{'':28}" + "".join(f"{n:>{width + 2}}" for n in names)]
    for title, key, kind in rows:
        lines.append(f"{title:28}" + "".join(f"{fmt(summaries[n].get(key), kind):>{width + 2}}" for n in names))
    for n in names:
        s = summaries[n]
        if s.get("per_replica_known"):
            idle = s.get("idle_replicas") or 0
            listed = sum(1 for row in s["per_replica"].values() if row["requests"] == 0)
            more = f"; {idle - listed:,} more replica(s) answered no request" if idle > listed else ""
            lines.append(f"  {n} per replica: {_per_replica_line(s['per_replica'])}{more}")
    return "\n".join(lines)


# Replicas listed one by one in a table; a larger fleet gets a summary instead: listed, a simulated fleet of
# 100,000 replicas (`kvmesh demo --simulate`) is megabytes on one line, of mostly idle replicas.
MAX_LISTED_REPLICAS = 16
BUSIEST_LISTED = 5


def _replica_row(rep: str, row: dict) -> str:
    hit = 100 * row["hit_rate_tokens"]
    return f"{rep}: {row['requests']} req {hit:.0f}% hit {row['uncached_prompt_tokens']:,} uncached"


def _per_replica_line(per_replica: dict[str, dict]) -> str:
    """Every replica of a small fleet; of a large one, min/median/max over all replicas and the busiest few."""
    if len(per_replica) <= MAX_LISTED_REPLICAS:
        return ", ".join(_replica_row(rep, row) for rep, row in sorted(per_replica.items()))
    rows = per_replica.values()

    def spread(key: str, fmt: Callable[[float], str]) -> str:
        values = sorted(row[key] for row in rows)
        return "/".join(fmt(nearest_rank(values, q)) for q in (0.0, 0.5, 1.0))

    busiest = sorted(per_replica.items(), key=lambda item: (-item[1]["requests"], item[0]))[:BUSIEST_LISTED]
    return (
        f"{len(per_replica):,} replicas, min/median/max: requests {spread('requests', lambda v: f'{v:,}')}, "
        f"hit {spread('hit_rate_tokens', lambda v: f'{100 * v:.0f}%')}, "
        f"uncached {spread('uncached_prompt_tokens', lambda v: f'{v:,}')}; busiest: "
        + ", ".join(_replica_row(rep, row) for rep, row in busiest)
    )
