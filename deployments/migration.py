"""Request migration: a request whose engine replica dies is finished by another replica.

Why here, in the ingress: the ingress holds the only copy of what the client has already received.
When a replica dies (its actor is gone, or its engine broke and raised `EngineBroken`):

- before the first token, the request is simply routed again; the router has been told the replica
  is dead, so it never picks it again;
- mid-stream, a continuation is sent: a new engine request whose prompt is the original prompt plus
  the token ids already sent to the client, with `max_tokens`/`min_tokens` reduced by that many and
  the same tenant salt (so its prefix still hits the caches). Greedy decoding therefore yields exactly
  the tokens the dead replica would have produced, unless the request has a frequency or presence
  penalty: vLLM applies those to output tokens only, and the tokens sent are prompt tokens now. Their
  text is detokenized here, by replaying the dead replica's detokenizer (`continuation_text`), not
  taken from the new replica: vLLM primes its detokenizer with the prompt, and a prompt tail with
  incomplete UTF-8 makes it emit held-back prompt text with the first new token; stop strings are
  searched over the whole output, one spanning the move included. The client sees one uninterrupted
  stream;
- a stream decoded under a grammar (structured output) is not continued mid-stream: the new engine
  would start the grammar again after the tokens sent, so it ends with the 503 below instead;
- unary requests are sent again whole (nothing reached the client yet).

A replica Ray calls only unavailable (`ActorUnavailableError`: a gRPC call broken by a network blip as well
as by a replica killed mid-call) is not reported dead but suspect (deployments/replica_watch.py): left out
until it answers a probe, so a healthy one comes back; one that died stays out until Serve drops it.

A call whose replica left the fleet without failing it (a frozen or cut-off node) is abandoned by the
router some seconds later (deployments/replica_loss.py) and moved the same way.

Each move counts in /metrics (`kvmesh_migrations_total`); after `max_migrations` moves the request
fails with an OpenAI-style 503 (`MigrationExhausted`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvmesh.deployments import local_state
from kvmesh.deployments.engine_driver import EngineBroken
from kvmesh.deployments.failure_metrics import FailureCounters
from kvmesh.deployments.openai_protocol import OpenAIError
from kvmesh.deployments.replica_loss import ReplicaGone

log = logging.getLogger("ray.serve.kvmesh")


class MigrationExhausted(OpenAIError):
    """The request lost its replica more often than `max_migrations` allows."""

    def __init__(self, moves: int):
        super().__init__(
            503,
            f"The engine replica serving this request failed and it could not be finished elsewhere "
            f"after {moves} migration(s); retry later.",
            "engine_unavailable",
            err_type="server_error",
        )

    def headers(self) -> dict:
        return {**super().headers(), "Retry-After": "1"}


def replica_unavailable(exc: BaseException) -> bool:
    """Is this Ray's ActorUnavailableError (directly or as the cause)? Ray means "unavailable for now, may
    be available later": Serve raises it for any gRPC UNAVAILABLE or CANCELLED, a network blip included,
    and its own router only probes the replica again. So the request moves, but its replica is only
    suspect (left out until it answers a probe), never reported dead: a dead one is suspect until Serve
    drops it."""
    from ray.exceptions import ActorUnavailableError

    return any(isinstance(e, ActorUnavailableError) for e in (getattr(exc, "cause", None), exc))


def ends_on_stop_token(chunk: dict) -> bool:
    """Is the chunk's last token the stop token (EOS, or one of `stop_token_ids`) that ended the request?
    vLLM then leaves its text out of the output. A stop string's `stop_reason` is the string; a stop
    token's is its id, EOS's None; a chunk without `stop_reason` says nothing."""
    return chunk.get("finish_reason") == "stop" and "stop_reason" in chunk and not isinstance(chunk["stop_reason"], str)


def replica_failure(exc: BaseException) -> tuple[bool, str | None]:
    """(is this the replica dying rather than the request being bad?, the dead replica's id if known)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    cause = getattr(exc, "cause", None)
    # the cause first: Ray's RayTaskError(EngineBroken) is an EngineBroken too, but its args are Ray's own
    if isinstance(exc, ReplicaGone):
        return True, None
    for e in (cause, exc):
        if isinstance(e, EngineBroken):
            return True, e.args[1] if len(e.args) > 1 else None
        if isinstance(e, (RayActorError, ReplicaUnavailableError)):
            return True, None
    return False, None


def continuation_id(request_id: str, move: int) -> str:
    """The engine request id of a request's continuation after its `move`-th move (its own prediction)."""
    return f"{request_id}-m{move}"


def origin_id(request_id: str) -> str:
    """The id of the request a continuation id (`continuation_id`) finishes; any other id is its own.
    Why: peers hear a continuation as a placement of its own, but for its tenant it is the same request
    (admitted and charged once), however often it moves."""
    head, sep, move = request_id.rpartition("-m")
    return head if sep and head and move.isdigit() and move.isascii() else request_id


def continuation(request: dict, sent_token_ids: list[int], move: int, engine_stops: bool = True) -> dict:
    """The engine request that finishes `request` after `sent_token_ids` were sent to the client.

    With nothing sent yet it is the request itself, under the same id (so the router's prediction for
    its new placement is the one checked against what the engine reports); a continuation gets an id
    of its own. Without `engine_stops` it carries no stop strings: the caller searches the whole output
    for them itself (`ContinuationText`). The new engine's own text cannot be searched: primed with the
    prompt plus the tokens sent, its detokenizer may emit held-back text of that prompt with its first
    new token, and a stop string found there (one in the prompt, say) would end the request at once."""
    if not sent_token_ids:
        return request
    params = dict(request.get("params") or {})
    if not engine_stops:
        params.pop("stop", None)
    n = len(sent_token_ids)
    params["max_tokens"] = max(1, int(params.get("max_tokens") or 16) - n)  # 16: vLLM's default
    if params.get("min_tokens"):
        params["min_tokens"] = max(0, int(params["min_tokens"]) - n)
    return {
        **request,
        "request_id": continuation_id(request["request_id"], move),
        "prompt_token_ids": list(request["prompt_token_ids"]) + list(sent_token_ids),
        "params": params,
    }


class MigratingStream:
    """The engine chunks of one streamed request, across as many replicas as it takes.

    `open(engine_request)` starts a stream on the engine deployment (Serve's router places it);
    `replica_failed(replica_id)` tells the routers in this process that a replica is dead;
    `replica_unavailable(replica_id)` that one is unreachable for now (suspect until it answers a probe);
    `first_token(request_id)` tells them a continuation has started (its prefill is done);
    `text_for(request, sent_token_ids, delivered_chars)` gives the detokenizer of a continuation's new
    tokens (`.take(token_ids, finished, stop_token) -> (text, tokens kept)`, `.stopped`: the stop string
    the text ended at), as the dead replica's would have been, or None to keep the engine's text. With a
    detokenizer the continuation is sent without stop strings (that detokenizer finds them); with None the
    engine keeps them.
    """

    def __init__(
        self,
        request: dict,
        open: Callable[[dict], Any],
        *,
        max_migrations: int,
        counters: FailureCounters,
        replica_failed: Callable[[str], None],
        first_token: Callable[[str], None],
        text_for: Callable[[dict, list[int], int], Any],
        replica_unavailable: Callable[[str], None] | None = None,
    ):
        self.request = request
        self._open = open
        self.max_migrations = max_migrations
        self.counters = counters
        self._replica_failed = replica_failed
        self._replica_unavailable = replica_unavailable or (lambda replica_id: None)
        self._first_token = first_token
        self._text_for = text_for
        self.sent: list[int] = []  # token ids already handed to the client
        self.delivered_chars = 0  # and the characters of text
        self._ended = False  # a continuation's text reached a stop string: the stream ends there
        self._text: Any = None  # a continuation's detokenizer (None: the engine's text is the text)
        self.moves = 0
        self.replica: str | None = None  # the replica streaming now (from its chunks)
        self._gone = False  # the router abandoned the current call (its replica left the fleet)
        self._watched = False  # the current call is in OPEN_CALLS
        self._waiting: asyncio.Task | None = None  # the task awaiting the current call's next chunk, if any
        self._current = request
        self._stream: Any = None
        self._on_gone: Callable[[], None] = lambda: None
        self._open_current()
        self._started = False  # the current engine request produced a chunk

    def _open_current(self) -> None:
        """Open the current engine request; it is watched for the router abandoning it (replica_loss.py)
        from its first wait for a chunk, on the loop that waits."""
        self._gone = False
        self._watched = False
        self._stream = self._open(self._current)
        stream = self._stream
        self._on_gone = lambda: self._abandoned(stream)  # this call's: a late word for an earlier one is ignored

    def _abandoned(self, stream: Any) -> None:
        if stream is not self._stream or not self._watched:
            return
        self._gone = True
        self._stream.cancel()
        if self._waiting is not None:  # waiting for a chunk that will not come: stop waiting now
            self._waiting.cancel()

    def _close_current(self) -> None:
        if self._watched:
            local_state.OPEN_CALLS.unwatch(self._current["request_id"], self._on_gone)
            self._watched = False

    def __aiter__(self) -> MigratingStream:
        return self

    async def __anext__(self) -> dict:
        while True:
            if self._ended:
                self._close_current()
                raise StopAsyncIteration
            if self._gone:  # given up between two waits: its cancelled call to a frozen replica would never answer
                self._move(None, ReplicaGone(f"replica {self.replica or '?'} left the fleet mid-call"))
                continue
            if not self._watched:
                local_state.OPEN_CALLS.watch(
                    self._current["request_id"], self._on_gone, movable=self.moves < self.max_migrations
                )
                self._watched = True
            self._waiting = asyncio.current_task()
            try:
                chunk = await self._stream.__anext__()
            except StopAsyncIteration:
                self._close_current()
                raise
            except asyncio.CancelledError:
                if not self._gone or self._waiting is None or self._waiting.uncancel() > 0:
                    raise  # the client went away (or both): the request ends
                self._move(None, ReplicaGone(f"replica {self.replica or '?'} left the fleet mid-call"))
                continue
            except Exception as exc:
                if self._gone:  # given up by the router: Serve's generator, cancelled, raises RequestCancelledError
                    if self._waiting is not None and self._waiting.uncancel() > 0:
                        raise asyncio.CancelledError from None  # the client went away too: the request ends
                    # not the replica failing: one only suspect is not reported dead (it may resume)
                    self._move(None, ReplicaGone(f"replica {self.replica or '?'} left the fleet mid-call"))
                    continue
                dead, rid = replica_failure(exc)
                if not dead:
                    self._close_current()
                    raise
                if replica_unavailable(exc):  # perhaps only a blip: suspect, not dead
                    self._move(None, exc, unavailable=rid or self.replica)
                else:
                    self._move(rid or self.replica, exc)
                continue
            finally:
                self._waiting = None
            if not self._started:
                self._started = True
                if self._current["request_id"] != self.request["request_id"]:
                    self._first_token(self._current["request_id"])
            self.replica = chunk.get("replica", self.replica)
            if self._text is not None:
                text, kept = self._text.take(
                    chunk["token_ids"], chunk["finish_reason"] is not None, ends_on_stop_token(chunk)
                )
                chunk = {**chunk, "text": text, "token_ids": list(chunk["token_ids"][:kept])}
                if self._text.stopped is not None:  # a stop string, perhaps one spanning the move
                    self._ended = True
                    if chunk["finish_reason"] is None:
                        self._stream.cancel()
                    chunk["finish_reason"] = "stop"
            self.sent.extend(chunk["token_ids"])
            self.delivered_chars += len(chunk["text"])
            if chunk["finish_reason"] is not None:  # the last chunk: nothing more to wait for
                self._close_current()
            return chunk

    def _move(self, dead_replica: str | None, exc: BaseException, unavailable: str | None = None) -> None:
        reason = "mid_stream" if self.sent else "before_first_token"
        if dead_replica:
            self._replica_failed(dead_replica)
        elif unavailable:
            self._replica_unavailable(unavailable)
        self._close_current()
        self._stream.cancel()
        # a grammar cannot be resumed after the tokens sent: such a stream ends here
        grammar_cut = bool(self.sent) and bool((self.request.get("params") or {}).get("structured_outputs"))
        if self.moves >= self.max_migrations or grammar_cut:
            self.counters.gave_up()
            log.warning(
                "request %s: replica failed %s",
                self.request["request_id"],
                "mid-stream under a grammar (not continued)"
                if grammar_cut
                else f"and max_migrations={self.max_migrations} reached",
            )
            raise MigrationExhausted(self.moves) from exc
        self.moves += 1
        self.counters.migrated(reason)
        log.warning(
            "request %s: replica %s failed (%s) %s; migrating (move %d, %d tokens already delivered)",
            self.request["request_id"],
            dead_replica or unavailable or "?",
            type(exc).__name__,
            reason.replace("_", " "),
            self.moves,
            len(self.sent),
        )
        self._text = self._text_for(self.request, list(self.sent), self.delivered_chars) if self.sent else None
        # stop strings are the ingress's to find when it replays the text, the engine's only when it cannot
        self._current = continuation(self.request, self.sent, self.moves, engine_stops=self._text is None)
        self._started = False
        self.replica = None
        self._open_current()

    def cancel(self) -> None:
        self._close_current()
        self._stream.cancel()


async def call_migrating(
    request: dict,
    call: Callable[[dict], Any],
    *,
    max_migrations: int,
    counters: FailureCounters,
    replica_failed: Callable[[str], None],
) -> dict:
    """A unary engine call, sent again whole to another replica when its replica dies (or leaves the fleet
    with the call still open: the router abandons it, replica_loss.py). The answer says how often it moved
    (`migrations`): its replica's cache was not what the router predicted for it."""
    moves = 0
    current = request
    task = asyncio.current_task()
    while True:
        gone = active = False

        def abandoned() -> None:
            nonlocal gone
            if active and task is not None:
                gone = True
                task.cancel()

        active = True
        local_state.OPEN_CALLS.watch(current["request_id"], abandoned, movable=moves < max_migrations)
        try:
            try:
                answer = await call(current)
            except asyncio.CancelledError:
                if not gone or task is None or task.uncancel() > 0:
                    raise  # the client went away (or both): the request ends
                raise ReplicaGone(f"request {current['request_id']}: its replica left the fleet mid-call") from None
            except Exception:
                if not gone:
                    raise
                # given up by the router, and the call's response cancelled too: Serve's DeploymentResponse then
                # raises RequestCancelledError. Not the replica failing: moved, its replica not reported dead
                if task is not None and task.uncancel() > 0:
                    raise asyncio.CancelledError from None  # the client went away too: the request ends
                raise ReplicaGone(f"request {current['request_id']}: its replica left the fleet mid-call") from None
            finally:
                active = False
                local_state.OPEN_CALLS.unwatch(current["request_id"], abandoned)
            if moves and isinstance(answer, dict):
                answer["migrations"] = moves
            return answer
        except Exception as exc:
            dead, rid = replica_failure(exc)
            if not dead:
                raise
            if rid:
                replica_failed(rid)
            if moves >= max_migrations:
                counters.gave_up()
                raise MigrationExhausted(moves) from exc
            moves += 1
            counters.migrated("unary")
            log.warning(
                "request %s: replica %s failed (%s); sent again (move %d)",
                request["request_id"],
                rid or "?",
                type(exc).__name__,
                moves,
            )
            current = continuation(request, [], moves)
