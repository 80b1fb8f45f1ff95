"""The OpenAI-compatible ingress: authenticate -> validate -> tokenize -> route -> stream back.

Tokenizing here (with the model's own tokenizer and chat template, the files the engine loads) is
what lets the router hash the exact token ids the engine will cache. The tenant's salt comes from the
API key (deployments/tenants.py), never from the client. Each response names the replica that served
it (`x-kvmesh-replica`) and reports `usage.prompt_tokens_details.cached_tokens` from the engine; the
router's prediction for the same request is checked against it (deployments/prediction.py).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
POST /tokenize and /detokenize (vLLM's), GET /health, GET /metrics (Prometheus text), GET /kvmesh/state and
POST /kvmesh/index/lookup (operator/debug views of the router's index), GET /kvmesh/explain/{request_id} (why
a request's tokens missed) and POST /kvmesh/reset_prefix_cache (every engine's prefix cache, when the config
allows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

# by module, like local_state: Serve ships this class by value, a bare global would be a private copy
from kvmesh.cluster.request_log import (
    adds_special_tokens,
    chat_template_of,
    content_text,
    template_messages,
    template_refusal,
)
from kvmesh.cluster.thread_names import name_loop_thread
from kvmesh.deployments import fan_out, fleet_metrics, local_state, miss_attribution
from kvmesh.deployments import openai_protocol as proto
from kvmesh.deployments.admission import AdmissionError, Reservation
from kvmesh.deployments.choice_answer import ENGINE_FAILED, ChoiceAnswer
from kvmesh.deployments.config import app_config, resolve_model
from kvmesh.deployments.continuation_text import ContinuationText, rust_tokenizer
from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text
from kvmesh.deployments.migration import MigratingStream, call_migrating, continuation_id
from kvmesh.deployments.openai_protocol import OpenAIError, truncated
from kvmesh.deployments.ray_private import context_with_own_request_id
from kvmesh.deployments.router import (
    active_routers,
    notify_cache_reset,
    notify_first_token,
    notify_replica_failed,
    notify_replica_unavailable,
    notify_request_ended,
)
from kvmesh.deployments.serving_metrics import ServingMetrics
from kvmesh.deployments.structured_outputs import constrain
from kvmesh.deployments.tenant_usage import WINDOW_S
from kvmesh.deployments.tenants import (
    AuthError,
    KvmeshHTTPError,
    Tenant,
    TenantRegistry,
    derive_salt,
    reject_client_salt,
)
from kvmesh.deployments.tool_calls import AnswerParser

MAX_LOOKUP_HASHES = 10_000  # about 30 ms of the router's loop at 4 replicas
# a text prompt longer than this is tokenised in a thread: at this length about 9 ms of the loop with the tiny
# model's tokenizer on this 2-core machine, against about 0.14 ms for the hand-off; most prompts are far shorter
# and stay on the loop
LONG_PROMPT_CHARS = 32_768
# A request body is read whole before it is parsed: at most this many bytes per token of context (a token id
# in JSON takes at most 8, text about 4), and never less than MIN_BODY_BYTES; more is a 413 before parsing.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 30.0  # a body that has not arrived whole by then is a 408: its connection is not held for good
TOKENIZE_THREADS = 2  # prompts long enough for a thread: their own pool, so /health and /metrics never wait on them

log = logging.getLogger("ray.serve.kvmesh")  # Serve routes "ray.serve" logs to the replica log files


class _PeerTenantUsage:
    """What the other ingress replicas placed per tenant, as this process's router hears it
    (`PeerPlacements.tenants`, a `tenant_usage.PeerTenantUsage`); nothing before the router exists."""

    window_s = WINDOW_S

    def __init__(self) -> None:
        self._windows: dict[str, float] = {}  # tenant -> how long admission needs its peers' placements kept

    def keep(self, tenant: str, window_s: float) -> None:
        """Admission's window for `tenant` (its slowest bucket's refill): passed on to the router's log now and
        again at each read, since the router may be made after the tenant's first request."""
        self._windows[tenant] = max(window_s, self._windows.get(tenant, 0.0))
        routers = active_routers()
        if routers:
            routers[0].peers.tenants.keep(tenant, self._windows[tenant])

    def active(self, tenant: str) -> int:
        routers = active_routers()
        return routers[0].peers.tenants.active(tenant) if routers else 0

    def since(self, tenant: str, cursor: int) -> tuple[int, list[tuple[float, int]]]:
        routers = active_routers()
        if not routers:
            return cursor, []
        log = routers[0].peers.tenants
        if tenant in self._windows:
            log.keep(tenant, self._windows[tenant])
        return log.since(tenant, cursor)


fastapi_app = FastAPI(title="kvmesh", description="prefix-cache-aware OpenAI-compatible serving")


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes.", "request_too_large")


def _error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, (OpenAIError, KvmeshHTTPError)):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
    return JSONResponse(
        proto.openai_error(500, "Internal server error.", "internal_error", "server_error"), status_code=500
    )


