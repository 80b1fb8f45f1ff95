"""The ingress's handlers against a fake engine (no Ray): a tenant's admission slot comes back however a
request ends, the client going away included (Serve cancels the handler's task then, at any point); bad
input is a 400, never a 500; what spans tenants is for operators only."""

from __future__ import annotations

import asyncio
import gc
import json
from types import SimpleNamespace

import pytest
from jinja2 import TemplateError
from starlette.requests import Request

from kvmesh.deployments import ingress as ingress_module
from kvmesh.deployments import miss_attribution
from kvmesh.deployments.admission import Admission
from kvmesh.deployments.failure_metrics import FailureCounters
from kvmesh.deployments.serving_metrics import ServingMetrics
from kvmesh.deployments.tenant_metrics import TenantMetrics
from kvmesh.deployments.tenants import Limits, Tenant, TenantRegistry, derive_salt, hash_api_key


def _chunk(text: str, token_ids: list[int], finish: str | None = None) -> dict:
    return {
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish,
        "num_cached_tokens": 0,
        "prompt_tokens": 3,
        "replica": "r0",
    }


class _Stream:
    """An engine stream whose first chunk never comes while `hang` is set (an engine still working)."""

    def __init__(self, hang: bool):
        self.hang = hang
        self.chunks = [_chunk("a", [5]), _chunk("b", [6], "length")]
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.hang:
            await asyncio.Event().wait()
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Engine:
    """The engine deployment's handle as the ingress calls it."""

    def __init__(self, hang: bool):
        self.hang = hang
        self.streams: list[_Stream] = []

        async def generate_full(request: dict) -> dict:
            if self.hang:
                await asyncio.Event().wait()
            return {**_chunk("ab", [5, 6], "length"), "ttft_s": 0.0}

        def generate(request: dict) -> _Stream:
            self.streams.append(_Stream(self.hang))
            return self.streams[-1]

        self.generate_full = _Method(generate_full)
        self.generate = _Method(generate)

    def options(self, **kwargs):
        return self


class _Tokenizer:
    """A tokenizer whose chat template fails as a real model's can (a template's raise_exception, or none)."""

    def __init__(self, error: Exception):
        self.error = error

    def apply_chat_template(self, *args, **kwargs):
        raise self.error


def _ingress(hang: bool = False, tokenizer=None):
    """An Ingress with its request path's state and nothing else (its __init__ starts Serve's machinery)."""

    class Bare(ingress_module.Ingress.func_or_class):  # type: ignore[name-defined]
        def __del__(self):  # Serve's wrapper's own is a coroutine nobody would await
            pass

    ing = object.__new__(Bare)
    ing.cfg = {"max_migrations": 2, "tenant_policies": {}, "ingress_replicas": 1}
    ing.engine = _Engine(hang)
    ing.tokenizer = tokenizer
    ing.vocab_size = 1000
    ing.max_model_len = 4096
    ing.served_model = "tiny"
    ing.model_aliases = {"tiny"}
    ing.registry = None
    ing._anonymous = Tenant("anonymous", None, derive_salt(b"k" * 32, "anonymous"), Limits(max_concurrent=2))
    ing.admission = Admission()
    ing.serving_metrics = ServingMetrics()
    ing.tenant_metrics = TenantMetrics()
    ing.failures = FailureCounters()
    return ing


def _request(
    body: dict | bytes, path: str = "/v1/completions", key: str | None = None, method: str = "POST"
) -> tuple[Request, dict, object]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()

    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    return Request(scope, receive), scope, receive


BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_a_request_cancelled_while_the_engine_works_gives_its_slot_back(stream):
    async def run():
        ing = _ingress(hang=True)
        for _ in range(3):  # more than the tenant's 2 concurrent requests
            req, _, _ = _request({**BODY, "stream": stream})
            task = asyncio.create_task(ing._generate(req, "completion"))
            await asyncio.sleep(0.02)
            assert ing.admission.active("anonymous") == 1
            task.cancel()  # what Serve does when the client goes away
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        assert all(s.cancelled for s in ing.engine.streams)
        ing.engine.hang = False
        req, _, _ = _request(BODY)
        answer = await ing._generate(req, "completion")
        assert answer.status_code == 200, answer.body

    asyncio.run(run())


def test_a_stream_cancelled_before_its_body_started_gives_its_slot_back():
    async def run():
        ing = _ingress()
        req, scope, receive = _request({**BODY, "stream": True})
        response = await ing._generate(req, "completion")
        assert ing.admission.active("anonymous") == 1

        async def send(message):  # the response's headers never get out
            await asyncio.Event().wait()

        task = asyncio.create_task(response(scope, receive, send))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gc.collect()
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        assert ing.engine.streams[0].cancelled

    asyncio.run(run())


