"""Several choices in one request: `n` > 1, or a completion's batch of prompts, served as one generation each.

Why: OpenAI's API lets a request ask for `n` samples of one prompt, and a completion for a list of prompts;
vLLM's server answers both, and clients (evaluation harnesses, best-of-n samplers) send them. vLLM's own engine
serves `n` > 1 as `n` child requests with the parent's prompt (`vllm/v1/engine/parallel_sampling.py`), so
kvmesh does the same one level up: each choice is a request of its own through the ingress's whole path
(the tenant's limits, routing by prefix, migration, metrics), and the answers are merged into one, in
vLLM's shape:
- choice `i * n + j` is prompt `i`'s `j`-th sample (vLLM's `serving_completion` order); with a `seed`, sample
  `j` has `seed + j`, as vLLM's child requests do;
- usage counts each prompt's tokens once (and its cached tokens, from its first sample), and every choice's
  completion tokens;
- a stream interleaves the choices' chunks as they come, each with its index, then one usage chunk (when
  asked for) and one `[DONE]`; an error of any choice ends the whole stream, as on vLLM's server.

The samples of one prompt go to one engine replica, as vLLM keeps a request's `n` samples on one engine: each
carries the same `samples_of` key, and the router ranks the replica the first of them was committed to first
for the others (router.py). There vLLM computes the prompt once, the later samples finding its blocks cached
as soon as they are allocated, even in the same step; on another replica each would compute it again. The
prompts of a batch are placed as separate requests are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.deployments.openai_protocol import OpenAIError, bad, number, sse, usage

MAX_CHOICES = 64  # prompts x n per request: each is a generation of its own (and a request to the tenant's limits)


@dataclass(frozen=True)
class FanOut:
    """A request split into one body per choice, in choice order (prompt by prompt, `n` samples each)."""

    children: list[dict]
    n: int

    def prompt_of(self, choice: int) -> int:
        return choice // self.n

    def first_of_prompt(self, choice: int) -> bool:
        return choice % self.n == 0

    def samples_of(self, parent: str, choice: int) -> str | None:
        """The key choice `choice`'s prompt's samples share in the router (`parent`: the request's own id);
        None when the prompt has one sample (`n` 1: a batch's prompts are placed apart)."""
        return f"{parent}:{self.prompt_of(choice)}" if self.n > 1 else None


class SampleDeliveries:
    """The cached tokens each of a prompt's `n` samples delivered (None: not compared), handed on together once
    all have (`PredictionLedger.deliver_samples`): which sample computes the prompt is the engine's order. When
    the request ends with some samples unanswered (one failed, the client left), `flush` hands on those that
    did, and a sample answering later goes on alone."""

    def __init__(self, n: int, deliver_all: Callable[[dict[str, int | None]], None]):
        self.n = n
        self._got: dict[str, int | None] = {}
        self._deliver_all = deliver_all
        self._flushed = False

    def add(self, request_id: str, cached: int | None) -> None:
        if self._flushed:
            self._deliver_all({request_id: cached})
            return
        self._got[request_id] = cached
        if len(self._got) == self.n:
            self.flush()

    def flush(self) -> None:
        """Hand on what has come (once)."""
        if not self._flushed:
            self._flushed = True
            if self._got:
                self._deliver_all(self._got)


def _batch(body: dict, kind: str) -> list[Any] | None:
    """A completion's prompts when it sends several (strings, or lists of token ids); None for one prompt."""
    p = body.get("prompt")
    if kind != "completion" or not isinstance(p, list) or len(p) < 2:
        return None
    if not all(isinstance(x, (str, list)) for x in p):
        return None  # one prompt of token ids (or a malformed one: the prompt's own check names it)
    if not (all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p)):
        raise bad(
            "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id lists.",
            "prompt",
            "invalid_type",
        )
    return p


def plan(body: dict, kind: str) -> FanOut | None:
    """The request's choices as one body each, or None when it asks for one choice (the common path).

    A 400 (`OpenAIError`) for a bad `n`, a mixed batch, more than `MAX_CHOICES` choices, or running usage in
    every chunk (`continuous_usage_stats`: each choice's count would be its own, not the request's)."""
    n = number(body, "n", 1, MAX_CHOICES, integer=True, default=1)
    prompts = _batch(body, kind)
    if n == 1 and prompts is None:
        return None
    count = n * (len(prompts) if prompts is not None else 1)
    if count > MAX_CHOICES:
        raise bad(f"A request may ask for at most {MAX_CHOICES} choices (prompts x n), got {count}.", "n")
    options = body.get("stream_options")
    if body.get("stream") is True and isinstance(options, dict) and options.get("continuous_usage_stats") is True:
        raise bad(
            "'stream_options.continuous_usage_stats' is not supported with several choices (n > 1 or several prompts).",
            "stream_options.continuous_usage_stats",
            "unsupported_parameter",
        )
    seed = body.get("seed")
    children = []
    for prompt in prompts if prompts is not None else [body.get("prompt")]:
        for j in range(n):
            child = dict(body)
            child["n"] = 1
            if prompts is not None:
                child["prompt"] = prompt
            if isinstance(seed, int) and not isinstance(seed, bool) and n > 1:
                child["seed"] = seed + j
            children.append(child)
    return FanOut(children, n)


def over_concurrency(choices: int, allowed: int) -> OpenAIError:
    """A 400 for more choices than the tenant may run at once: each is a request of its own, so the request
    could never be served whole (a 429 would invite a retry that fails the same way)."""
    return bad(
        f"The request asks for {choices} choices (prompts x n), each a request of its own, and this API key "
        f"may run at most {allowed} requests at once.",
        "n",
        "too_many_choices",
    )


def _usage(fan: FanOut, usages: list[dict | None]) -> dict:
    """The request's usage from its choices': each prompt's tokens (and cached tokens) once, from its first
    sample; every choice's completion tokens."""
    prompt = cached = completion = 0
    for i, u in enumerate(usages):
        if u is None:
            continue
        completion += u.get("completion_tokens", 0)
        if fan.first_of_prompt(i):
            prompt += u.get("prompt_tokens", 0)
            cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage(prompt, completion, cached)


def merge_full(fan: FanOut, answers: list[dict], rid: str, created: int) -> dict:
    """One non-streamed answer from the choices' own (each with one choice), in choice order."""
    merged = dict(answers[0])
    merged["id"] = rid
    merged["created"] = created
    choices = []
    for i, a in enumerate(answers):
        c = dict(a["choices"][0])
        c["index"] = i
        choices.append(c)
    merged["choices"] = choices
    merged["usage"] = _usage(fan, [a.get("usage") for a in answers])
    return merged


def merge_headers(headers: list[Any], prefix: str = "x-kvmesh-") -> dict[str, str]:
    """kvmesh's own response headers over the choices, comma-joined in choice order (a choice without one
    gives an empty item): which replica served each, each one's request id."""
    names: list[str] = []
    for h in headers:
        names += [k for k in h if k.lower().startswith(prefix) and k.lower() not in names]
    return {k: ",".join(h.get(k, "") for h in headers) for k in names}


class StreamMerge:
    """Rewrites the choices' SSE events into one stream: the request's id and stamp, each choice's index, the
    choices' usage chunks (sent when the request asked for usage) and `[DONE]`s held back for one of each at
    the end."""

    def __init__(self, fan: FanOut, rid: str, created: int):
        self.fan = fan
        self.rid = rid
        self.created = created
        self.usages: list[dict | None] = [None] * len(fan.children)
        self._usage_chunk: dict | None = None
        self._pending: list[bytes] = [b"" for _ in fan.children]

    def feed(self, choice: int, piece: bytes) -> tuple[bytes, bool]:
        """The events to send for a piece of choice `choice`'s stream, and whether it carried an error (the
        merged stream then ends). An event cut across pieces waits for its end."""
        data = self._pending[choice] + piece
        *events, self._pending[choice] = data.split(b"\n\n")
        out = []
        for event in events:
            if not event.startswith(b"data: "):
                continue
            payload = event[len(b"data: ") :]
            if payload == b"[DONE]":
                continue
            obj = json.loads(payload)
            if "error" in obj:
                out.append(sse(obj))
                return b"".join(out), True
            if not obj.get("choices") and obj.get("usage") is not None:  # the choice's usage chunk
                self.usages[choice] = obj["usage"]
                self._usage_chunk = obj
                continue
            obj["id"] = self.rid
            obj["created"] = self.created
            for c in obj.get("choices", []):
                c["index"] = choice
            out.append(sse(obj))
        return b"".join(out), False

    def tail(self) -> bytes:
        """The usage chunk (when the choices sent theirs: the request asked for it) and `[DONE]`."""
        out = b""
        if self._usage_chunk is not None:
            chunk = dict(self._usage_chunk)
            chunk.update(id=self.rid, created=self.created, choices=[], usage=_usage(self.fan, self.usages))
            out += sse(chunk)
        return out + sse("[DONE]")


async def merged_stream(streams: list[AsyncIterator[bytes]], merge: StreamMerge) -> AsyncIterator[bytes]:
    """The choices' streams as one, events in the order they come; every stream is closed however it ends
    (the client gone, an error in one choice)."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[bytes]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait((i, piece))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, piece = await queue.get()
            if piece is None:
                live -= 1
                continue
            out, failed = merge.feed(i, piece)
            if failed:
                yield out + sse("[DONE]")
                return
            if out:
                yield out
        yield merge.tail()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            close: Callable[[], Any] | None = getattr(s, "aclose", None)
            if close is not None:
                await close()