@fastapi_app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    """What no handler answered is still an OpenAI-style 500 (Starlette's own is plain text); logged."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(exc)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_exc(request: Request, exc: StarletteHTTPException):
    msg = {
        404: f"Unknown path {request.url.path}.",
        405: f"Method {request.method} not allowed on {request.url.path}.",
    }.get(exc.status_code, str(exc.detail))
    return JSONResponse(
        proto.openai_error(exc.status_code, msg, "not_found" if exc.status_code == 404 else "invalid_request"),
        status_code=exc.status_code,
    )


def build_registry(cfg: dict) -> TenantRegistry | None:
    """API keys -> tenants. The ONE place the ingress learns identities (swap here for another source)."""
    if cfg.get("tenants_file"):
        return TenantRegistry.from_file(cfg["tenants_file"])
    keys = cfg.get("api_keys") or []
    return TenantRegistry.one_tenant(keys) if keys else None


def _engine_error(exc: BaseException) -> OpenAIError | None:
    """Engine-side request errors that are the client's fault (vLLM raises ValueError subclasses, and its
    own client errors, `VLLMClientError`: a 400 naming its parameter, a 404 for what does not exist), and the
    503 of a request whose replica kept dying (deployments/migration.py)."""
    if isinstance(exc, OpenAIError):
        return exc
    client = _vllm_client_error(exc)
    if not isinstance(exc, ValueError) and client is None:
        return None
    text = str(exc).strip().splitlines()
    message = _EXC_PREFIX.sub("", text[-1])[:500] if text else "Invalid request."  # Ray's text names the class
    if client == "not_found":
        return OpenAIError(404, message, "not_found")
    param = getattr(exc, "parameter", None)
    return proto.bad(message, param if isinstance(param, str) else None, code="invalid_request")


def _id_shown(token_id: int) -> str:
    """A token id for a message: a huge one (JSON allows thousands of digits) cut."""
    digits = str(token_id)
    return digits if len(digits) <= 40 else f"{digits[:20]}... ({len(digits):,} digits)"


def load_tokenizer(model_path: str):
    """The model's tokenizer as vLLM loads a generating model's: truncating on the left
    (`truncate_prompt_tokens` keeps a prompt's last tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, truncation_side="left")


def model_vocab_size(model_path: str) -> int:
    """The model's vocabulary size from its config.json (`vocab_size`, or its text model's), 0 if none is
    given: vLLM takes token ids below it, which may be more than the tokenizer has (padded embeddings)."""
    import json

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(cfg, dict):
        return 0
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def model_default_max_tokens(model_path: str) -> int | None:
    """The output length the model's generation config sets (`max_new_tokens` of its generation_config.json,
    else of its config.json), None if none: what vLLM's server gives a request that names no max_tokens (its
    get_max_tokens falls back to the model's sampling defaults), and so what the ingress gives one."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the one the model's config implies, as vLLM reads it
        try:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))
        except (OSError, ValueError):
            return None
    except ValueError as exc:  # a generation config transformers refuses: vLLM's engine would fail on it too
        log.warning("cannot read %s's generation config (%s): no default output length", model_path, exc)
        return None
    value = config.to_diff_dict().get("max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_EXC_PREFIX = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception): ")


def _vllm_client_error(exc: BaseException) -> str | None:
    """Which of vLLM's errors caused by the request `exc` (or what Ray wrapped) is: "not_found", "invalid", or
    None for any other error. Only if vLLM's exceptions module is loaded already: such an error cannot exist
    otherwise, and importing vLLM here would stall the ingress's event loop (1.5 s)."""
    module = sys.modules.get("vllm.exceptions")
    if module is None:
        return None
    for e in (exc, getattr(exc, "cause", None)):
        if isinstance(e, module.VLLMNotFoundError):
            return "not_found"
        if isinstance(e, module.VLLMClientError):
            return "invalid"
    return None


# Per-tier LMCache figures (kvstore/tier_metrics.py); defined before the class, which Serve ships by value.
def _tier_status(timeout_s: float = 5.0) -> dict:
    try:
        from kvmesh.kvstore.node_server import tier_status

        return tier_status(timeout_s)
    except Exception:
        log.exception("LMCache tier status failed")
        return {}


def _tier_metrics_text() -> str:
    """Per-tier Prometheus lines from every node's LMCache server ("" when no node runs one)."""
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    status = _tier_status()
    return tier_metrics_text(status) if status else ""


def _tier_report() -> dict | None:
    """Hits by tier, bytes moved and tier health summed over nodes (None without LMCache). For /kvmesh/state,
    which operators and tests poll: node servers are waited on 3 s at most (their status takes well under a
    second, 1.3 s seen on a loaded 2-core machine), and one on a frozen node, still owing an earlier answer,
    not at all (`node_server.tier_status`)."""
    from kvmesh.kvstore.tier_metrics import tier_report

    status = _tier_status(timeout_s=3.0)
    return tier_report(status) if status else None


def _unary_ttft(t0: float, t_call: float, t_answer: float, answer: dict) -> float:
    """A unary request's time to first token, as a stream's is measured: from the handler's start to the
    first output coming back (routing, Serve's queues, holds and failed replicas included), i.e. the whole
    wait less what the engine spent after its first output. An engine that does not report that time:
    the time before the call plus the engine's own time to its first output."""
    after_first = answer.get("after_first_output_s")
    if after_first is None:
        return (t_call - t0) + (answer.get("ttft_s") or 0.0)
    return max(0.0, (t_answer - t0) - after_first)


class _ClosingStream(StreamingResponse):
    """A streamed answer that runs `on_close` however it ends. The body generator's own `finally` runs only
    once the body has started; Serve cancels a request whose client went away at any point, sending the
    response headers included, and the tenant's admission slot must come back then too."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.chunks = content  # the body, for an answer merged into another (`Ingress._fan_out`)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    def close(self) -> None:
        """Run `on_close` for an answer that is not sent itself (a choice of several: `Ingress._fan_out`)."""
        self._on_close()


def _flush_all(deliveries: Iterable[fan_out.SampleDeliveries]) -> None:
    """Hand the samples' deliveries that came on to the prediction ledger: the request ended before every
    sample answered (`SampleDeliveries.flush`)."""
    for d in deliveries:
        d.flush()


def _close_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel the choices still being prepared and close the streams of those already answering."""
    for t in tasks:
        if not t.done():
            t.cancel()
        elif not t.cancelled() and t.exception() is None and isinstance(t.result(), _ClosingStream):
            t.result().close()


@serve.deployment(name="Ingress")
@serve.ingress(fastapi_app)
class Ingress:
    def __init__(self, engine_handle, config: dict):
        from kvmesh.deployments.loopback_serve import bind_replica_grpc_to_loopback
        from kvmesh.deployments.ray_private import serve_uses_grpc_by_default

        bind_replica_grpc_to_loopback()  # before Serve starts this replica's gRPC server
        self.cfg = app_config(config)
        # Serve fixes a handle's transport where the handle was made: in the process that built the app,
        # which may have imported Serve before SERVE_PATH_ENV reached its environment. What Serve resolved
        # in this replica decides instead: its gRPC channel, or Ray actor calls (by reference).
        self.engine_transport = "grpc" if serve_uses_grpc_by_default() else "actor"
        self.engine = engine_handle.options(_by_reference=self.engine_transport == "actor")
        self.model_path = resolve_model(self.cfg["engine"]["model"])
        self.tokenizer = load_tokenizer(self.model_path)
        # the ids the engine takes: its model's embedding rows, which may outnumber the tokenizer's entries
        self.vocab_size = max(len(self.tokenizer), model_vocab_size(self.model_path))
        self.max_model_len = self.cfg["engine"]["max_model_len"]
        self.default_max_tokens = model_default_max_tokens(self.model_path)
        self.served_model = self.cfg["served_model_name"] or (
            "tiny" if self.cfg["engine"]["model"] == "tiny" else Path(self.model_path).name
        )
        self.model_aliases = {self.served_model, self.cfg["engine"]["model"], self.model_path}
        # vLLM's tool-call parser for the served model: chats with tools and a tool_choice other than "none" are
        # served
        self.tool_parsing = None
        if self.cfg["tool_call_parser"]:
            from kvmesh.deployments.tool_calls import ToolCallParsing

            self.tool_parsing = ToolCallParsing(self.cfg["tool_call_parser"], self.tokenizer, self.served_model)
        self.registry = build_registry(self.cfg)
        if self.registry is None:
            log.warning("no API keys configured: the ingress is OPEN (every request is tenant 'anonymous')")
            from kvmesh.deployments.tenants import resolve_secret

            self._anonymous = Tenant("anonymous", None, derive_salt(resolve_secret(), "anonymous"), operator=True)
        from kvmesh.deployments.admission import Admission
        from kvmesh.deployments.deploy_plan import admission_ceiling_problem
        from kvmesh.deployments.tenant_metrics import TenantMetrics

        self.admission = Admission.from_registry(self.registry) if self.registry else Admission()
        self.admission.peers = _PeerTenantUsage()  # tenant limits across the ingress replicas (admission.py)
        # the tenants file is a Secret on Kubernetes, which `kvmesh k8s render` does not read: checked here
        ceiling = admission_ceiling_problem(self.cfg, self.registry.admission_config if self.registry else None)
        if ceiling:
            log.warning(ceiling)
        self.serving_metrics = ServingMetrics()  # not `metrics`: that name is the /metrics route
        local_state.SERVING_METRICS.add(self.serving_metrics)
        self.tenant_metrics = TenantMetrics()
        self.failures = FailureCounters()
        self.metric_pages = fleet_metrics.PageCache()  # each ingress replica's last page, for the merged /metrics
        # Initialise the engine handle now, not at the first request: its router is built as soon as Serve
        # names the engine replicas, so it joins the other ingress replicas' placement stream and subscribes
        # to the engines' KV events before traffic arrives, not seconds into it.
        self.engine.options()

    # ------------------------------------------------------------------ helpers
    def _auth(self, request: Request) -> Tenant:
        if self.registry is None:
            return self._anonymous
        try:
            given = request.headers.getlist("authorization")
            if len(given) > 1:  # a gateway in front checking another copy would disagree on who is calling
                raise AuthError("Several Authorization headers: send one.", "invalid_api_key")
            return self.registry.authenticate(given[0] if given else None)
        except KvmeshHTTPError as exc:
            self.tenant_metrics.record_rejection("unauthenticated", exc.code)
            raise

    def _operator(self, request: Request) -> Tenant:
        """`_auth`, and 403 unless the tenant is an operator: these views span tenants (their request ids,
        sizes and placements, which prefixes any tenant holds)."""
        tenant = self._auth(request)
        if not tenant.operator:
            raise OpenAIError(
                403, "This endpoint is for operators (a tenant with operator: true).", "operator_only", None
            )
        return tenant

    async def _read_body(self, request: Request) -> bytes:
        """The whole body, within `max_body_bytes` (413) and BODY_TIMEOUT_S (408): a client can neither make
        the replica hold megabytes it will refuse anyway nor hold a handler with a body that never ends."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)

        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel (the client gone) that comes
            # as the body completes, and the request would go on to the engine for nobody
            async with asyncio.timeout(BODY_TIMEOUT_S):
                await read()
        except TimeoutError:
            raise OpenAIError(
                408, f"The request body did not arrive within {BODY_TIMEOUT_S:.0f} s.", "request_timeout"
            ) from None
        except ClientDisconnect:  # the client hung up mid-body: nobody to answer, nothing to log as an error
            raise OpenAIError(
                499, "The client closed the connection before its request body arrived.", "client_closed_request"
            ) from None
        return b"".join(chunks)

    @property
    def max_body_bytes(self) -> int:
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * self.max_model_len)

    def _max_prompt_chars(self) -> int:
        """The longest text that can tokenise within the context: no token covers more characters than the
        vocabulary's longest entry (a byte-level entry is one character per byte). Longer text is refused
        before it is tokenised, which takes about a second per megabyte and its memory many times over."""
        cap = getattr(self, "_prompt_chars_cap", None)
        if cap is None:
            try:
                longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
            except Exception:  # a tokenizer without a vocabulary to read: no bound from it
                longest = 1 << 20
            cap = self._prompt_chars_cap = self.max_model_len * max(1, longest)
        return cap

    def _too_long(self, req: proto.GenerationRequest, detail: str) -> OpenAIError:
        """The 400 of a request that cannot fit the model's context, `detail` saying why."""
        message = f"This model's maximum context length is {self.max_model_len} tokens; {detail}."
        return proto.bad(message, req.prompt_param, "context_length_exceeded")

    async def _in_tokenize_thread(self, fn, *args, **kwargs):
        pool = getattr(self, "_tokenize_pool", None)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="kvmesh-tokenize")
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def _check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """Token ids a request names, each in the model's vocabulary, or a 400 naming the first other and
        `param` (vLLM's engine refuses them only after placement, as an error of its own)."""
        wrong = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if wrong is not None:
            message = f"Token id {_id_shown(wrong)} is out of range for this model (vocabulary size {self.vocab_size})."
            raise proto.bad(message, param, "invalid_token_id")

    async def _tokenize(self, req: proto.GenerationRequest) -> list[int]:
        """The prompt's token ids, as vLLM's own server makes them (a completion's text with the model's
        special tokens, a chat's through its template). A long text is encoded off the event loop: megabytes
        of prompt take seconds, and every other request of this replica would wait. Text the tokenizer
        refuses (a lone UTF-16 surrogate, which JSON allows) is the client's error, not a 500."""
        # token ids of the request's settings: the engine refuses them only after placement, as an error of its own
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "logprob_token_ids"):
            self._check_token_ids(req.params.get(name) or (), name)
        keep = self._kept_tokens(req)
        if req.prompt_ids is not None:
            ids = req.prompt_ids if keep is None else truncated(req.prompt_ids, keep, req.truncation_side)
            if len(ids) >= self.max_model_len:  # before looking at each id
                raise self._too_long(req, f"the request's {len(ids)} prompt tokens cannot fit in it")
            self._check_token_ids(ids, "prompt")
            return ids
        cap = self._max_prompt_chars()
        if req.kind == "chat" and req.messages is not None:  # the parser sets messages on every chat request
            chars = sum(len(content_text(m["content"])) for m in req.messages)
            if len(req.messages) >= self.max_model_len or (chars > cap and keep is None):
                detail = f"the request's {len(req.messages)} messages of {chars} characters cannot fit in it"
                raise self._too_long(req, detail)
            # the messages as vLLM's server hands them to this template (its content format, the developer role)
            conversation = template_messages(req.messages, self._chat_template())
            try:
                # the template's settings (`add_generation_prompt` among them) are in its arguments
                text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **req.template_kwargs)
            except Exception as exc:  # the template's raise_exception, a model without one, a variable it fails on
                # a 400, as vLLM's server answers any failure of the template (its safe_apply_chat_template)
                reason = template_refusal(exc)
                raise proto.bad(f"The model's chat template refused this request: {reason}", "messages") from None
        else:
            text = req.prompt_text or ""  # set on every completion request without prompt ids
        if keep is None and len(text) > cap:
            raise self._too_long(req, f"the request's {len(text)} characters of prompt cannot fit in it")
        # as vLLM's server: a prompt cut on a side asked for is cut to the characters the context could hold on
        # that side first, then tokenised whole and sliced; cut on the tokenizer's side (the last tokens kept),
        # the tokenizer truncates it, keeping the special tokens it adds
        kwargs: dict[str, Any] = {"add_special_tokens": adds_special_tokens(req.kind == "chat", req.add_special_tokens)}
        if keep is not None and req.truncation_side is not None:
            text = text[-cap:] if req.truncation_side == "left" else text[:cap]
        elif keep is not None:
            kwargs.update(truncation=True, max_length=keep)
        try:
            if len(text) > LONG_PROMPT_CHARS:
                ids = list(await self._in_tokenize_thread(self.tokenizer.encode, text, **kwargs))
            else:
                ids = list(self.tokenizer.encode(text, **kwargs))
        except (TypeError, ValueError, UnicodeError) as exc:
            message = f"The prompt cannot be tokenized: {exc}"[:300]
            raise proto.bad(message, req.prompt_param, "invalid_prompt") from None
        return ids if keep is None or req.truncation_side is None else truncated(ids, keep, req.truncation_side)

    @staticmethod
    def _priority(req: proto.GenerationRequest, tenant: Tenant) -> int:
        """The request's vLLM `priority` (lower first where the engines schedule by priority): as asked, or its
        tenant's floor (`min_priority`) when it asks none; more urgent than the floor is a 400 naming it, so a
        key cannot put its requests ahead of what its operator allows."""
        floor = tenant.limits.min_priority
        if req.priority is None:
            return floor or 0
        if floor is not None and req.priority < floor:
            raise proto.bad(
                f"'priority' {req.priority} is more urgent than this API key may ask (at least {floor}).", "priority"
            )
        return req.priority

    def _kept_tokens(self, req: proto.GenerationRequest) -> int | None:
        """How many prompt tokens `truncate_prompt_tokens` keeps (None: all), by vLLM's rules: -1 is the context,
        less one token where the request asks for an answer (a completion's `max_tokens`, a chat's if given);
        more than the context, or none at all, is a 400 naming the field."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return None
        if keep > self.max_model_len:
            raise proto.bad(
                f"'truncate_prompt_tokens' ({keep}) cannot be greater than the model's context length "
                f"({self.max_model_len}).",
                "truncate_prompt_tokens",
            )
        if keep == 0:  # nothing left to prompt with
            raise proto.bad("'truncate_prompt_tokens' 0 leaves the prompt empty.", "truncate_prompt_tokens")
        if keep < 0:
            answers = not req.echo_only and bool(req.params.get("max_tokens"))
            keep = self.max_model_len - 1 if answers else self.max_model_len
        return keep

    def _chat_template(self) -> str | None:
        """The tokenizer's chat template (read once: it decides how messages are put for it)."""
        if not hasattr(self, "_template"):
            self._template = chat_template_of(self.tokenizer)
        return self._template

    def _check_model(self, req: proto.GenerationRequest) -> None:
        """Before tokenising: a request for another model is answered without the work; one that names no
        model (left out, null or "") is for the served one, named in its response, as on vLLM's own server."""
        if not req.model:
            req.model = self.served_model
            return
        self._check_model_name(req.model)

    def _check_model_name(self, model: str) -> None:
        """A 404 for a model this deployment does not serve ("" is none named: the served one)."""
        if model and model not in self.model_aliases:
            raise OpenAIError(
                404,
                f"The model {proto.shown(model)} does not exist. Available: {self.served_model}.",
                "model_not_found",
                "model",
            )

    def _answer_parser(self, req: proto.GenerationRequest) -> AnswerParser | None:
        """The request's output as vLLM's server would have it: the parser of a chat's tool calls where it has
        tools and a `tool_choice` other than "none" (`tool_calls.py`; None otherwise), and the grammar its
        answer is decoded under, from its tools or its `response_format` (`structured_outputs.py`). A tool
        choice where the deployment names no parser is a 400, vLLM's own answer without one."""
        if req.kind != "chat" or req.tool_choice == "none":
            constrain(req)
            return None
        if self.tool_parsing is None:
            choice = req.tool_choice if isinstance(req.tool_choice, str) else "a named function"
            message = (
                f"'tool_choice' {choice!r} needs a tool-call parser for the served model: this deployment names "
                "none (config tool_call_parser, `kvmesh serve --tool-call-parser`; vLLM's --tool-call-parser)."
            )
            raise proto.bad(message, "tool_choice")
        return self.tool_parsing.for_request(req)

    def _check_max_tokens(self, req: proto.GenerationRequest) -> None:
        """Before tokenising, as vLLM (its TokenizeParams): an output length beyond the whole context is a 400
        naming the field it came in; one beyond what the prompt leaves is trimmed (`_check_length`)."""
        max_tokens = req.params.get("max_tokens")
        if max_tokens is not None and max_tokens > self.max_model_len:
            name = req.max_tokens_param
            message = (
                f"'{name}' ({max_tokens}) cannot be greater than the model's maximum context length "
                f"({self.max_model_len} tokens). Please request fewer output tokens."
            )
            raise proto.bad(message, name)

    def _check_length(self, req: proto.GenerationRequest, ids: list[int]) -> None:
        """The prompt leaves room in the context for an answer; max_tokens is trimmed to that room, as vLLM's
        `get_max_tokens` does (the least of the client's and the room). A chat without one gets the model's
        generation-config default, or all the room without one (a completion's always has one: 16 by default)."""
        if not ids:
            raise proto.bad("The prompt is empty after tokenization.", req.prompt_param, "empty_prompt")
        if len(ids) >= self.max_model_len:  # vLLM: a prompt over the context, or one with 0 tokens left
            raise self._too_long(req, f"the prompt has {len(ids)}, which leaves no room for an answer")
        room = self.max_model_len - len(ids)
        asked = req.params.get("max_tokens")
        if asked is None:
            asked = getattr(self, "default_max_tokens", None)
        max_tokens = req.params["max_tokens"] = room if asked is None else min(asked, room)
        if req.params.get("min_tokens", 0) > max_tokens:  # against the trimmed value, as vLLM's SamplingParams
            message = f"'min_tokens' ({req.params['min_tokens']}) exceeds max_tokens ({max_tokens})."
            raise proto.bad(message, "min_tokens")

    # ------------------------------------------------------------------ generation
    def _migrating_stream(self, engine_req: dict) -> MigratingStream:
        return MigratingStream(
            engine_req,
            self.engine.options(stream=True).generate.remote,
            max_migrations=self.cfg["max_migrations"],
            counters=self.failures,
            replica_failed=notify_replica_failed,
            first_token=notify_first_token,
            text_for=self._continuation_text,
            replica_unavailable=notify_replica_unavailable,
        )

    def _continuation_text(
        self, request: dict, sent_token_ids: list[int], delivered_chars: int
    ) -> ContinuationText | None:
        """The ingress's detokenizer for a continuation; None (the new replica's text is used) for a model
        without a fast tokenizer, whose engine does not detokenize with DecodeStream either."""
        try:
            backend = rust_tokenizer(self.tokenizer)
        except TypeError:
            return None
        params = request.get("params") or {}
        return ContinuationText(
            backend,
            request["prompt_token_ids"],
            sent_token_ids,
            params.get("skip_special_tokens", True),
            stop=params.get("stop") or (),
            min_tokens=int(params.get("min_tokens") or 0),
            delivered_chars=delivered_chars,
            include_stop=bool(params.get("include_stop_str_in_output")),
        )

    def _record_call_stages(self, t0: float, t_call: float, engine_s: float | None) -> None:
        """Stage timers for a request whose engine call answered: what the ingress did before the call, the
        call itself, and the engine's own share of it (what is left of the call is routing and the hop)."""
        now = time.perf_counter()
        self.serving_metrics.record_stage("pre_call", t_call - t0)  # auth, parse, tokenize, admission
        self.serving_metrics.record_stage("engine_call", now - t_call)
        if engine_s is not None:
            self.serving_metrics.record_stage("engine_first_output", engine_s)

    async def _generate(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        created = int(time.time())  # the answer's stamp, taken once: every chunk of a stream has it (as vLLM's)
        name_loop_thread()
        reservation = None
        tenant: Tenant | None = None
        try:
            tenant = self._auth(request)
            # a tenant throttled whatever its prompt (its request rate or concurrency) is refused before its
            # body is read and parsed: a flood of large bodies must not cost the ingress. As an empty prompt,
            # so a prompt's own size is judged (and its Retry-After given) once it is counted. Its slot and
            # one request token are taken now (a reservation), so requests arriving together count at once
            reservation = self.admission.reserve(tenant)
            body = proto.parse_json(await self._read_body(request))
            reject_client_salt(body, request.headers)
            fan = fan_out.plan(body, kind)
        except (OpenAIError, KvmeshHTTPError) as exc:
            self.admission.cancel(reservation)
            return self._refused(exc, tenant)
        except BaseException:
            self.admission.cancel(reservation)
            raise
        if fan is not None:  # each choice a request of its own, against the tenant's limits too
            self.admission.cancel(reservation)
            return await self._fan_out(tenant, kind, fan, t0, created)
        return await self._generate_one(tenant, kind, body, t0, created, reservation)

    def _refused(self, exc: OpenAIError | KvmeshHTTPError, tenant: Tenant | None) -> Response:
        self.serving_metrics.record_error(exc.status)
        if tenant is not None and isinstance(exc, AdmissionError):  # the tenant's limits or a full server
            self.tenant_metrics.record_rejection(tenant.id, exc.code)
        return _error_response(exc)

    async def _fan_out(self, tenant: Tenant, kind: str, fan: fan_out.FanOut, t0: float, created: int) -> Response:
        """Several choices (`n` > 1, a batch of prompts): one generation each, answered as one (fan_out.py).
        The first choice refused or failed before its answer began cancels the others and is the answer."""
        allowed = tenant.limits.max_concurrent
        if allowed is not None and len(fan.children) > allowed:  # it could never run: each choice is a request
            return self._refused(fan_out.over_concurrency(len(fan.children), allowed), tenant)
        loop = asyncio.get_running_loop()
        parent = uuid.uuid4().hex
        # a prompt's samples' cached tokens go to the prediction ledger together (fan_out.SampleDeliveries)
        deliveries: dict[str, fan_out.SampleDeliveries] = {}
        choices = []
        for i, child in enumerate(fan.children):
            key = fan.samples_of(parent, i)
            sample = None
            if key is not None:
                sample = deliveries.setdefault(
                    key, fan_out.SampleDeliveries(fan.n, lambda got: local_state.LEDGER.deliver_samples(got))
                )
            choices.append(self._generate_one(tenant, kind, child, t0, created, samples_of=key, deliveries=sample))
        # each choice its own request to Serve's router too
        tasks = [loop.create_task(c, context=context_with_own_request_id()) for c in choices]
        failed: Response | None = None
        try:
            pending = set(tasks)
            while pending and failed is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = next((t.result() for t in tasks if t in done and t.result().status_code != 200), None)
        except BaseException:  # the client went away: every choice goes with it
            _close_all(tasks)
            _flush_all(deliveries.values())
            raise
        if failed is not None:
            _close_all(tasks)
            await asyncio.gather(*tasks, return_exceptions=True)
            _flush_all(deliveries.values())
            return failed
        answers = [t.result() for t in tasks]
        headers = fan_out.merge_headers([a.headers for a in answers])
        oid = proto.new_id(kind)
        if not isinstance(answers[0], _ClosingStream):
            merged = fan_out.merge_full(fan, [json.loads(bytes(a.body)) for a in answers], oid, created)
            return JSONResponse(merged, headers=headers)
        streams = [a for a in answers if isinstance(a, _ClosingStream)]
        assert len(streams) == len(answers)  # a streamed request's choices all stream
        merge = fan_out.StreamMerge(fan, oid, created)

        def close() -> None:
            for a in streams:
                a.close()
            _flush_all(deliveries.values())  # the samples that answered, should the stream have ended early

        return _ClosingStream(
            fan_out.merged_stream([a.chunks for a in streams], merge),
            close,
            media_type="text/event-stream",
            headers=headers,
        )

    async def _generate_one(
        self,
        tenant: Tenant,
        kind: str,
        body: dict,
        t0: float,
        created: int,
        reservation: Reservation | None = None,
        samples_of: str | None = None,
        deliveries: fan_out.SampleDeliveries | None = None,
    ) -> Response:
        """One choice: parse, the tenant's limits, tokenise, then the engine call and its answer. `samples_of`:
        the key the router keeps a prompt's samples together by (`n` > 1), None for a choice alone; `deliveries`:
        where their cached tokens go for the prediction ledger, all samples together."""
        answer: AnswerParser | None = None
        try:
            if reservation is None:  # a choice of several: its own slot and request token
                reservation = self.admission.reserve(tenant)
            req = proto.parse_request(body, kind)
            self._check_model(req)
            self._check_max_tokens(req)
            priority = self._priority(req, tenant)
            # the tenant's limits first, charging nothing: a throttled tenant's requests must not hold the
            # tokenizer every tenant shares. Token ids count as given; text is at least 1 token (empty: a 400)
            given = req.prompt_ids
            count = len(given) if given is not None else 1
            self.admission.precheck(tenant, count, exact=given is not None, reservation=reservation)
            answer = self._answer_parser(req)
            t_tok = time.perf_counter()
            ids = await self._tokenize(req)
            self.serving_metrics.record_stage("tokenize", time.perf_counter() - t_tok)
            self._check_length(req, ids)
            t_queue = time.perf_counter()
            ticket = await self.admission.acquire(tenant, len(ids), reservation=reservation)
            queue_wait_s = time.perf_counter() - t_queue  # in admission's fair queue (0 when a slot was free)
        except (OpenAIError, KvmeshHTTPError) as exc:
            return self._refused(exc, tenant)
        finally:  # a bad body, a tokenizer error, the client gone: the reservation comes back (acquire settled it)
            self.admission.cancel(reservation)
        request_id = uuid.uuid4().hex
        engine_req: dict[str, Any] = {
            "request_id": request_id,
            "prompt_token_ids": ids,
            "cache_salt": tenant.salt,
            "tenant": tenant.id,
            "params": req.params,
        }
        if tenant.id in self.cfg["tenant_policies"]:
            engine_req["policy"] = self.cfg["tenant_policies"][tenant.id]
        if samples_of is not None:
            engine_req["samples_of"] = samples_of
        if priority:
            engine_req["priority"] = priority
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                self.admission.release(ticket)
                notify_request_ended(request_id)  # the router ends a placement Serve never reports complete

        t_call = time.perf_counter()
        sent = time.monotonic()  # ServingMetrics' clock: a replica forgotten after this gets no row for it
        stream: MigratingStream | None = None
        try:
            if req.stream:  # survives replica deaths: routed again, or continued elsewhere mid-stream
                stream = self._migrating_stream(engine_req)
                first = await stream.__anext__()
                ttft = time.perf_counter() - t0
            else:  # one unary call: no per-token hops through Serve
                first = await call_migrating(
                    engine_req,
                    self.engine.generate_full.remote,
                    max_migrations=self.cfg["max_migrations"],
                    counters=self.failures,
                    replica_failed=notify_replica_failed,
                )
                ttft = _unary_ttft(t0, t_call, time.perf_counter(), first)
        except StopAsyncIteration:
            release()
            self.serving_metrics.record_error(500)
            return _error_response(RuntimeError("engine returned nothing"))
        except Exception as exc:
            release()
            err = _engine_error(exc)
            if err is None:
                log.exception("engine call failed")
            self.serving_metrics.record_error(err.status if err else 500)
            return _error_response(err or exc)
        except BaseException:  # cancelled: Serve cancels the handler when the client goes away or times out
            if stream is not None:
                stream.cancel()
            release()
            raise
        # where a request's time goes (GET /metrics): the engine call holds the routing decision, the handle
        # hop and the engine's own time to its first output (reported by unary calls)
        self._record_call_stages(t0, t_call, first.get("ttft_s"))
        notify_first_token(request_id)
        miss_attribution.ATTRIBUTION.started(request_id, tenant.id)
        replica = first["replica"]
        oid = proto.new_id(req.kind)
        # x-request-id is Serve's own (its middleware appends one to every response): ours has its own name
        headers = {
            "x-kvmesh-replica": replica,
            "x-kvmesh-request-id": request_id,
            "x-kvmesh-queue-wait-ms": str(round(queue_wait_s * 1000)),  # bounded by admission.queue_timeout_s
        }
        predicted = local_state.LEDGER.prediction(request_id)
        if predicted is not None:  # what the router expected this replica to serve from cache
            headers["x-kvmesh-predicted-cached-tokens"] = str(predicted)

        def finish(completion_tokens: int, cached: int) -> dict:
            # a stream continued on another replica mid-answer was made by several: the totals only
            whole = stream is None or stream.replica in (None, replica)
            self.serving_metrics.record(replica if whole else None, len(ids), cached, completion_tokens, ttft, sent)
            self.tenant_metrics.record(tenant.id, len(ids), cached, ttft)
            moves = stream.moves if stream is not None else first.get("migrations", 0)
            if moves > 0:  # its replica failed: what it stored was unknown to the router
                continued = [continuation_id(request_id, k) for k in range(1, moves + 1)] if stream is not None else []
                for engine_request_id in [request_id, *continued]:  # a continuation's own prediction too
                    local_state.LEDGER.discard(engine_request_id)
                if deliveries is not None:
                    deliveries.add(request_id, None)
            elif deliveries is not None:  # compared with its prompt's other samples once all are in
                deliveries.add(request_id, cached)
            else:
                local_state.LEDGER.deliver(request_id, cached)
            # why the rest missed (/kvmesh/explain)
            miss_attribution.ATTRIBUTION.delivered(request_id, tenant.id, ids, cached)
            return proto.usage(len(ids), completion_tokens, cached)

        shape = ChoiceAnswer(req, ids, oid, created, self.tokenizer, answer, finish)
        if not req.stream:
            release()
            if first["finish_reason"] in ENGINE_FAILED:
                return self._engine_failed(first["finish_reason"])
            response = JSONResponse(shape.whole(first), headers=headers)
            self.serving_metrics.record_stage("handler", time.perf_counter() - t0)
            return response

        assert stream is not None  # a streaming request's first chunk came from it
        live = stream

        def close() -> None:
            """Cancel the engine stream unless answered whole, and free the tenant's slot; idempotent."""
            if not shape.answered:
                live.cancel()
            release()

        async def events() -> AsyncIterator[bytes]:
            try:
                async with contextlib.aclosing(shape.events(first, live, self.serving_metrics.record_error)) as out:
                    async for event in out:
                        yield event
            finally:
                close()

        return _ClosingStream(events(), close, media_type="text/event-stream", headers=headers)

    def _engine_failed(self, finish_reason: str) -> Response:
        """A generation the engine ended with `error` (e.g. a KV load from LMCache that failed) or `abort`: a
        500, as vLLM's own server answers, not a 200 whose text stops short."""
        self.serving_metrics.record_error(500)
        log.warning("engine ended a request with finish_reason %s", finish_reason)
        body = proto.openai_error(
            500, f"the engine ended the generation ({finish_reason})", "internal_error", "server_error"
        )
        return JSONResponse(body, status_code=500)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, "completion")

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, "chat")

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._auth(request)
        except KvmeshHTTPError as exc:
            return _error_response(exc)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvmesh",
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: the token ids a completion's `prompt`, or a chat's `messages` through the model's
        template, become, as a generation request's would (the ids the router hashes and the engine caches);
        with `return_token_strs` each token's string too; a count past the context is answered (a client may be
        checking whether its prompt fits), but text or token ids that could not fit whatever their tokens are a
        400, as for a generation (`_tokenize`: such a text is not worth the tokenizer's time). A tenant at its
        limits is refused as a generation would be; a tokenisation is not counted as one."""
        reservation = None
        tenant: Tenant | None = None
        try:
            tenant = self._auth(request)
            reservation = self.admission.reserve(tenant)  # refused while the tenant may start no request
            body = proto.parse_json(await self._read_body(request))
            reject_client_salt(body, request.headers)
            kind = "chat" if "messages" in body else "completion"
            strs = proto.boolean(body, "return_token_strs")
            body.pop("return_token_strs", None)  # not a generation request's field
            for generation_only in ("truncate_prompt_tokens", "truncation_side"):  # not vLLM's /tokenize fields
                body.pop(generation_only, None)
            req = proto.parse_request(body, kind)
            self._check_model(req)
            ids = await self._tokenize(req)
        except (OpenAIError, KvmeshHTTPError) as exc:
            return self._refused(exc, tenant)
        finally:
            self.admission.cancel(reservation)
        shown = self.tokenizer.convert_ids_to_tokens(ids) if strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": shown}

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: the text of a list of token ids (each in the model's vocabulary)."""
        try:
            self._auth(request)
            body = proto.parse_json(await self._read_body(request))
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise proto.bad("'tokens' must be a list of token ids.", "tokens", "invalid_type")
            self._check_token_ids(tokens, "tokens")
            self._check_model_name(proto.model_named(body))
        except (OpenAIError, KvmeshHTTPError) as exc:
            return self._refused(exc, None)
        return {"prompt": self.tokenizer.decode(tokens)}

    @fastapi_app.get("/health")
    async def health(self):
        """Liveness (always 200 while it answers) and, in `engines`, how many engine replicas this replica's
        router lists and can route to with a full view (`KvmeshRouter.readiness`): counts only."""
        return {
            "status": "ok",
            "model": self.served_model,
            "routers": len(active_routers()),
            "engines": await asyncio.to_thread(self._router_readiness),
        }

    def _router_readiness(self) -> dict | None:
        return self._on_router("readiness", lambda r: r.readiness())

    def _router_snapshot(self) -> dict | None:
        if not active_routers():
            log.info("no kvmesh router in this process yet (created on the first engine request)")
            return None
        return self._on_router("snapshot", lambda r: {**r.snapshot(), "held_blocks": r.held_blocks()})

    @staticmethod
    def _on_router(what: str, fn) -> dict | None:
        """fn(router) on this process's router's own loop (its state is not thread-safe); None when there is
        no router yet or it failed (logged)."""
        routers = active_routers()
        if not routers:
            return None
        r = routers[0]
        try:
            return r.call_on_loop(lambda: fn(r))
        except Exception:
            log.exception("router %s failed", what)
            return None

    @fastapi_app.get("/metrics")
    async def metrics(self):
        """This replica's page, or with several ingress replicas every replica's, merged and labelled
        `ingress` (deployments/fleet_metrics.py; the fleet-wide families once, unlabelled): a scrape
        reaches one replica, whichever it is."""
        if self.cfg["ingress_replicas"] > 1:
            text = await self._fleet_metrics_page()
        else:
            text = (await self.metrics_page())[1]
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def metrics_page(self) -> tuple[str, str]:
        """(this replica's id, its own Prometheus page); other ingress replicas call it through Serve."""
        snap = await asyncio.to_thread(self._router_snapshot)
        text = self.serving_metrics.prometheus_text(local_state.LEDGER.snapshot(), snap)
        text += self.tenant_metrics.prometheus_text()
        text += miss_attribution.ATTRIBUTION.prometheus_text()
        text += failure_metrics_text(self.failures, snap)  # migrations, forgotten replicas, stats errors
        text += await asyncio.to_thread(_tier_metrics_text)  # per-tier LMCache figures (kvstore/tier_metrics.py)
        return serve.get_replica_context().replica_id.unique_id, text

    async def _fleet_metrics_page(self) -> str:
        """Every ingress replica's page through Serve's broadcast (once per scrape, off the request path);
        this replica's own alone if the others cannot be asked, still labelled: its series keep their names."""
        try:
            ctx = serve.get_replica_context()
            peers = serve.get_deployment_handle(ctx.deployment, app_name=ctx.app_name)
            pages = await peers.broadcast("metrics_page").results_async(timeout_s=10.0, return_exceptions=True)
            merged = dict(p for p in pages if isinstance(p, tuple) and len(p) == 2)
        except Exception:
            log.exception("other ingress replicas' metrics not collected: this replica's page alone")
            merged = {}
        if not merged:
            rid, text = await self.metrics_page()
            merged = {rid: text}
        return fleet_metrics.merge(self.metric_pages.pages(merged, time.monotonic()))

    @fastapi_app.get("/kvmesh/state")
    async def state(self, request: Request):
        """Router index, prediction ledger and serving counters as JSON (for tests, demo and operators)."""
        try:
            self._operator(request)
        except (OpenAIError, KvmeshHTTPError) as exc:
            return _error_response(exc)
        snap = await asyncio.to_thread(self._router_snapshot)
        state = {
            "router": snap,
            "prediction": local_state.LEDGER.snapshot(),
            "serving": {**self.serving_metrics.snapshot(), "engine_transport": self.engine_transport},
            "model": self.served_model,
            "pid": os.getpid(),
            "tiers": await asyncio.to_thread(_tier_report),
        }
        # encoded off the event loop that serves requests: with the router's decision trace the document is
        # ~100 KB, tens of milliseconds through FastAPI's encoder (a JSONResponse renders when it is made)
        return await asyncio.to_thread(lambda: JSONResponse(jsonable_encoder(state)))

    @fastapi_app.get("/kvmesh/explain/{request_id}")
    async def explain(self, request_id: str, request: Request):
        """Why this request's uncached prompt tokens missed, with what the router knew at placement. A tenant
        reads its own requests only, and sees another tenant's copy of a prefix (`isolated`) as `cold`: it
        would otherwise learn which prompts other tenants sent. Operators read every record whole."""
        try:
            tenant = self._auth(request)
        except KvmeshHTTPError as exc:
            return _error_response(exc)
        rec = miss_attribution.ATTRIBUTION.explain(request_id)
        if rec is None or not (tenant.operator or rec.get("tenant") == tenant.id):
            return _error_response(OpenAIError(404, f"No record of request {request_id!r}.", "not_found"))
        return rec if tenant.operator else miss_attribution.tenant_view(rec)

    @fastapi_app.post("/kvmesh/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request):
        """Drop every engine replica's prefix cache (the cache test's cold pass), through Serve's broadcast to
        all replicas; the routers here forget what those replicas held at once (the engines' AllBlocksCleared
        events come only with their next step). 403 unless the config allows it (`allow_cache_reset`: any
        tenant could otherwise empty everyone's cache); 409 when a replica refused (requests in flight hold
        blocks) or failed, and when LMCache tiers are configured: they keep what the engines computed, so
        the next pass would not be cold."""
        try:
            self._operator(request)  # it empties every tenant's cache
        except (OpenAIError, KvmeshHTTPError) as exc:
            return _error_response(exc)
        if not self.cfg["allow_cache_reset"]:
            msg = "Cache reset is off on this server (config allow_cache_reset)."
            return _error_response(OpenAIError(403, msg, "cache_reset_disabled"))
        if self.cfg["engine"].get("lmcache") or self.cfg["engine"].get("kv_transfer_config"):
            msg = "LMCache tiers keep the KV the engines computed: a reset cannot empty them."
            return _error_response(OpenAIError(409, msg, "tiers_kept"))
        try:
            answers = await self.engine.broadcast("reset_prefix_cache").results_async(
                timeout_s=60.0, return_exceptions=True
            )
        except Exception:
            log.exception("prefix cache reset failed")
            answers = []
        done = {a["replica"]: a.get("reset") is True for a in answers if isinstance(a, dict) and "replica" in a}
        await asyncio.to_thread(notify_cache_reset, [rid for rid, ok in done.items() if ok])
        ok = bool(answers) and len(done) == len(answers) and all(done.values())
        body = {"reset": ok, "replicas": done}
        return body if ok else JSONResponse(body, status_code=409)

    @fastapi_app.post("/kvmesh/index/lookup")
    async def index_lookup(self, request: Request):
        """{"hashes": [int]} -> per replica, how many of these block hashes the router's index holds in hbm.

        Each hash is looked up on its own (not as a chain), so the answer is plain membership."""
        try:
            self._operator(request)
            body = proto.parse_json(await self._read_body(request))
            hashes = body.get("hashes")
            if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise proto.bad("'hashes' must be a list of integers.", "hashes", "invalid_type")
            if len(hashes) > MAX_LOOKUP_HASHES:  # looked up on the loop that routes every request
                raise proto.bad(f"At most {MAX_LOOKUP_HASHES} hashes per lookup.", "hashes", "too_many_hashes")
        except (OpenAIError, KvmeshHTTPError) as exc:
            return _error_response(exc)
        routers = active_routers()
        if not routers:
            return {"replicas": {}}
        r = routers[0]

        def lookup() -> dict[str, int]:
            counts: dict[str, int] = {rid: 0 for rid in r.index.replicas()}
            for h in hashes:
                for rid, (hbm, _, _) in r.index.match([h]).items():
                    counts[rid] += hbm
            return counts

        counts = await asyncio.to_thread(r.call_on_loop, lookup)
        return {"replicas": counts}
