"""One choice's answer, from the engine's outputs to the client's bytes: a whole JSON body, or its SSE stream.

Why a module of its own: what an answer shows (an echoed prompt, log-probabilities, tool calls parsed out of
its text, the finish reason vLLM's server would give) depends on the request and the engine's outputs alone,
not on how the request reached the engine. The ingress keeps authentication, admission, routing and the engine
call; this keeps the answer's shape, the same for a choice answered alone or as one of several (fan_out.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.deployments import logprobs
from kvmesh.deployments import openai_protocol as proto
from kvmesh.deployments.openai_protocol import OpenAIError
from kvmesh.deployments.tool_calls import AnswerParser

# alternatives shown per token when the request listed its own (`logprob_token_ids`): all of them
ALL_LISTED = 1 << 30
# vLLM's finish reasons for a generation that did not finish: never a client's answer
ENGINE_FAILED = frozenset({"error", "abort"})

log = logging.getLogger("ray.serve.kvmesh")  # Serve routes "ray.serve" logs to the replica log files


class EngineFailedMidStream(RuntimeError):
    """The engine ended a streamed generation with `error` or `abort` (ENGINE_FAILED)."""


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class Chunks(Protocol):
    """The engine's outputs after the first (a `MigratingStream`)."""

    def __anext__(self) -> Any: ...