def test_a_whole_stream_gives_its_slot_back_once_and_is_not_cancelled():
    async def run():
        ing = _ingress()
        req, scope, receive = _request({**BODY, "stream": True})
        response = await ing._generate(req, "completion")
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        await response(scope, receive, send)
        body = b"".join(m.get("body", b"") for m in sent)
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b"[DONE]") == 1
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        assert not ing.engine.streams[0].cancelled

    asyncio.run(run())


@pytest.mark.parametrize("field", ["max_tokens", "n", "seed"])
@pytest.mark.parametrize("raw", [b"1e400", b"NaN", b"-Infinity"])
def test_a_non_finite_integer_parameter_is_a_400(field, raw):
    async def run():
        ing = _ingress()
        body = b'{"model": "tiny", "prompt": [1, 2, 3], "%s": %s}' % (field.encode(), raw)
        req, _, _ = _request(body)
        answer = await ing._generate(req, "completion")
        assert answer.status_code == 400, answer.body
        assert json.loads(answer.body)["error"]["param"] == field
        assert ing.admission.in_flight == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    "error",
    [TemplateError("Conversation roles must alternate user/assistant"), ValueError("no chat template")],
    ids=["template_raises", "no_template"],
)
def test_a_chat_template_that_refuses_the_messages_is_a_400(error):
    async def run():
        ing = _ingress(tokenizer=_Tokenizer(error))
        body = {"model": "tiny", "messages": [{"role": "system", "content": "x"}, {"role": "system", "content": "y"}]}
        req, _, _ = _request(body, "/v1/chat/completions")
        answer = await ing._generate(req, "chat")
        assert answer.status_code == 400, answer.body
        assert json.loads(answer.body)["error"]["param"] == "messages"

    asyncio.run(run())


OPS_KEY, ACME_KEY, GLOBEX_KEY = (f"kvm-unit-{t}-key-0123456789" for t in ("ops", "acme", "globex"))


def _tenanted():
    """The ingress with three tenants, one of them an operator."""
    ing = _ingress()
    ing.registry = TenantRegistry.from_dict(
        {
            "tenants": [
                {"id": "ops", "keys": [{"sha256": hash_api_key(OPS_KEY)}], "operator": True},
                {"id": "acme", "keys": [{"sha256": hash_api_key(ACME_KEY)}]},
                {"id": "globex", "keys": [{"sha256": hash_api_key(GLOBEX_KEY)}]},
            ]
        },
        secret=b"unit-test-secret-0123456789abcdef",
    )
    return ing


def _code(response) -> str:
    return json.loads(response.body)["error"]["code"]


def test_the_router_state_and_index_lookups_are_for_operators_only():
    async def run():
        ing = _tenanted()
        req, _, _ = _request(b"", "/kvmesh/state", ACME_KEY, "GET")
        answer = await ing.state(req)
        assert answer.status_code == 403 and _code(answer) == "operator_only"
        req, _, _ = _request({"hashes": [1, 2]}, "/kvmesh/index/lookup", ACME_KEY)
        answer = await ing.index_lookup(req)
        assert answer.status_code == 403 and _code(answer) == "operator_only"
        many = {"hashes": list(range(ingress_module.MAX_LOOKUP_HASHES + 1))}
        req, _, _ = _request(many, "/kvmesh/index/lookup", OPS_KEY)
        answer = await ing.index_lookup(req)
        assert answer.status_code == 400 and _code(answer) == "too_many_hashes"

    asyncio.run(run())


def test_a_tenant_reads_its_own_requests_record_without_what_other_tenants_cached(monkeypatch):
    """`isolated` (another tenant's copy of the prefix would have served these tokens) tells a tenant which
    prompts other tenants sent: a tenant sees those tokens as `cold`, and no other tenant's records."""
    records = {
        "q-acme": {"request_id": "q-acme", "tenant": "acme", "miss_tokens": {"cold": 32, "isolated": 96}},
        "q-globex": {"request_id": "q-globex", "tenant": "globex", "miss_tokens": {"cold": 64}},
    }
    monkeypatch.setattr(miss_attribution, "ATTRIBUTION", SimpleNamespace(explain=records.get))

    async def run():
        ing = _tenanted()

        async def explain(rid: str, key: str):
            req, _, _ = _request(b"", f"/kvmesh/explain/{rid}", key, "GET")
            return await ing.explain(rid, req)

        own = await explain("q-acme", ACME_KEY)
        assert own["miss_tokens"] == {"cold": 128}
        other = await explain("q-globex", ACME_KEY)
        assert other.status_code == 404 and _code(other) == "not_found"
        assert (await explain("q-acme", OPS_KEY))["miss_tokens"] == {"cold": 32, "isolated": 96}

    asyncio.run(run())