@dataclass
class ChoiceAnswer:
    """The parts of one choice's answer known once its prompt is tokenised; `finish(completion_tokens,
    cached_tokens)` records the finished request (metrics, the prediction ledger, miss attribution) and returns
    its usage. `answered` turns true when a stream's last bytes are made: nothing is left to cancel."""

    req: proto.GenerationRequest
    ids: list[int]
    oid: str
    created: int
    tokenizer: Decoder
    parser: AnswerParser | None
    finish: Callable[[int, int], dict]
    answered: bool = False

    def logprobs(self, chunk: dict, offset: int = 0) -> dict | None:
        """A choice's `logprobs` for the tokens of `chunk` (a whole answer or a streamed piece of one), in the
        request kind's shape; None when the request asked for none. `offset`: where a completion's text offsets
        go on from."""
        if self.req.top_logprobs is None:
            return None
        rows = chunk.get("logprobs") or [()] * len(chunk["token_ids"])
        build = (
            logprobs.chat_logprobs
            if self.req.kind == "chat"
            else functools.partial(logprobs.completion_logprobs, offset=offset)
        )
        as_ids = self.req.return_tokens_as_token_ids
        # every token the request listed (`logprob_token_ids`) is shown, as vLLM's server shows them
        top = ALL_LISTED if self.req.logprobs_listed else self.req.top_logprobs
        return build(chunk["token_ids"], rows, top, self._decode_token, as_ids=as_ids)

    def echoed(self, piece: dict) -> dict:
        """An answer's first piece (or the whole answer) as an echoed completion shows it, vLLM's way: the prompt
        (as sent, or its token ids decoded) before the text, its tokens and log-probabilities (the first token's
        empty) before the answer's; with max_tokens 0, the prompt alone. Anything else as it is."""
        req, ids = self.req, self.ids
        if not req.echo:
            return piece
        text, token_ids, rows = piece["text"], piece["token_ids"], piece.get("logprobs")
        if req.echo_only:  # the engine's one token is not shown (it still counts as generated, as on vLLM)
            text, token_ids, rows = "", [], []
        # with `return_token_ids` the prompt goes back as ids only (`prompt_token_ids`), no text, as on vLLM's server
        if req.return_token_ids:
            prompt = ""
        else:
            # the prompt as sent (a truncated one too, as vLLM's server echoes it)
            sent = req.prompt_ids if req.prompt_ids is not None else ids
            prompt = req.prompt_text if req.prompt_text is not None else self.tokenizer.decode(sent)
        shown = {**piece, "text": prompt + text, "token_ids": [*ids, *token_ids]}
        if req.top_logprobs is not None:
            prompt_rows = piece.get("prompt_logprobs") or [()] * len(ids)
            shown["logprobs"] = [*prompt_rows, *(rows or [()] * len(token_ids))]
        return shown

    def _decode_token(self, token_id: int) -> str:
        """One token's text, where the engine gave none (vLLM's server decodes it alone, as here)."""
        return self.tokenizer.decode([token_id])

    def whole(self, out: dict) -> dict:
        """The JSON body of a unary answer from the engine's whole output (`finish` called once)."""
        req = self.req
        u = self.finish(len(out["token_ids"]), out["num_cached_tokens"])
        shown = self.echoed(out)
        content: str | None = shown["text"]
        calls: list[dict] = []
        finish_reason = out["finish_reason"]
        if self.parser is not None:  # the tool calls in it, and the finish_reason they give it
            content, calls = self.parser.whole(out["text"], out["token_ids"])
            finish_reason = self.parser.whole_finish(finish_reason, calls)
        if req.chat_echo is not None:  # a chat's echo: its last assistant message's text, then the answer's
            content = req.chat_echo + (content or "")
        scored = req.params.get("prompt_logprobs") is not None
        return proto.full_response(
            req,
            self.oid,
            content,
            finish_reason,
            u,
            created=self.created,
            stop_reason=out.get("stop_reason"),
            tool_calls=calls,
            logprobs=self.logprobs(shown),
            prompt_logprobs=logprobs.prompt_scores(out.get("prompt_logprobs") or []) if scored else None,
            token_ids=out["token_ids"],
            prompt_token_ids=self.ids,
        )

    async def events(self, first: dict, rest: Chunks, on_error: Callable[[int], None]) -> AsyncGenerator[bytes, None]:
        """The SSE events of a streamed answer: `first` is the engine's first output, `rest` the ones after it.
        An engine that fails mid-answer ends the stream with an error event and `[DONE]`, as vLLM's own server
        does; `on_error(status)` counts it."""
        req = self.req
        parser = self.parser
        # the last chunk, the usage chunk and [DONE] are all at hand together: one write, not three
        # (each body write passes Serve's and Starlette's send wrappers and is a socket write)
        ntok = 0
        cached = first["num_cached_tokens"]
        tail = b""
        offset = 0  # a completion's text offset for its next token's log-probability
        role_first = True  # the first chunk carries the answer's role
        prompt_ids: list[int] | None = self.ids  # and, with `return_token_ids`, the prompt's token ids
        try:
            if req.chat_echo:  # a chat's echo goes out first, as vLLM's server sends it (before any token)
                running = proto.running_usage(req, len(self.ids), 0) if req.continuous_usage else None
                lead = proto.stream_chunk(
                    req,
                    self.oid,
                    req.chat_echo,
                    None,
                    created=self.created,
                    first=True,
                    u=running,
                    prompt_token_ids=prompt_ids,
                )
                yield proto.sse(lead)
                role_first = False
                prompt_ids = None
            is_first = True
            chunk = first
            while True:
                ntok += len(chunk["token_ids"])
                generated = chunk["token_ids"]  # the piece's own tokens, before an echo adds the prompt's
                # with `return_token_ids` a piece goes out for its tokens even where its text is held back, as on
                # vLLM's server
                ids_out = req.return_token_ids and bool(generated)
                if is_first:  # an echoed completion's prompt goes out with its first piece
                    chunk = self.echoed(chunk)
                failed = chunk["finish_reason"] in ENGINE_FAILED  # its text goes out, then the error
                finish_reason = None if failed else chunk["finish_reason"]
                event = b""
                delta = None
                # the piece's log-probabilities: a chunk goes out for its tokens even where its text is held
                # back (a stop string may be forming), as on vLLM's server
                chosen = self.logprobs(chunk, offset) if chunk["token_ids"] else None
                if chosen is not None and req.kind == "completion":
                    offset = logprobs.next_offset(chosen, offset)
                if parser is not None:  # the parser's delta, as vLLM's stream carries it (tool_calls.py)
                    ended = chunk["finish_reason"] is not None
                    delta = parser.delta(chunk["text"], chunk["token_ids"], self.ids, finished=ended)
                    if delta is None and (finish_reason or is_first or chosen is not None or ids_out):
                        delta = {}
                    finish_reason = parser.stream_finish(finish_reason)
                text_out = chunk["text"] or finish_reason or is_first or chosen is not None or ids_out
                if delta is not None or (parser is None and text_out):
                    running = proto.running_usage(req, len(self.ids), ntok) if req.continuous_usage else None
                    event = proto.sse(
                        proto.stream_chunk(
                            req,
                            self.oid,
                            chunk["text"],
                            finish_reason,
                            created=self.created,
                            first=is_first and role_first,
                            u=running,
                            stop_reason=chunk.get("stop_reason"),
                            delta=delta,
                            logprobs=chosen,
                            token_ids=generated,
                            prompt_token_ids=prompt_ids,
                        )
                    )
                    prompt_ids = None
                is_first = False
                if failed:
                    tail = event
                    raise EngineFailedMidStream(chunk["finish_reason"])
                if chunk["finish_reason"] is not None:
                    tail = event
                    break
                if event:
                    yield event
                try:
                    chunk = await rest.__anext__()
                except StopAsyncIteration:
                    break
            u = self.finish(ntok, cached)
            self.answered = True
            if req.include_usage:
                tail += proto.sse(proto.stream_chunk(req, self.oid, None, None, created=self.created, u=u))
            yield tail + proto.sse("[DONE]")
        except Exception as exc:  # a client that went away (CancelledError) is the caller's to handle
            log.exception("engine stream failed mid-response")
            err = exc if isinstance(exc, OpenAIError) else None  # 503: migrations exhausted
            on_error(err.status if err else 500)
            body = err.body() if err else proto.openai_error(500, "engine failed", "internal_error", "server_error")
            # the last chunk, if it came, goes first; [DONE] ends every stream, as on vLLM's own server
            yield tail + proto.sse({"error": body["error"]}) + proto.sse("[DONE]")
