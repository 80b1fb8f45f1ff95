"""The ingress's handlers against a fake engine (no Ray): a tenant's admission slot comes back however a
request ends, the client going away included (Serve cancels the handler's task then, at any point); bad
input is a 400, never a 500; what spans tenants is for operators only."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import time
from types import SimpleNamespace

import pytest
from jinja2 import TemplateError
from starlette.requests import Request
from tiny_chat import PARTS_TEMPLATE

from kvmesh.deployments import ingress as ingress_module
from kvmesh.deployments import miss_attribution
from kvmesh.deployments.admission import Admission
from kvmesh.deployments.failure_metrics import FailureCounters
from kvmesh.deployments.serving_metrics import ServingMetrics
from kvmesh.deployments.tenant_metrics import TenantMetrics
from kvmesh.deployments.tenants import KvmeshHTTPError, Limits, Tenant, TenantRegistry, derive_salt, hash_api_key


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


class _DiesAfterOneChunk(_Stream):
    """A stream whose replica fails (its engine broke) once all but its last chunk went out."""

    async def __anext__(self) -> dict:
        if len(self.chunks) == 1:
            from kvmesh.deployments.engine_driver import EngineBroken

            raise EngineBroken("engine step failed", "r0")
        return await super().__anext__()


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
    ing.tool_parsing = None
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


async def _answered(ing, stream: bool):
    """A completion of BODY through the handler, its stream (if any) read to the end with nothing sent on."""
    req, scope, receive = _request({**BODY, "stream": stream})
    response = await ing._generate(req, "completion")
    if stream:

        async def send(message):
            pass

        await response(scope, receive, send)
    return response


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


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_the_router_hears_once_that_the_ingress_is_done_with_a_request_however_it_ended(stream, monkeypatch):
    """Answered or cancelled: the router ends a placement Serve never reports complete (`request_ended`)."""
    ended: list[str] = []
    # the handlers' own globals: Serve's ingress decorator rebuilt the class around a copy of the module's
    handler_globals = ingress_module.Ingress.func_or_class._generate.__globals__  # type: ignore[attr-defined]
    monkeypatch.setitem(handler_globals, "notify_request_ended", ended.append)

    async def run():
        ing = _ingress(hang=True)
        req, _, _ = _request({**BODY, "stream": stream})
        task = asyncio.create_task(ing._generate(req, "completion"))
        await asyncio.sleep(0.02)
        assert ended == []  # still in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(ended) == 1
        ing.engine.hang = False
        response = await _answered(ing, stream)
        assert response.status_code == 200
        assert len(ended) == 2 and ended[0] != ended[1]
        assert ended[1] == response.headers["x-kvmesh-request-id"]

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


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (TypeError("Template.render() got multiple values\nfor keyword argument 'x'"), "got multiple values for"),
        (KeyError("role"), "'role'"),
        (RuntimeError("wrapped"), "wrapped"),
    ],
)
def test_any_failure_of_the_chat_template_is_a_400_with_its_reason_on_one_line(error, reason):
    """As vLLM's safe_apply_chat_template: whatever the template's render raises is the request's error (a 400),
    not the server's (a 500); a template error in the exception's chain is the reason given."""
    if isinstance(error, RuntimeError):
        try:
            try:
                raise TemplateError("the template's own reason")
            except TemplateError as inner:
                raise error from inner
        except RuntimeError as chained:
            error, reason = chained, "the template's own reason"

    async def run():
        ing = _ingress(tokenizer=_Tokenizer(error))
        req, _, _ = _request({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, "/v1/chat/completions")
        answer = await ing._generate(req, "chat")
        assert answer.status_code == 400, answer.body
        message = json.loads(answer.body)["error"]["message"]
        assert reason in message and "\n" not in message
        assert message.startswith("The model's chat template refused this request: ")

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


class _RecordingEngine(_Engine):
    """The fake engine, remembering the requests it was given and answering with `finish`."""

    def __init__(self, finish: str = "length"):
        super().__init__(hang=False)
        self.requests: list[dict] = []

        async def generate_full(request: dict) -> dict:
            self.requests.append(request)
            return {**_chunk("ab", [5, 6], finish), "ttft_s": 0.0}

        def generate(request: dict) -> _Stream:
            self.requests.append(request)
            stream = _Stream(False)
            stream.chunks = [_chunk("a", [5]), _chunk("b", [6], finish)]
            self.streams.append(stream)
            return stream

        self.generate_full = _Method(generate_full)
        self.generate = _Method(generate)


class _TextTokenizer:
    """Encodes each character as its code point (and a BOS when asked); the chat template writes the turns."""

    def __init__(self):
        self.calls: list[dict] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode("utf-8")  # a lone surrogate cannot be encoded, as in a real tokenizer
        self.calls.append({"text": text, "add_special_tokens": add_special_tokens})
        return ([0] if add_special_tokens else []) + [ord(c) % 900 + 10 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        self.calls.append({"messages": messages})
        return "".join(f"<{m['role']}{':' + m['name'] if 'name' in m else ''}>{m['content']}" for m in messages)


def _answer(ing, body: dict, kind: str = "completion"):
    async def run():
        req, scope, receive = _request(body, "/v1/completions" if kind == "completion" else "/v1/chat/completions")
        response = await ing._generate(req, kind)
        if not body.get("stream"):
            return response.status_code, json.loads(response.body)
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        await response(scope, receive, send)
        return response.status_code, b"".join(m.get("body", b"") for m in sent).decode()

    return asyncio.run(run())


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}


def test_a_chat_without_max_tokens_may_answer_to_the_end_of_the_context():
    """OpenAI's and vLLM's chat default: not 16 tokens, which cut every SDK client's answer short."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    ing.max_model_len = 64
    status, _ = _answer(ing, CHAT, "chat")
    assert status == 200
    prompt = ing.engine.requests[0]["prompt_token_ids"]
    assert ing.engine.requests[0]["params"]["max_tokens"] == 64 - len(prompt)
    status, body = _answer(ing, {**CHAT, "messages": [{"role": "user", "content": "x" * 70}]}, "chat")
    assert status == 400  # a prompt that fills the context leaves nothing to answer with
    assert "no room" in body["error"]["message"] and "max_tokens" not in body["error"]["message"]
    status, body = _answer(ing, {**CHAT, "min_tokens": 60}, "chat")  # more than the context leaves
    assert status == 400 and body["error"]["param"] == "min_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool_choice", "required"),  # without tools
        ("functions", [{"name": "f"}]),
        ("guided_json", {"type": "object"}),
        ("logprobs", 0),
        ("watermarking", True),
        ("length_penalty", 2.0),
        ("return_token_offsets", True),
        ("include_reasoning", False),
        ("return_prompt_text", True),
        ("kv_transfer_params", {"do_remote_prefill": True}),
        ("chat_template", "{{ messages }}"),
    ],
)
def test_a_setting_that_would_shape_the_output_and_is_not_served_is_a_400_not_ignored(field, value):
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    status, body = _answer(ing, {**CHAT, field: value}, "chat")
    assert status == 400 and body["error"]["param"] == field and not ing.engine.requests


def test_a_logit_bias_reaches_the_engine_as_vllms_sampling_params_take_it():
    """Token ids (JSON's string keys) to biases clamped to [-100, 100], the engine's SamplingParams built from
    them equal to the ones vLLM's server builds; a key that is no token id, or one past the vocabulary, is a
    400 naming the field before the engine is asked."""
    from vllm import SamplingParams

    from kvmesh.deployments.engine import EngineReplica

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    bias = {"17": 5, "23": -250.5, "999": 150}
    status, answer = _answer(ing, {**CHAT, "logit_bias": bias}, "chat")
    assert status == 200, answer
    params = ing.engine.requests[-1]["params"]
    assert params["logit_bias"] == {17: 5.0, 23: -100.0, 999: 100.0}
    built = EngineReplica._sampling_params(SimpleNamespace(), params)
    assert built.logit_bias == SamplingParams.from_optional(logit_bias=bias).logit_bias
    for wrong, code in (({"x": 1}, "invalid_type"), ({"1000": 1}, "invalid_token_id"), ({"1": "up"}, "invalid_type")):
        status, answer = _answer(ing, {**CHAT, "logit_bias": wrong}, "chat")
        assert status == 400 and (answer["error"]["param"], answer["error"]["code"]) == ("logit_bias", code)
    assert len(ing.engine.requests) == 1


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_allowed_token_ids_and_bad_words_reach_the_engine_as_vllms_sampling_params_take_them(kind):
    """vLLM's `allowed_token_ids` (the only tokens sampled) and `bad_words` (never generated: vLLM's engine
    tokenises them) reach the engine's SamplingParams as given; an empty or non-integer list, an id past the
    vocabulary, or words that are not a list of strings is a 400 naming the field before the engine is asked."""
    from kvmesh.deployments.engine import EngineReplica

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    base = BODY if kind == "completion" else CHAT
    status, answer = _answer(ing, {**base, "allowed_token_ids": [17, 23], "bad_words": ["ke", "the end"]}, kind)
    assert status == 200, answer
    built = EngineReplica._sampling_params(SimpleNamespace(), ing.engine.requests[-1]["params"])
    assert built.allowed_token_ids == [17, 23] and built.bad_words == ["ke", "the end"]
    status, _ = _answer(ing, {**base, "bad_words": []}, kind)  # vLLM's default: nothing barred
    assert status == 200 and "bad_words" not in ing.engine.requests[-1]["params"]
    for wrong, code in [
        ({"allowed_token_ids": []}, "invalid_value"),
        ({"allowed_token_ids": [1, "2"]}, "invalid_type"),
        ({"allowed_token_ids": [True]}, "invalid_type"),
        ({"allowed_token_ids": [1000]}, "invalid_token_id"),
        ({"bad_words": "ke"}, "invalid_type"),
        ({"bad_words": ["ke", 3]}, "invalid_type"),
        ({"bad_words": ["ke", ""]}, "invalid_value"),
    ]:
        status, answer = _answer(ing, {**base, **wrong}, kind)
        assert status == 400 and (answer["error"]["param"], answer["error"]["code"]) == (next(iter(wrong)), code)
    assert len(ing.engine.requests) == 2


def test_a_priority_reaches_the_engine_within_its_keys_floor():
    """vLLM's `priority` goes to the engine with the request (0, vLLM's default, is not sent); a tenant's
    `min_priority` is its requests' priority when they ask none, and one more urgent is a 400 naming the field
    before the engine is asked; without a floor any priority goes."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    assert _answer(ing, {**BODY, "priority": -5})[0] == 200
    assert _answer(ing, BODY)[0] == 200
    assert [r.get("priority") for r in ing.engine.requests] == [-5, None]
    ing._anonymous = dataclasses.replace(ing._anonymous, limits=Limits(max_concurrent=2, min_priority=10))
    assert _answer(ing, BODY)[0] == 200 and ing.engine.requests[-1]["priority"] == 10
    assert _answer(ing, {**BODY, "priority": 12})[0] == 200 and ing.engine.requests[-1]["priority"] == 12
    sent = len(ing.engine.requests)
    status, answer = _answer(ing, {**CHAT, "priority": 9}, "chat")
    assert status == 400 and answer["error"]["param"] == "priority" and "at least 10" in answer["error"]["message"]
    assert len(ing.engine.requests) == sent and ing.admission.active("anonymous") == 0


def test_vllms_sampling_extensions_reach_the_engine_and_unset_settings_are_the_models():
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    extras = {"top_k": 1, "min_p": 0.5, "repetition_penalty": 1.5, "min_tokens": 2, "stop_token_ids": [7]}
    status, _ = _answer(ing, {**BODY, **extras, "skip_special_tokens": False})
    assert status == 200
    params = ing.engine.requests[0]["params"]
    assert {k: params[k] for k in extras} == extras and params["skip_special_tokens"] is False
    assert "temperature" not in params and "top_p" not in params  # the engine's (the model's) defaults


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stop_string_kept_in_the_text_is_asked_of_the_engine_as_vllms_server_asks_it(kind):
    """`include_stop_str_in_output` reaches the engine's SamplingParams (vLLM's detokenizer then keeps the stop
    string and holds nothing back); anything but a boolean is a 400 naming it, before the engine is asked."""
    from kvmesh.deployments.engine import EngineReplica

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    body = {**(BODY if kind == "completion" else CHAT), "stop": ["END"], "include_stop_str_in_output": True}
    status, _ = _answer(ing, body, kind)
    assert status == 200
    built = EngineReplica._sampling_params(SimpleNamespace(), ing.engine.requests[0]["params"])
    assert built.include_stop_str_in_output is True and built.stop == ["END"]
    status, _ = _answer(ing, {**body, "include_stop_str_in_output": False}, kind)
    assert status == 200
    built = EngineReplica._sampling_params(SimpleNamespace(), ing.engine.requests[1]["params"])
    assert built.include_stop_str_in_output is False
    status, answer = _answer(ing, {**body, "include_stop_str_in_output": "yes"}, kind)
    assert status == 400 and answer["error"]["param"] == "include_stop_str_in_output"
    assert len(ing.engine.requests) == 2


class _HeldBackEngine(_RecordingEngine):
    """Streams a piece whose tokens have no text yet (a stop string may be forming) between two with text."""

    def __init__(self):
        super().__init__()
        plain = self.generate.remote

        def generate(request: dict) -> _Stream:
            stream = plain(request)
            stream.chunks = [_chunk("a", [5]), _chunk("", [6]), _chunk("b", [7], "length")]
            return stream

        self.generate = _Method(generate)


def _choices_of(events: list[dict]) -> list[dict]:
    return [c for e in events for c in e["choices"]]


def test_return_token_ids_answers_the_prompts_and_the_answers_token_ids_where_vllms_server_does():
    """vLLM's `return_token_ids`: the ids the engine was given as `prompt_token_ids` (a completion's in its
    choice, a chat's beside its choices) and the answer's as its choice's `token_ids`; streamed, the prompt's in
    a choice's first chunk only (a completion's null after it) and each chunk's own tokens, a chunk going out for
    tokens whose text is held back too; an echoed completion's prompt back as ids, not text; neither field
    without the flag; anything but a boolean a 400 before the engine is asked."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    status, answer = _answer(ing, {**BODY, "return_token_ids": True})
    assert status == 200
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == ing.engine.requests[-1]["prompt_token_ids"] == [1, 2, 3]
    assert (choice["text"], choice["token_ids"]) == ("ab", [5, 6])
    status, answer = _answer(ing, BODY)
    assert status == 200 and not {"token_ids", "prompt_token_ids"} & set(answer["choices"][0])
    status, answer = _answer(ing, {**BODY, "return_token_ids": True, "echo": True})
    assert status == 200
    assert (answer["choices"][0]["text"], answer["choices"][0]["prompt_token_ids"]) == ("ab", [1, 2, 3])

    status, answer = _answer(ing, {**CHAT, "return_token_ids": True}, "chat")
    assert status == 200
    assert answer["prompt_token_ids"] == ing.engine.requests[-1]["prompt_token_ids"]
    assert answer["choices"][0]["token_ids"] == [5, 6] and "prompt_token_ids" not in answer["choices"][0]

    ing.engine = _HeldBackEngine()
    status, sse = _answer(ing, {**BODY, "return_token_ids": True, "stream": True})
    assert status == 200
    pieces = _choices_of(_events(sse))
    assert [(c["text"], c["token_ids"], c["prompt_token_ids"]) for c in pieces] == [
        ("a", [5], [1, 2, 3]),
        ("", [6], None),
        ("b", [7], None),
    ]
    status, sse = _answer(ing, {**BODY, "stream": True})
    assert [c["text"] for c in _choices_of(_events(sse))] == ["a", "b"]  # without the flag, text pieces only
    assert not any("token_ids" in c for c in _choices_of(_events(sse)))
    status, sse = _answer(ing, {**CHAT, "return_token_ids": True, "stream": True}, "chat")
    events = [e for e in _events(sse) if e["choices"]]
    assert events[0]["prompt_token_ids"] == ing.engine.requests[-1]["prompt_token_ids"]
    assert not any("prompt_token_ids" in e for e in events[1:])
    assert [c["token_ids"] for c in _choices_of(events)] == [[5], [6], [7]]

    sent = len(ing.engine.requests)
    for kind in ("completion", "chat"):
        status, answer = _answer(ing, {**(BODY if kind == "completion" else CHAT), "return_token_ids": "yes"}, kind)
        assert status == 400 and answer["error"]["param"] == "return_token_ids"
    assert len(ing.engine.requests) == sent


def _vllms_truncation(prompt: str | list[int], keep: int, side: str | None, max_len: int, answer: int, special: bool):
    """The prompt ids vLLM's server makes of `prompt` with `truncate_prompt_tokens` `keep` (its own
    TokenizeParams and tokenizer: text cut on a side asked for, else by the tokenizer, then the ids)."""
    from vllm.renderers.params import TokenizeParams
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(_tiny_path()))
    params = TokenizeParams(
        max_total_tokens=max_len,
        max_output_tokens=answer,
        truncate_prompt_tokens=keep,
        truncation_side=side,  # type: ignore[arg-type]
        add_special_tokens=special,
    )
    if isinstance(prompt, str):
        text = params.apply_pre_tokenization(tok, {"prompt": prompt})["prompt"]
        prompt = tok.encode(text, **params.get_encode_kwargs())
    return params.apply_post_tokenization(tok, {"prompt_token_ids": prompt})["prompt_token_ids"]  # type: ignore


PROSE = "The cache remembers what the router placed, and the router remembers where the cache is warm. " * 3


@pytest.mark.parametrize("side", [None, "left", "right"])
@pytest.mark.parametrize("keep", [1, 5, 2000, -1])
@pytest.mark.parametrize("prompt", [PROSE, list(range(10, 90))], ids=["text", "token ids"])
def test_truncate_prompt_tokens_keeps_the_tokens_vllms_server_keeps(prompt, keep, side):
    """vLLM's `truncate_prompt_tokens` (and `truncation_side`): the engine is given (and the router hashes) the
    ids vLLM's own TokenizeParams make of the same prompt with the same tokenizer: the last tokens by default,
    the first with "right", -1 as many as a context of 48 leaves an answer (so max_tokens trimmed to 1)."""
    from kvmesh.deployments.ingress import load_tokenizer

    ing = _ingress(tokenizer=load_tokenizer(str(_tiny_path())))
    ing.engine = _RecordingEngine()
    ing.max_model_len = 48 if keep == -1 else 4096
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": keep}
    status, answer = _answer(ing, {**body, **({"truncation_side": side} if side else {})})
    assert status == 200, answer
    sent = ing.engine.requests[0]["prompt_token_ids"]
    assert sent == _vllms_truncation(prompt, keep, side, ing.max_model_len, 4, special=True)
    whole = len(ing.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
    assert len(sent) == (min(keep, whole) if keep > 0 else 47)
    if keep == -1:
        assert ing.engine.requests[0]["params"]["max_tokens"] == 1


def test_a_truncated_chat_and_echo_and_the_refused_truncations():
    """A chat's templated ids cut as vLLM cuts them (no special tokens added: its template writes them); an
    echoed completion shows the prompt as sent, as vLLM's server does, its usage counting the kept tokens; a
    text longer than the context could hold is served once cut; 0, past the context, below -1 or a side that is
    neither is a 400 naming its field before the engine is asked."""
    from kvmesh.deployments.ingress import load_tokenizer

    ing = _ingress(tokenizer=load_tokenizer(str(_tiny_path())))
    ing.engine = _RecordingEngine()
    chat = {**CHAT, "messages": [{"role": "user", "content": PROSE}], "max_tokens": 2}
    assert _answer(ing, chat, "chat")[0] == 200
    whole = ing.engine.requests[-1]["prompt_token_ids"]
    assert _answer(ing, {**chat, "truncate_prompt_tokens": 6}, "chat")[0] == 200
    assert ing.engine.requests[-1]["prompt_token_ids"] == whole[-6:]
    status, answer = _answer(ing, {**BODY, "prompt": PROSE, "truncate_prompt_tokens": 3, "echo": True})
    assert status == 200 and answer["choices"][0]["text"] == PROSE + "ab"
    assert answer["usage"]["prompt_tokens"] == 3
    ing.max_model_len = 32
    long_text = PROSE * 40  # more characters than 32 tokens could cover
    assert _answer(ing, {**BODY, "prompt": long_text})[0] == 400
    for side in ("left", "right"):
        sent = len(ing.engine.requests)
        body = {**BODY, "prompt": long_text, "truncate_prompt_tokens": 8, "truncation_side": side}
        assert _answer(ing, body)[0] == 200 and len(ing.engine.requests) == sent + 1
        assert ing.engine.requests[-1]["prompt_token_ids"] == _vllms_truncation(long_text, 8, side, 32, 2, True)
    sent = len(ing.engine.requests)
    for bad, param in [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 33}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
    ]:
        status, answer = _answer(ing, {**BODY, **bad})
        assert status == 400 and answer["error"]["param"] == param, (bad, answer)
    assert len(ing.engine.requests) == sent


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_what_stopped_a_generation_is_answered_as_vllms_server_answers_it(kind):
    """`stop_reason` beside `finish_reason` (vLLM's server's field: the stop string that matched, a stop token's
    id, null for EOS or a length), on the answer and on a stream's last chunk only; a chat also has OpenAI's
    `system_fingerprint` (null, as on vLLM's server)."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine("stop")
    last = _chunk("b", [6], "stop")
    ing.engine.generate_full = _Method(lambda request: _unary_answer({**last, "text": "ab", "stop_reason": "END"}))
    body = CHAT if kind == "chat" else {"model": "tiny", "prompt": "hi"}
    status, answer = _answer(ing, body, kind)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["stop_reason"] == "END"
    assert ("system_fingerprint" in answer) == (kind == "chat") and answer.get("system_fingerprint") is None

    def stream(request: dict) -> _Stream:
        made = _Stream(False)
        made.chunks = [_chunk("a", [5]), {**last, "stop_reason": 7}]
        return made

    ing.engine.generate = _Method(stream)
    status, text = _answer(ing, {**body, "stream": True}, kind)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and [e["choices"][0].get("stop_reason", "absent") for e in events] == ["absent", 7]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def _unary_answer(chunk: dict) -> dict:
    return {**chunk, "ttft_s": 0.0}


@pytest.mark.parametrize("finish", ["error", "abort"])
def test_a_generation_the_engine_did_not_finish_is_a_500_not_a_short_answer(finish):
    ing = _ingress()
    ing.engine = _RecordingEngine(finish)
    status, body = _answer(ing, BODY)
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert ing.admission.in_flight == 0
    status, text = _answer(ing, {**BODY, "stream": True})
    events = [line for line in text.splitlines() if line]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"  # the error, then the end as always
    assert all(finish not in e for e in events[:-2])
    assert ing.admission.in_flight == 0


def test_text_the_tokenizer_refuses_is_a_400_and_another_model_is_refused_before_tokenising():
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    status, body = _answer(ing, {"model": "tiny", "prompt": "a\ud800b"})
    assert status == 400 and body["error"]["param"] == "prompt"
    calls = len(ing.tokenizer.calls)
    status, body = _answer(ing, {"model": "other", "prompt": "x" * 1000})
    assert status == 404 and len(ing.tokenizer.calls) == calls


def test_prompts_are_tokenised_as_vllms_server_does():
    """A completion's text gets the model's special tokens (its BOS); a chat's come from its template, and a
    message keeps its name; stream options ask for a stream."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    assert _answer(ing, {"model": "tiny", "prompt": "hi"})[0] == 200
    assert ing.engine.requests[-1]["prompt_token_ids"][0] == 0
    assert _answer(ing, {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "chat")[0] == 200
    assert ing.engine.requests[-1]["prompt_token_ids"][0] != 0
    assert {"role": "user", "content": "hi", "name": "ann"} in ing.tokenizer.calls[-2]["messages"]
    status, body = _answer(ing, {**BODY, "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options"


def test_min_tokens_beyond_the_clients_max_tokens_is_a_400():
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    status, body = _answer(ing, {**BODY, "max_tokens": 2, "min_tokens": 3})
    assert status == 400 and body["error"]["param"] == "min_tokens" and not ing.engine.requests


class _CountingTokenizer:
    """A tokenizer that must not be asked: an oversized prompt is refused before tokenising."""

    def __init__(self):
        self.calls = 0

    def get_vocab(self):
        return {"a": 0, "bb": 1, "ccc": 2}  # the longest entry covers 3 characters

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return [0] * len(text)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return "x"


def _client(ing):
    """A FastAPI app with the ingress app's own exception handlers routing to `ing` (what a client sees)."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    app = FastAPI()
    for kind, handler in ingress_module.fastapi_app.exception_handlers.items():
        app.add_exception_handler(kind, handler)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await ing._generate(request, "completion")

    return TestClient(app, raise_server_exceptions=False)


def test_deeply_nested_json_is_a_400_and_anything_unanswered_an_openai_500():
    ing = _ingress()
    with _client(ing) as c:
        body = '{"model": "tiny", "prompt": [1], "user": ' + "[" * 5000 + "]" * 5000 + "}"
        r = c.post("/v1/completions", content=body.encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        ing.admission = None  # any failure no handler answers
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


def test_a_body_over_the_limit_is_a_413_before_it_is_read_or_parsed():
    ing = _ingress()
    ing.max_model_len = 16  # the limit is the floor: MIN_BODY_BYTES
    limit = ingress_module.MIN_BODY_BYTES
    with _client(ing) as c:
        big = json.dumps({"model": "tiny", "prompt": "a" * (limit + 10), "max_tokens": 1}).encode()
        r = c.post("/v1/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def run():  # no Content-Length: counted while read
        chunks = [b'{"model": "tiny", "prompt": "', b"a" * limit, b'"}']

        async def receive():
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        answer = await ing._generate(Request(scope, receive), "completion")
        assert answer.status_code == 413

    asyncio.run(run())


def test_a_body_that_never_ends_is_a_408_not_a_handler_held_for_good(monkeypatch):
    handler_globals = ingress_module.Ingress.func_or_class._generate.__globals__  # type: ignore[attr-defined]
    monkeypatch.setitem(handler_globals, "BODY_TIMEOUT_S", 0.2)

    async def run():
        ing = _ingress()
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b'{"model": ', "more_body": True}
            await asyncio.Event().wait()  # the rest never comes

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        answer = await asyncio.wait_for(ing._generate(Request(scope, receive), "completion"), 5)
        assert answer.status_code == 408 and _code(answer) == "request_timeout"
        assert ing.admission.in_flight == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "abc" * 20, "max_tokens": 1},  # 60 characters > 16 tokens x 3
        {"model": "tiny", "messages": [{"role": "user", "content": "abc" * 20}], "max_tokens": 1},
        {"model": "tiny", "messages": [{"role": "user", "content": ""}] * 16, "max_tokens": 1},
        {"model": "tiny", "prompt": [1] * 16, "max_tokens": 1},  # ids: refused before each is checked
    ],
    ids=["text", "chat", "messages", "ids"],
)
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_it_is_tokenised(body):
    async def run():
        tokenizer = _CountingTokenizer()
        ing = _ingress(tokenizer=tokenizer)
        ing.max_model_len = 16
        req, _, _ = _request(body, "/v1/chat/completions" if "messages" in body else "/v1/completions")
        answer = await ing._generate(req, "chat" if "messages" in body else "completion")
        assert answer.status_code == 400 and _code(answer) == "context_length_exceeded", answer.body
        assert tokenizer.calls == 0

    asyncio.run(run())


def test_emptying_every_tenants_cache_is_for_operators_only():
    async def run():
        ing = _tenanted()
        ing.cfg = {**ing.cfg, "allow_cache_reset": True, "engine": {}}
        req, _, _ = _request(b"", "/kvmesh/reset_prefix_cache", ACME_KEY)
        answer = await ing.reset_prefix_cache(req)
        assert answer.status_code == 403 and _code(answer) == "operator_only"

    asyncio.run(run())


def test_a_request_moved_off_a_failed_replica_is_not_judged_against_its_prediction(monkeypatch):
    """The failed replica's prefill may have reached the shared tier, which the router could not know of:
    comparing would raise the hash-contract alarm over a hashing bug that does not exist."""
    from kvmesh.deployments import local_state
    from kvmesh.deployments.engine_driver import EngineBroken

    judged: list[tuple[str, str]] = []
    ledger = SimpleNamespace(
        prediction=lambda rid: None,
        deliver=lambda rid, cached: judged.append(("deliver", rid)),
        discard=lambda rid: judged.append(("discard", rid)),
    )
    monkeypatch.setattr(local_state, "LEDGER", ledger)

    async def run():
        ing = _ingress()
        calls = 0

        async def generate_full(request: dict) -> dict:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise EngineBroken("engine step failed", "r0")
            return {**_chunk("ab", [5, 6], "length"), "ttft_s": 0.0}

        ing.engine.generate_full = _Method(generate_full)
        req, _, _ = _request(BODY)
        moved = await ing._generate(req, "completion")
        assert moved.status_code == 200 and judged == [("discard", moved.headers["x-kvmesh-request-id"])]
        judged.clear()
        req, _, _ = _request(BODY)
        plain = await ing._generate(req, "completion")
        assert judged == [("deliver", plain.headers["x-kvmesh-request-id"])]
        judged.clear()

        opened: list[dict] = []

        def generate(request: dict) -> _Stream:
            opened.append(request)
            return _DiesAfterOneChunk(False) if len(opened) == 1 else _Stream(False)

        ing.engine.generate = _Method(generate)
        req, scope, receive = _request({**BODY, "stream": True})
        response = await ing._generate(req, "completion")

        async def send(message):
            pass

        await response(scope, receive, send)
        rid = response.headers["x-kvmesh-request-id"]
        assert opened[1]["request_id"] == f"{rid}-m1"  # a continuation, predicted under its own id
        assert judged == [("discard", rid), ("discard", f"{rid}-m1")]

    asyncio.run(run())


def _events(sse: str) -> list[dict]:
    return [json.loads(e[6:]) for e in sse.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_chunk_of_a_slow_stream_has_the_same_created(kind, monkeypatch):
    """OpenAI and vLLM stamp a stream once: its chunks, the usage chunk too, share `created` however long the
    engine takes between them (here 2 s a chunk on a clock the stream moves)."""
    import time

    clock = {"now": 1_700_000_000.0}
    monkeypatch.setattr(time, "time", lambda: clock["now"])

    class _Slow(_Stream):
        async def __anext__(self) -> dict:
            clock["now"] += 2.0
            return await super().__anext__()

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine.generate = _Method(lambda request: _Slow(False))
    body = {**(BODY if kind == "completion" else CHAT), "stream": True, "stream_options": {"include_usage": True}}
    status, sse = _answer(ing, body, kind)
    events = _events(sse)
    assert status == 200 and len(events) >= 3 and events[-1]["usage"] is not None
    assert {e["created"] for e in events} == {1_700_000_000}


def test_usage_after_a_move_counts_no_token_past_a_stop_string_that_spans_it():
    """A stop string that spans a move is found by the ingress (the new replica sees only its own text): the
    tokens the new replica sent after the one completing it are dropped, as vLLM drops them, so usage counts
    the answer's tokens up to the stop, as an untouched run's does."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    tok = AutoTokenizer.from_pretrained(
        build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")
    )
    prompt = tok.encode("The quick brown", add_special_tokens=False)
    fox, rest = (tok.encode(w, add_special_tokens=False) for w in (" fox", " jumps over"))
    stop = "x ju"
    # an untouched run: the output tokens up to the one whose text completes the stop string
    base = len(tok.decode(prompt))
    upto = next(n for n in range(1, len(fox + rest) + 1) if stop in tok.decode(prompt + (fox + rest)[:n])[base:])
    assert len(fox) < upto < len(fox + rest)  # the stop string spans the move, inside the new replica's chunk

    opened: list[dict] = []

    def generate(request: dict) -> _Stream:
        opened.append(request)
        # the first replica sends " fox" (its last 3 characters held back for the stop string), then fails
        stream = _DiesAfterOneChunk(False) if len(opened) == 1 else _Stream(False)
        # the new replica cannot see the stop string: one chunk of several tokens (a busy consumer's merge), then more
        stream.chunks = (
            [_chunk(" ", fox), _chunk("", [9])]
            if len(opened) == 1
            else [_chunk(" jumps over", rest), _chunk("", [7], "length")]
        )
        return stream

    ing = _ingress(tokenizer=tok)
    ing.vocab_size = len(tok)
    ing.engine.generate = _Method(generate)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "stream": True,
        "stop": [stop],
        "stream_options": {"include_usage": True},
    }
    status, sse = _answer(ing, body)
    events = _events(sse)
    assert status == 200 and len(opened) == 2
    assert "".join(c["text"] for e in events for c in e["choices"]) == " fo"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == upto


# --- a throttled tenant is refused before its prompt is tokenised --------------------------------------

TEXT = {"model": "tiny", "prompt": "abcd", "max_tokens": 2}  # 4 tokens with the counting tokenizer


def _limited(limits: Limits, now: list[float], **admission) -> ingress_module.Ingress:
    """The ingress with its one tenant under `limits`, a counting tokenizer and admission on a clock that moves
    only when the test moves it."""
    ing = _ingress(tokenizer=_CountingTokenizer())
    ing.engine = _RecordingEngine()
    ing._anonymous = Tenant("anonymous", None, derive_salt(b"k" * 32, "anonymous"), limits)
    ing.admission = Admission(clock=lambda: now[0], **admission)
    return ing


async def _send(ing, body: dict, kind: str = "completion"):
    req, _, _ = _request(body, "/v1/completions" if kind == "completion" else "/v1/chat/completions")
    return await ing._generate(req, kind)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_tenant_over_its_request_rate_gets_its_429_before_its_prompt_is_tokenised(kind):
    """The tokenizer (and its thread pool) serves every tenant: a throttled tenant's flood must not keep it
    busy. The 429 is the one admission gives once the prompt is counted, word for word, and charges nothing."""
    from kvmesh.deployments.admission import RateLimited

    async def run():
        now = [1000.0]
        ing = _limited(Limits(requests_per_s=1, burst_requests=2), now)
        body = TEXT if kind == "completion" else {**CHAT, "max_tokens": 2}
        for _ in range(2):
            assert (await _send(ing, body, kind)).status_code == 200
        per = 1 if kind == "completion" else 2  # a chat's template is the tokenizer's too
        assert ing.tokenizer.calls == 2 * per
        answers = [await _send(ing, body, kind) for _ in range(5)]
        assert ing.tokenizer.calls == 2 * per  # none of them tokenised
        with pytest.raises(RateLimited) as counted:  # what admission answers for the counted prompt
            ing.admission.try_acquire(ing._anonymous, len(ing.engine.requests[-1]["prompt_token_ids"]))
        for answer in answers:
            assert answer.status_code == 429 and json.loads(answer.body) == counted.value.body()
            assert answer.headers["retry-after"] == counted.value.headers()["Retry-After"] == "1"
        assert _code(answers[0]) == "rate_limit_exceeded" and "requests per second" in answers[0].body.decode()
        assert ing.tenant_metrics.snapshot()["anonymous"]["rejections"] == {"rate_limit_exceeded": 5}
        assert ing.serving_metrics.errors == {429: 5}
        now[0] += 1.0  # one request refilled: the refusals took nothing, so exactly one is admitted
        assert (await _send(ing, body, kind)).status_code == 200 and ing.tokenizer.calls == 3 * per
        assert (await _send(ing, body, kind)).status_code == 429 and ing.tokenizer.calls == 3 * per
        assert len(ing.engine.requests) == 3

    asyncio.run(run())


def test_a_tenant_out_of_prompt_tokens_is_refused_before_tokenising_and_given_token_ids_are_counted():
    """Text's count is known only once tokenised: below 1 token left it is refused before, with the wait for
    that 1 token (a lower bound); with more left it is tokenised and admission judges the count. Token ids
    count as given, so their 429 is admission's own, Retry-After included."""
    from kvmesh.deployments.admission import RateLimited

    async def run():
        now = [1000.0]
        ing = _limited(Limits(tokens_per_min=60), now)  # 1 token a second
        assert (await _send(ing, {**TEXT, "prompt": "a" * 60})).status_code == 200  # the whole budget
        early = await _send(ing, TEXT)
        assert early.status_code == 429 and ing.tokenizer.calls == 1
        assert "prompt tokens per minute" in early.body.decode() and early.headers["retry-after"] == "1"
        now[0] += 1.0  # 1 token back: the 4-token prompt may fit as far as anyone can tell before counting it
        late = await _send(ing, TEXT)
        assert late.status_code == 429 and ing.tokenizer.calls == 2 and late.headers["retry-after"] == "3"
        now[0] += 3.0
        assert (await _send(ing, TEXT)).status_code == 200 and ing.tokenizer.calls == 3

        ing = _limited(Limits(tokens_per_min=600), now)  # 10 tokens a second
        assert (await _send(ing, {**BODY, "prompt": [1] * 500})).status_code == 200
        refused = await _send(ing, {**BODY, "prompt": [1] * 200})
        with pytest.raises(RateLimited) as counted:
            ing.admission.try_acquire(ing._anonymous, 200)
        assert refused.status_code == 429 and json.loads(refused.body) == counted.value.body()
        assert refused.headers["retry-after"] == counted.value.headers()["Retry-After"] == "10"

    asyncio.run(run())


def test_every_refusal_by_the_tenants_limits_counts_in_its_rejections_and_other_bad_input_does_not():
    """kvmesh_tenant_rejections_total says it counts the tenant's limits: a prompt over max_prompt_tokens (a 400)
    is one as much as a 429; a malformed request is not."""

    async def run():
        now = [1000.0]
        ing = _limited(Limits(max_prompt_tokens=2, requests_per_s=1, burst_requests=1), now)
        over = await _send(ing, {**BODY, "prompt": [1, 2, 3]})  # over max_prompt_tokens, token ids: before tokenising
        assert over.status_code == 400 and _code(over) == "tenant_prompt_limit_exceeded"
        text_over = await _send(ing, {**TEXT, "prompt": "abc"})  # text: judged once counted
        assert text_over.status_code == 400 and _code(text_over) == "tenant_prompt_limit_exceeded"
        assert (await _send(ing, {**BODY, "prompt": [1]})).status_code == 200
        assert (await _send(ing, {**BODY, "prompt": [1]})).status_code == 429
        now[0] += 1.0  # not throttled: a malformed request is judged on its body
        salted = await _send(ing, {**BODY, "prompt": [1], "cache_salt": "x"})
        assert salted.status_code == 400 and _code(salted) == "client_cache_salt_not_allowed"
        rejections = ing.tenant_metrics.snapshot()["anonymous"]["rejections"]
        assert rejections == {"tenant_prompt_limit_exceeded": 2, "rate_limit_exceeded": 1}
        text = ing.tenant_metrics.prometheus_text()
        assert 'kvmesh_tenant_rejections_total{tenant="anonymous",reason="tenant_prompt_limit_exceeded"} 2' in text
        help_line = next(line for line in text.splitlines() if line.startswith("# HELP kvmesh_tenant_rejections"))
        assert "tenant_prompt_limit_exceeded" in help_line

    asyncio.run(run())


def test_a_throttled_tenant_is_refused_before_its_body_is_read_or_parsed():
    """Whatever its prompt, a tenant over its request rate gets its 429 without the ingress reading and
    parsing a body it would refuse anyway (up to max_body_bytes a request)."""

    async def run():
        now = [1000.0]
        ing = _limited(Limits(requests_per_s=1, burst_requests=1), now)
        assert (await _send(ing, TEXT)).status_code == 200
        reads = []
        req, _, receive = _request(b'{"model": "tiny", "prompt": ' + b"[1, " * 10_000)  # not even JSON

        async def counted_receive():
            reads.append(1)
            return await receive()

        req._receive = counted_receive
        refused = await ing._generate(req, "completion")
        assert refused.status_code == 429 and _code(refused) == "rate_limit_exceeded" and reads == []
        now[0] += 1.0
        bad = await _send(ing, {"model": "tiny"})  # not throttled: its body is judged
        assert bad.status_code == 400

        # an empty token budget is judged on the prompt's own count, as before: the exact Retry-After, and a
        # prompt no budget could ever admit is the 400 it always was, not a 429 to retry
        ing = _limited(Limits(tokens_per_min=600, max_prompt_tokens=600), now)
        assert (await _send(ing, {**BODY, "prompt": [1] * 600})).status_code == 200
        empty = await _send(ing, {**BODY, "prompt": [1] * 600})
        assert empty.status_code == 429 and empty.headers["retry-after"] == "60"
        too_long = await _send(ing, {**BODY, "prompt": [1] * 700})
        assert too_long.status_code == 400 and _code(too_long) == "tenant_prompt_limit_exceeded"

    asyncio.run(run())


def test_a_tenant_at_its_concurrency_limit_is_refused_before_tokenising_and_a_full_server_still_queues():
    """The tenant's own cap refuses at once; the server's global bound is a wait in the fair queue, not a
    refusal, so that request is tokenised and waits as before."""

    async def run():
        now = [1000.0]
        ing = _limited(Limits(max_concurrent=2), now, max_concurrent=3, queue_timeout_s=5)
        ing.engine = _Engine(hang=True)
        held = [asyncio.create_task(_send(ing, TEXT)) for _ in range(2)]
        await asyncio.sleep(0.02)
        assert ing.admission.active("anonymous") == 2 and ing.tokenizer.calls == 2
        refused = await _send(ing, TEXT)
        assert refused.status_code == 429 and _code(refused) == "concurrency_limit_exceeded"
        assert refused.headers["retry-after"] == "1" and ing.tokenizer.calls == 2
        other = Tenant("other", None, derive_salt(b"k" * 32, "other"), Limits())
        ing.admission.try_acquire(other, 1)  # the server is full now (3 of 3)
        ing._anonymous = Tenant("anonymous", None, derive_salt(b"k" * 32, "anonymous"), Limits(max_concurrent=3))
        queued = asyncio.create_task(_send(ing, TEXT))
        await asyncio.sleep(0.02)
        assert ing.tokenizer.calls == 3 and ing.admission.waiting("anonymous") == 1 and not queued.done()
        for task in (*held, queued):
            task.cancel()
        await asyncio.gather(*held, queued, return_exceptions=True)

    asyncio.run(run())


def _arriving(body: dict | bytes, delay_s: float = 0.01, hang: bool = False) -> Request:
    """A request whose body reaches the ingress `delay_s` after its headers, as over a network (or never)."""
    req, _, receive = _request(body)

    async def later():
        if hang:
            await asyncio.Event().wait()
        await asyncio.sleep(delay_s)
        return await receive()

    req._receive = later
    return req


class _SparseTokenizer(_CountingTokenizer):
    """One token per 1000 characters, counting its calls from any thread."""

    def __init__(self):
        import threading

        super().__init__()
        self.lock = threading.Lock()

    def encode(self, text, add_special_tokens=True):
        with self.lock:
            self.calls += 1
        return [0] * max(1, len(text) // 1000)


def test_forty_requests_at_once_from_a_tenant_limited_to_one_are_tokenised_once():
    """Each request takes its tenant's slot and a request token before its body is read: of 40 arriving
    together for a tenant allowed 1 at a time (burst 1), one is read and tokenised, 39 get their 429 first.
    A check that took nothing let all 40 through to the shared tokenizer."""

    async def run():
        now = [1000.0]
        ing = _limited(Limits(requests_per_s=1, burst_requests=1, max_concurrent=1), now)
        ing.tokenizer = _SparseTokenizer()
        ing.max_model_len = 16384  # room for the long text
        ing.engine = _Engine(hang=True)
        long = {**TEXT, "prompt": "a" * (ingress_module.LONG_PROMPT_CHARS + 1)}  # tokenised in the thread pool
        tasks = [asyncio.create_task(ing._generate(_arriving(long), "completion")) for _ in range(40)]
        await asyncio.sleep(0.1)
        refused = [t.result() for t in tasks if t.done()]
        assert len(refused) == 39 and all(r.status_code == 429 for r in refused)
        assert ing.tokenizer.calls == 1 and ing.admission.active("anonymous") == 1
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0

    asyncio.run(run())


class _FailingTokenizer(_CountingTokenizer):
    """Fails on the prompts named so: a tokenizer's own error (a 400) or a bug (an exception out)."""

    def encode(self, text, add_special_tokens=True):
        if text == "bad":
            raise ValueError("cannot encode")
        if text == "crash":
            raise RuntimeError("tokenizer bug")
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("seed", range(3))
def test_a_tenants_slot_comes_back_however_a_request_fails_before_or_after_admission(seed):
    """Rounds of requests at once, each ending one way at random: cancelled while its body is read, a body
    that is not JSON, a client salt, a tokenizer error or crash, a prompt over the tenant's limit, cancelled
    while the engine works (as soon as it holds its slot: the cancel may come as its body completes),
    answered. After each round nothing of the tenant's stays counted, and every cancelled request ended."""
    import random

    rng = random.Random(seed)
    paths = ["read_cancel", "bad_json", "salt", "tokenizer_error", "tokenizer_crash", "too_large", "engine_cancel"]
    paths.append("ok")

    def request(path: str) -> Request:
        if path == "read_cancel":
            return _arriving(TEXT, hang=True)
        if path == "bad_json":
            return _arriving(b"{not json")
        body = {**TEXT, "prompt": {"tokenizer_error": "bad", "tokenizer_crash": "crash"}.get(path, "abcd")}
        if path == "salt":
            body["cache_salt"] = "x"
        if path == "too_large":
            body["prompt"] = "a" * 40
        return _arriving(body)

    async def run():
        now = [1000.0]
        ing = _limited(Limits(max_concurrent=4, max_prompt_tokens=30), now)
        ing.tokenizer = _FailingTokenizer()
        for _ in range(25):
            chosen = [rng.choice(paths) for _ in range(rng.randint(1, 4))]
            ing.engine = _Engine(hang="engine_cancel" in chosen)
            if ing.engine.hang:
                chosen = [p if p != "ok" else "engine_cancel" for p in chosen]
            tasks = [asyncio.create_task(ing._generate(request(p), "completion")) for p in chosen]
            # every request that ends by itself has ended, and each of those held open holds its slot (however
            # long a busy machine takes: the deadline only ends a hang)
            holding = [p in ("read_cancel", "engine_cancel") for p in chosen]
            deadline = time.monotonic() + 60
            while not (
                all(t.done() for t, held in zip(tasks, holding, strict=True) if not held)
                and ing.admission.active("anonymous") == sum(holding)
            ):
                assert time.monotonic() < deadline, (chosen, ing.admission.active("anonymous"))
                await asyncio.sleep(0.01)
            for path, task in zip(chosen, tasks, strict=True):
                if path in ("read_cancel", "engine_cancel"):
                    task.cancel()
            async with asyncio.timeout(60):  # a cancel the ingress dropped leaves its request waiting for good
                results = await asyncio.gather(*tasks, return_exceptions=True)
            for path, result in zip(chosen, results, strict=True):
                if path in ("read_cancel", "engine_cancel"):
                    assert isinstance(result, asyncio.CancelledError), (path, result)
                elif path == "tokenizer_crash":
                    assert isinstance(result, RuntimeError), (path, result)
                else:
                    assert result.status_code == (200 if path == "ok" else 400), (path, result.body)
            state = ing.admission._tenants["anonymous"]
            assert (state.active, state.reserved, ing.admission.in_flight) == (0, 0, 0), chosen

    asyncio.run(run())


# --- TTFT: unary and streamed requests measured alike ---------------------------------------------------


def _ttft_sum(ing) -> float:
    return ing.serving_metrics.total.ttft_sum


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_ttft_counts_what_the_request_waited_before_the_engine_as_a_stream_does(stream):
    """Routing, Serve's queue, router holds and failed replicas all come before the engine's first output:
    the client waits for them either way, and both kinds of request feed one histogram. The fake engine's
    call takes 0.4 s, of which it spent 0.1 s after its first output (a unary answer waits for all of it)."""

    async def run():
        ing = _ingress()

        async def generate_full(request: dict) -> dict:
            await asyncio.sleep(0.4)
            return {**_chunk("ab", [5, 6], "length"), "ttft_s": 0.01, "after_first_output_s": 0.1}

        class _Late(_Stream):
            async def __anext__(self) -> dict:
                if len(self.chunks) == 2:
                    await asyncio.sleep(0.3)
                else:
                    await asyncio.sleep(0.1)
                return await super().__anext__()

        ing.engine.generate_full = _Method(generate_full)
        ing.engine.generate = _Method(lambda request: _Late(False))
        response = await _answered(ing, stream)
        assert response.status_code == 200
        assert ing.serving_metrics.total.ttft_count == 1
        assert 0.29 <= _ttft_sum(ing) < 0.38, _ttft_sum(ing)
        assert ing.tenant_metrics.snapshot()["anonymous"]["ttft_mean_s"] == pytest.approx(_ttft_sum(ing))

    asyncio.run(run())


def test_an_engine_that_does_not_say_its_time_after_the_first_output_keeps_the_older_measure():
    unary_ttft = ingress_module.Ingress.func_or_class._generate.__globals__["_unary_ttft"]  # type: ignore[attr-defined]
    assert unary_ttft(10.0, 10.5, 13.0, {"ttft_s": 0.25}) == pytest.approx(0.75)
    assert unary_ttft(10.0, 10.5, 13.0, {"ttft_s": 0.25, "after_first_output_s": 1.0}) == pytest.approx(2.0)


def test_a_stream_continued_on_another_replica_counts_in_the_totals_only():
    """Its prompt was cached on one replica and its tokens generated on two: crediting either replica with
    the whole answer is wrong, and the first one's row would come back after the router forgot it."""

    async def run():
        ing = _ingress()

        class _OnR1(_Stream):
            def __init__(self, hang: bool):
                super().__init__(hang)
                self.chunks = [{**c, "replica": "r1"} for c in self.chunks]

        opened: list[dict] = []

        def generate(request: dict) -> _Stream:
            opened.append(request)
            return _DiesAfterOneChunk(False) if len(opened) == 1 else _OnR1(False)

        ing.engine.generate = _Method(generate)

        async def send(message):
            pass

        req, scope, receive = _request({**BODY, "stream": True})
        response = await ing._generate(req, "completion")
        await response(scope, receive, send)
        assert len(opened) == 2 and response.headers["x-kvmesh-replica"] == "r0"
        assert ing.serving_metrics.total.requests == 1 and ing.serving_metrics.per_replica == {}
        req, scope, receive = _request({**BODY, "stream": True})  # one replica, start to end: its own row
        response = await ing._generate(req, "completion")
        await response(scope, receive, send)
        assert set(ing.serving_metrics.per_replica) == {"r1"}

    asyncio.run(run())


def test_a_client_that_hangs_up_mid_body_is_a_499_logged_without_a_traceback(caplog):
    """The client closed its connection while sending the body: nobody to answer; it was an ERROR with a
    traceback each time (a client could flood the log)."""

    async def run():
        ing = _ingress()
        messages = [{"type": "http.request", "body": b'{"model": "tiny", "pro', "more_body": True}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        with caplog.at_level("INFO"):
            answer = await asyncio.wait_for(ing._generate(Request(scope, receive), "completion"), 5)
        assert answer.status_code == 499 and _code(answer) == "client_closed_request"
        assert ing.admission.in_flight == 0
        assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info], caplog.text

    asyncio.run(run())


def test_stop_token_ids_outside_the_vocabulary_are_a_400_before_the_engine():
    """vLLM refuses them only once the request reached an engine, with an error of its own that was a 500."""
    ing = _ingress()
    with _client(ing) as c:
        for ids in ([999_999], [-5], [10**30]):
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stop_token_ids": ids}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, (ids, r.text)
            assert r.json()["error"]["param"] == "stop_token_ids" and r.json()["error"]["code"] == "invalid_token_id"


def test_vllms_own_client_errors_are_a_400_naming_their_parameter_or_a_404():
    from ray.exceptions import RayTaskError
    from vllm.exceptions import VLLMNotFoundError, VLLMValidationError

    err = ingress_module._engine_error(VLLMValidationError("bad stop token", parameter="stop_token_ids", value=7))
    assert err is not None and err.status == 400 and err.body()["error"]["param"] == "stop_token_ids"
    assert ingress_module._engine_error(RuntimeError("engine died")) is None
    # as Ray raises it from the engine replica: its text is a traceback whose last line names the class
    trace = (
        'Traceback (most recent call last):\n  File "x.py", line 1\nvllm.exceptions.VLLMValidationError: no such thing'
    )
    wrapped = RayTaskError("generate", trace, VLLMValidationError("no such thing")).as_instanceof_cause()
    err = ingress_module._engine_error(wrapped)
    assert err is not None and err.status == 400 and err.body()["error"]["message"] == "no such thing"
    err = ingress_module._engine_error(VLLMNotFoundError("The model does not exist."))
    assert err is not None and err.status == 404


def test_the_engine_error_check_never_imports_vllm_on_the_ingress_loop(monkeypatch):
    """Such an error cannot exist unless vLLM's exceptions module is loaded; importing it stalled the loop 1.5 s."""
    import sys

    monkeypatch.delitem(sys.modules, "vllm.exceptions", raising=False)
    monkeypatch.setattr("builtins.__import__", _refusing_vllm(__import__))
    assert ingress_module._engine_error(RuntimeError("engine died")) is None


def _refusing_vllm(real_import):
    def guarded(name, *args, **kwargs):
        assert not name.startswith("vllm"), f"imported {name}"
        return real_import(name, *args, **kwargs)

    return guarded


def test_an_unknown_model_name_json_cannot_encode_is_a_404_not_a_500():
    ing = _ingress()
    with _client(ing) as c:
        r = c.post(
            "/v1/completions",
            content=b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 3}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "\\ud800" in r.json()["error"]["message"]


def test_two_authorization_headers_are_refused_not_the_first_taken():
    """A gateway in front checking the other copy would disagree with kvmesh on who is calling."""
    from starlette.requests import Request as StarletteRequest

    ing = _ingress()
    ing.registry = TenantRegistry.one_tenant(["good-key-0123456789"])
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "query_string": b"",
        "headers": [(b"authorization", b"Bearer good-key-0123456789"), (b"authorization", b"Bearer wrong")],
    }
    with pytest.raises(KvmeshHTTPError) as caught:
        ing._auth(StarletteRequest(scope))
    assert caught.value.status == 401 and "Several Authorization headers" in str(caught.value.body())
    scope["headers"] = scope["headers"][:1]
    assert ing._auth(StarletteRequest(scope)).id == ing.registry.authenticate("Bearer good-key-0123456789").id


def test_the_vocabulary_bound_is_the_models_where_it_outnumbers_the_tokenizer(tmp_path):
    """vLLM takes ids below the model's vocab_size (padded embeddings: Qwen2.5's tokenizer has 151,665 entries,
    its model 151,936); the ingress bounded stop ids by the tokenizer's count and refused valid ones."""
    assert ingress_module.model_vocab_size(str(tmp_path)) == 0  # no config.json
    (tmp_path / "config.json").write_text('{"vocab_size": 151936}')
    assert ingress_module.model_vocab_size(str(tmp_path)) == 151936
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 1088}}')
    assert ingress_module.model_vocab_size(str(tmp_path)) == 1088
    (tmp_path / "config.json").write_text('{"vocab_size": true}')
    assert ingress_module.model_vocab_size(str(tmp_path)) == 0


def test_a_huge_out_of_range_token_id_is_named_cut_not_echoed_whole():
    """A 4,300-digit id came back whole in the message, stop id or prompt id."""
    ing = _ingress()
    huge = 10**4299
    with _client(ing) as c:
        for body in (
            {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stop_token_ids": [huge]},
            {"model": "tiny", "prompt": [1, huge], "max_tokens": 4},
        ):
            r = c.post(
                "/v1/completions", content=json.dumps(body).encode(), headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and len(r.json()["error"]["message"]) < 300, r.text[:300]
            assert "4,300 digits" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("completion", {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 62}),
        ("chat", {**CHAT, "max_tokens": 64}),
        ("chat", {**CHAT, "max_completion_tokens": 63, "max_tokens": 1}),
    ],
)
def test_max_tokens_beyond_what_the_prompt_leaves_is_trimmed_as_vllm_does(kind, body, stream):
    """vLLM's get_max_tokens: min(the client's max_tokens, the context less the prompt), not a 400."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    ing.max_model_len = 64
    status, _ = _answer(ing, {**body, "stream": stream}, kind)
    assert status == 200
    sent = ing.engine.requests[0]
    assert sent["params"]["max_tokens"] == 64 - len(sent["prompt_token_ids"])


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 65}, "max_tokens"),
        ("chat", {**CHAT, "max_tokens": 65}, "max_tokens"),
        ("chat", {**CHAT, "max_completion_tokens": 65, "max_tokens": 2}, "max_completion_tokens"),
    ],
)
def test_max_tokens_beyond_the_whole_context_is_a_400_naming_its_field(kind, body, param):
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    ing.max_model_len = 64
    status, answer = _answer(ing, body, kind)
    assert status == 400 and answer["error"]["param"] == param and not ing.engine.requests
    assert not ing.tokenizer.calls  # refused before tokenising, as vLLM's TokenizeParams


def test_min_tokens_is_judged_against_the_trimmed_max_tokens():
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    ing.max_model_len = 64
    status, body = _answer(ing, {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 64, "min_tokens": 61})
    assert status == 400 and body["error"]["param"] == "min_tokens" and not ing.engine.requests
    status, _ = _answer(ing, {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 64, "min_tokens": 60})
    assert status == 200 and ing.engine.requests[0]["params"]["max_tokens"] == 60


@pytest.mark.parametrize("model", [None, "", "leave out"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_request_that_names_no_model_is_served_by_the_one_model_and_names_it(kind, model):
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    body = dict(BODY if kind == "completion" else CHAT)
    if model == "leave out":
        del body["model"]
    else:
        body["model"] = model
    status, answer = _answer(ing, body, kind)
    assert status == 200 and answer["model"] == "tiny"
    status, text = _answer(ing, {**body, "stream": True}, kind)
    assert status == 200 and '"model":"tiny"' in text.splitlines()[0]


# --- chats rendered, and their output length chosen, as vLLM 0.32's own server does ----------------------------


def _tiny_path():
    import tempfile
    from pathlib import Path

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")


@pytest.fixture(scope="module")
def vllm_renderer():
    """vLLM's own renderer for the tiny model (its CPU-only render path: no engine)."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers import renderer_from_config

    model_config = ModelConfig(model=str(_tiny_path()), max_model_len=4096)
    return model_config, renderer_from_config(VllmConfig(model_config=model_config))


def _vllm_prompt_ids(vllm_renderer, body: dict, template: str | None) -> list[int]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer

    model_config, renderer = vllm_renderer
    online = OnlineRenderer(
        model_config=model_config,
        renderer=renderer,
        request_logger=None,
        chat_template=template,
        chat_template_content_format="auto",  # vLLM's server default
    )
    rendered = asyncio.run(online.render_chat(ChatCompletionRequest(**body)))
    assert isinstance(rendered, tuple), rendered
    return rendered[1][0]["prompt_token_ids"]


# a template that knows the developer role
DEVELOPER_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'developer' %}{{ '<|dev|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' }}{% endif %}{{ message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Qwen3's switch on the tiny model's role markers
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ 'no thinking' }}{% endif %}{% endif %}"
)
_PARTS = [{"type": "text", "text": "Context: x. "}, {"type": "text", "text": " Question: y?"}]
_EMPTY_PART = [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]


def _turn(role: str):
    return lambda content: {"role": role, "content": content}


_S, _D, _U, _A = (_turn(role) for role in ("system", "developer", "user", "assistant"))
_BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cch=4f2a9;"
# a template that renders an assistant's reasoning (as Qwen3's does, by `reasoning_content`) and a message's task
REASONING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{% if message.reasoning is defined and message.reasoning is not none %}{{ '<r>' + message.reasoning }}{% endif %}"
    "{% if message.task is defined %}{{ '[' + message.task + ']' }}{% endif %}"
    "{{ message['content'] + '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# a template that shows each content part whole, as a template reading a part's other keys would see it
JSON_PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% for p in message['content'] %}{{ p | tojson }}{% endfor %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_RENDER_CASES = [
    # the developer role: as `system` for a template that does not know it, every system message merged first
    (None, [_D("be terse"), _U("hi")]),
    (None, [_S("A"), _D("B"), _U("hi")]),
    (None, [_U("hi"), _D("B")]),
    (None, [_S(""), _S("S"), _D("D")]),
    (PARTS_TEMPLATE, [_S(_PARTS), _U("hi"), _D("B")]),
    # ... and as itself for one that does
    (DEVELOPER_TEMPLATE, [_D("be terse"), _U("hi")]),
    (DEVELOPER_TEMPLATE, [_S("A"), _D("B"), _U("hi")]),
    (DEVELOPER_TEMPLATE, [_U("hi"), _D("B")]),
    # text parts: the list for a template that loops over them, joined by newlines for one that takes a string
    (PARTS_TEMPLATE, [_U(_PARTS)]),
    (PARTS_TEMPLATE, [_U("plain"), _A(""), _U(_PARTS)]),
    (None, [_U(_PARTS)]),
    # an assistant's null content: an empty turn
    (None, [_U("hi"), _A(None), _U("x")]),
    (PARTS_TEMPLATE, [_U("hi"), _A(None), _U("x")]),
    # an assistant's reasoning reaches the template (as `reasoning` and `reasoning_content`), a null one does not,
    # and any role's string `task` does; another role's reasoning and a task that is not a string are left out
    (REASONING_TEMPLATE, [_U("hi"), {**_A("a"), "reasoning": "think"}, _U("x")]),
    (REASONING_TEMPLATE, [_U("hi"), {**_A("a"), "reasoning": None}, _U("x")]),
    (REASONING_TEMPLATE, [_U("hi"), {**_A(None), "reasoning": ""}, _U("x")]),
    (REASONING_TEMPLATE, [{**_S("s"), "task": "t1"}, {**_U("hi"), "task": "t2"}, {**_A("a"), "task": "t3"}]),
    (REASONING_TEMPLATE, [{**_U("hi"), "reasoning": "mine"}, {**_A("a"), "task": None}]),
    (REASONING_TEMPLATE, [_U("hi"), {**_A("a"), "reasoning_content": "old name"}, _U("x")]),
    (REASONING_TEMPLATE, [_U("hi"), {**_A("a"), "reasoning": "new", "reasoning_content": "old"}, _U("x")]),
    (REASONING_TEMPLATE, [{**_S("A"), "task": "t1"}, {**_D("B"), "task": "t2"}, _U("hi")]),
    # a text part's other keys (Anthropic-style `cache_control`) change nothing, as on vLLM's server
    (None, [_U([{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}])]),
    (PARTS_TEMPLATE, [_S([{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]), _U("hi")]),
    # a message without a content key, any role: an empty turn
    (None, [{"role": "system"}, _U("hi"), {"role": "assistant"}, {"role": "user"}]),
    (None, [_S("A"), {"role": "developer"}, _U("hi")]),
    (PARTS_TEMPLATE, [_U("hi"), {"role": "assistant"}, {"role": "user"}]),
    # empty text parts: dropped before the parts are joined for a string template, kept as parts for one that
    # loops over them, and kept when a system message's parts are joined to be merged
    (None, [_U(_EMPTY_PART)]),
    (None, [_U([{"type": "text", "text": ""}, {"type": "text", "text": ""}])]),
    (None, [_S(_EMPTY_PART), _U("hi"), _D("B")]),
    (PARTS_TEMPLATE, [_U(_EMPTY_PART)]),
    (PARTS_TEMPLATE, [_S(_EMPTY_PART), _U("hi"), _D("B")]),
    # Claude Code's attribution line (new on every request) leaves a system message's text, and only a system's
    (None, [_S(_BILLING + "\nYou are a coding agent."), _U("hi")]),
    (None, [_S([{"type": "text", "text": _BILLING}, {"type": "text", "text": "Rules."}]), _U("hi")]),
    (PARTS_TEMPLATE, [_S([{"type": "text", "text": _BILLING + "\nA"}, {"type": "text", "text": "B"}]), _U("hi")]),
    (None, [_S("Rules.\n" + _BILLING), _U(_BILLING + "\nhi"), _D(_BILLING + "\nB")]),
    (DEVELOPER_TEMPLATE, [_D(_BILLING + "\nB"), _U("hi")]),
    # vLLM's other text parts: refusals, thinking, plain strings; a part's own keys a template may read
    (None, [_U([{"type": "refusal", "refusal": "no"}, "plain", {"type": "thinking", "thinking": "t"}])]),
    (PARTS_TEMPLATE, [_U([{"type": "refusal", "refusal": "no"}, "plain", {"type": "thinking", "thinking": "t"}])]),
    (None, [_S([{"type": "refusal", "refusal": _BILLING + "\nkept: not a text part"}]), _U("hi")]),
    (JSON_PARTS_TEMPLATE, [_U([{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}, "name": "n"}])]),
    (JSON_PARTS_TEMPLATE, [_U([{"type": "thinking", "thinking": "t", "closed": True, "signature": "s"}])]),
    (JSON_PARTS_TEMPLATE, [_S([{"type": "text", "text": _BILLING + "\nA", "cache_control": {}}]), _U("hi")]),
]
# a template that shows what a tool-using template reads: the tools, and each message whole
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|tools|>' + tools | tojson }}{% endif %}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message | tojson + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x", "n": 2}'}}
_TOOL = {"type": "function", "function": {"name": "lookup", "description": "finds", "parameters": {"type": "object"}}}
_TOOL_CASES = [
    # a conversation with a tool call and its answer
    {"messages": [_U("q"), {**_A(None), "tool_calls": [_CALL]}, {"role": "tool", "content": "r", "tool_call_id": "c"}]},
    # arguments that are not an object, not JSON or empty; a call's own keys; an empty list of calls
    {
        "messages": [
            _U("q"),
            {
                "role": "assistant",
                "tool_calls": [
                    {**_CALL, "function": {"name": "f", "arguments": "[1]"}},
                    {**_CALL, "function": {"name": "f", "arguments": "not json", "extra": 1}, "more": True},
                    {**_CALL, "function": {"name": "f", "arguments": ""}},
                ],
            },
            {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}], "name": "n"},
            {**_A("done"), "tool_calls": []},
        ]
    },
    {"messages": [{"role": "tool"}, {**_A("a"), "tool_calls": [_CALL], "reasoning": "r", "name": "x", "task": "t"}]},
    # tools: vLLM's dump of each (unknown keys dropped, strict and defer_loading only when given)
    {"messages": [_U("q")], "tools": [_TOOL], "tool_choice": "none"},
    {
        "messages": [_U("q")],
        "tools": [{"function": {"name": "f", "strict": True, "x": 1}, "defer_loading": True, "y": 2}],
        "tool_choice": "none",
    },
]


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, PARTS_TEMPLATE, None])
@pytest.mark.parametrize("body", _TOOL_CASES)
def test_tools_and_tool_messages_are_rendered_as_vllms_own_server_renders_them(vllm_renderer, template, body):
    body = {"model": "tiny", **body}
    served = _ingress_prompt_ids(body, template)
    assert served == _vllm_prompt_ids(vllm_renderer, body, template)
    assert _replayed_prompt_ids(body, template) == (served, served)


# a template that shows the settings a request may give it: documents, a reasoning effort, thinking switched off
SETTINGS_TEMPLATE = (
    "{{ bos_token }}{% if documents %}{{ '<|docs|>' + documents | tojson }}{% endif %}"
    "{% if reasoning_effort is defined %}{{ '<|effort|>' + reasoning_effort }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ 'no thinking' }}{% endif %}{% endif %}"
)
_SETTINGS_CASES = [
    {"messages": [_U("q"), _A("Well,")], "add_generation_prompt": False},
    # the assistant's last message left open: the answer continues it
    {"messages": [_U("q"), _A("Well,")], "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [_U("q")], "documents": [{"title": "t", "text": "x"}]},
    {"messages": [_U("q")], "documents": [{"title": "t"}], "chat_template_kwargs": {"documents": [{"title": "o"}]}},
    {"messages": [_U("q")], "chat_template_kwargs": {"documents": [{"title": "kwargs'"}]}},
    {"messages": [_U("q")], "reasoning_effort": "none"},
    {"messages": [_U("q")], "reasoning_effort": "high"},
    {"messages": [_U("q")], "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [_U("q")], "add_special_tokens": True},
    {"messages": [_U("q")], "chat_template_kwargs": {"add_generation_prompt": False}},  # the request's own wins
]


@pytest.mark.parametrize("template", [SETTINGS_TEMPLATE, None])
@pytest.mark.parametrize("body", _SETTINGS_CASES)
def test_a_chats_template_settings_are_rendered_as_vllms_own_server_renders_them(vllm_renderer, template, body):
    """vLLM's `add_generation_prompt`, `continue_final_message`, `documents`, `reasoning_effort` (with its
    `enable_thinking`) and `add_special_tokens`: the prompt ids equal vLLM's own renderer's, and the request
    log's reader makes the same of the logged request."""
    body = {"model": "tiny", **body}
    served = _ingress_prompt_ids(body, template)
    assert served == _vllm_prompt_ids(vllm_renderer, body, template)
    assert _replayed_prompt_ids(body, template) == (served, served)
    if body.get("continue_final_message"):  # the open message is the prompt's end: no end marker, no header
        assert served == _ingress_prompt_ids({**body, "messages": [_U("q"), _A("Well,")]}, template)[: len(served)]


def test_a_chats_template_settings_given_wrongly_are_a_400():
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    for bad, param in [
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt, its default
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"documents": "x"}, "documents"),
        ({"documents": ["x"]}, "documents"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"add_special_tokens": 1}, "add_special_tokens"),
    ]:
        status, answer = _answer(ing, {**CHAT, **bad}, "chat")
        assert status == 400 and answer["error"]["param"] == param, (bad, answer)
    assert not ing.engine.requests


def _ingress_prompt_ids(body: dict, template: str | None) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tiny_path())
    if template is not None:
        tok.chat_template = template
    ing = _ingress(tokenizer=tok)
    ing.vocab_size = len(tok)
    ing.engine = _RecordingEngine()
    status, answer = _answer(ing, body, "chat")
    assert status == 200, answer
    return ing.engine.requests[-1]["prompt_token_ids"]


def _replayed_prompt_ids(body: dict, template: str | None) -> tuple[list[int], list[int]]:
    """The prompt the request log's reader makes of the same request, with and without its fast renderer."""
    from transformers import AutoTokenizer

    from kvmesh.cluster.request_log import CHAT, ChatRenderer, LoggedRequest, prompt_ids, prompt_text

    tok = AutoTokenizer.from_pretrained(_tiny_path())
    if template is not None:
        tok.chat_template = template
    logged = LoggedRequest("r", body, CHAT)
    render = ChatRenderer(tok, verify=0)
    fast = tok.encode(prompt_text(logged, tok, render), add_special_tokens=False)
    return prompt_ids(logged, tok), fast


@pytest.mark.parametrize(("template", "messages"), _RENDER_CASES)
def test_a_chat_is_rendered_as_vllms_own_server_renders_it_and_a_replay_of_its_log_too(
    vllm_renderer, template, messages
):
    """The prompt ids the ingress sends the engine are the ones vLLM's server makes of the same request (its
    developer-role rule, its content format detection, its null assistant content), and the request log's
    reader renders the same (so a replay's predictions are about the prompts the ingress serves)."""
    body = {"model": "tiny", "messages": messages}
    served = _ingress_prompt_ids(body, template)
    assert served == _vllm_prompt_ids(vllm_renderer, body, template)
    assert _replayed_prompt_ids(body, template) == (served, served)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_thinking": False},
        {"enable_thinking": True},
        {"enable_thinking": None},  # left out, as vLLM leaves it out
        {"enable_thinking": False, "add_generation_prompt": False},  # vLLM's request field wins: still added
    ],
)
def test_chat_template_kwargs_reach_the_template_as_on_vllms_own_server(vllm_renderer, kwargs):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    served = _ingress_prompt_ids(body, THINKING_TEMPLATE)
    assert served == _vllm_prompt_ids(vllm_renderer, body, THINKING_TEMPLATE)
    assert _replayed_prompt_ids(body, THINKING_TEMPLATE) == (served, served)
    plain = _ingress_prompt_ids({**body, "chat_template_kwargs": {}}, THINKING_TEMPLATE)
    assert (served != plain) == (kwargs.get("enable_thinking") is False)


# a template that renders the variables chat_template_kwargs can set, and the documents
VARIABLES_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if documents %}{% for d in documents %}{{ '<|doc|>' + d['text'] | tojson }}{% endfor %}{% endif %}"
    "{% if padding is defined %}{{ 'padding ' ~ padding }}{% endif %}{% if flag is defined %}{{ flag }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"padding": True},  # apply_chat_template's own: no variable, and nothing when it renders text
        {"truncation": True, "max_length": "x", "return_tensors": "pt", "return_dict": True},
        {"tokenize": True, "padding": True},
        {"documents": [{"title": "t", "text": "a < b & 'c'"}]},
        {"documents": []},
        {"flag": "<&>", "bos_token": "<b>"},
    ],
)
def test_apply_chat_template_arguments_in_chat_template_kwargs_render_as_on_vllms_own_server(vllm_renderer, kwargs):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    served = _ingress_prompt_ids(body, VARIABLES_TEMPLATE)
    assert served == _vllm_prompt_ids(vllm_renderer, body, VARIABLES_TEMPLATE)
    assert _replayed_prompt_ids(body, VARIABLES_TEMPLATE) == (served, served)


@pytest.mark.parametrize(
    "kwargs", [{"messages": []}, {"documents": 5}, {"documents": "x"}, {"documents": [1]}, {"conversations": []}]
)
def test_chat_template_kwargs_the_template_call_fails_on_are_a_400_as_on_vllms_own_server(vllm_renderer, kwargs):
    """vLLM's server answers these with a 400 (its safe_apply_chat_template); the ingress refuses them before the
    template runs, and the request log's reader refuses the line."""
    from transformers import AutoTokenizer

    from kvmesh.cluster.request_log import RequestLogError, parse_line

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    template = VARIABLES_TEMPLATE.replace("{% if flag", "{% if conversations is defined %}x{% endif %}{% if flag")
    with pytest.raises(Exception, match="multiple values|Documents should be|not iterable"):
        _vllm_prompt_ids(vllm_renderer, body, template)
    tok = AutoTokenizer.from_pretrained(_tiny_path())
    tok.chat_template = template
    ing = _ingress(tokenizer=tok)
    ing.vocab_size = len(tok)
    ing.engine = _RecordingEngine()
    status, answer = _answer(ing, body, "chat")
    assert status == 400 and answer["error"]["param"].startswith("chat_template_kwargs."), answer
    with pytest.raises(RequestLogError, match="log.jsonl line 3: 'chat_template_kwargs"):
        parse_line(json.dumps({"body": body}), "log.jsonl", 3)


def test_a_chat_without_max_tokens_gets_the_models_default_output_length_as_on_vllm(tmp_path):
    """A model whose generation_config.json sets max_new_tokens: vLLM's server caps a chat that names no
    max_tokens at it (get_max_tokens' fallback to the model's sampling defaults), a request's own max_tokens
    wins, and both stay within the context the prompt leaves; a completion's default is its own 16."""
    import shutil

    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    model = tmp_path / "model"
    shutil.copytree(_tiny_path(), model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 24, "temperature": 0.6}))
    diff = ModelConfig(model=str(model), max_model_len=4096).get_diff_sampling_param()
    assert ingress_module.model_default_max_tokens(str(model)) == diff["max_tokens"] == 24
    assert ingress_module.model_default_max_tokens(str(_tiny_path())) is None  # the tiny model sets none

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    ing.default_max_tokens = ingress_module.model_default_max_tokens(str(model))
    cases = [
        ("chat", {}),
        ("chat", {"max_tokens": 100}),
        ("chat", {"max_completion_tokens": 5}),
        ("chat", {"max_tokens": None}),
        ("completion", {}),
        ("completion", {"max_tokens": 40}),
    ]
    for max_model_len in (4096, 30):  # a context that leaves less than the default
        ing.max_model_len = max_model_len
        for kind, extra in cases:
            body = {**(CHAT if kind == "chat" else {"model": "tiny", "prompt": "hello"}), **extra}
            if max_model_len == 30 and any(v and v > 30 for v in extra.values()):
                continue  # beyond the whole context: a 400 on both servers
            status, answer = _answer(ing, body, kind)
            assert status == 200, answer
            sent = ing.engine.requests[-1]
            vllm_request = ChatCompletionRequest(**body) if kind == "chat" else CompletionRequest(**body)
            asked = getattr(vllm_request, "max_completion_tokens", None)
            asked = vllm_request.max_tokens if asked is None else asked
            expected = get_max_tokens(max_model_len, asked, len(sent["prompt_token_ids"]), diff, None)
            assert sent["params"]["max_tokens"] == expected, (max_model_len, kind, extra)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_put_the_running_usage_in_every_chunk_as_vllm_does(kind, include_usage):
    """`stream_options.continuous_usage_stats` with include_usage: each chunk carries the usage so far, in vLLM's
    chunk shape; without include_usage vLLM ignores it, and so does the ingress."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    body = {**(CHAT if kind == "chat" else {"model": "tiny", "prompt": "hello"}), "stream": True}
    status, sse = _answer(ing, {**body, "stream_options": options}, kind)
    assert status == 200
    events = _events(sse)
    prompt = len(ing.engine.requests[-1]["prompt_token_ids"])
    chunks = [e for e in events if e["choices"]]
    if not include_usage:
        assert all("usage" not in e for e in events)
        return
    assert len(chunks) == 2 and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    for so_far, event in enumerate(chunks, start=1):  # the fake engine sends one token per chunk
        # vLLM's own chunk of the same usage, as its server writes it
        if kind == "chat":
            theirs = ChatCompletionStreamResponse(id="x", created=0, model="tiny", choices=[])
            theirs.usage = UsageInfo(
                prompt_tokens=prompt,
                completion_tokens=so_far,
                total_tokens=prompt + so_far,
                completion_tokens_details=None,
            )
        else:
            theirs = CompletionStreamResponse(id="x", created=0, model="tiny", choices=[])
            theirs.usage = UsageInfo(prompt_tokens=prompt, completion_tokens=so_far, total_tokens=prompt + so_far)
        assert event["usage"] == json.loads(theirs.model_dump_json(exclude_unset=True))["usage"]


# --- tool calls parsed from an answer by vLLM's own parser -----------------------------------------------------

_LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}
TOOL_CHAT = {**CHAT, "tools": [_LOOKUP]}
# parser -> an answer in its model family's form, with two calls, and the content vLLM's parser leaves beside them
_CALL_TEXTS = {
    "hermes": (
        'Sure. <tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
        '<tool_call>\n{"name": "lookup", "arguments": {"q": "y"}}\n</tool_call>'
    ),
    "pythonic": '[lookup(q="x"), lookup(q="y")]',
}


class _ScriptedEngine(_RecordingEngine):
    """Answers with `text` (the tiny model's token ids of it): whole, or a chunk per token, ending with `stop`."""

    def __init__(self, tok, text: str):
        super().__init__(finish="stop")
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.decode(ids[: k + 1])[len(tok.decode(ids[:k])) :] for k in range(len(ids))]

        async def generate_full(request: dict) -> dict:
            self.requests.append(request)
            return {**_chunk(text, ids, "stop"), "ttft_s": 0.0}

        def generate(request: dict) -> _Stream:
            self.requests.append(request)
            stream = _Stream(False)
            last = len(ids) - 1
            stream.chunks = [_chunk(p, [t], "stop" if k == last else None) for k, (p, t) in enumerate(zip(pieces, ids))]
            return stream

        self.generate_full = _Method(generate_full)
        self.generate = _Method(generate)


def _tool_ingress(parser: str | None, text: str):
    from transformers import AutoTokenizer

    from kvmesh.deployments.tool_calls import ToolCallParsing

    tok = AutoTokenizer.from_pretrained(_tiny_path())
    ing = _ingress(tokenizer=tok)
    ing.vocab_size = len(tok)
    ing.engine = _ScriptedEngine(tok, text)
    ing.tool_parsing = ToolCallParsing(parser, tok, "tiny") if parser else None
    return ing, tok


def _vllms_reading(tok, parser: str, body: dict, text: str):
    """vLLM's parser on the same answer, called as vLLM's chat server calls it: (content, [(name, arguments)])."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    request = ChatCompletionRequest(**body)
    cls = ParserManager.get_parser(tool_parser_name=parser, enable_auto_tools=True, tokenizer=tok)
    _, content, calls = cls(tok, request.tools).parse(text, request, enable_auto_tools=True)
    return content, [(c.name, c.arguments) for c in calls or ()]


def _streamed(events: list[dict]) -> tuple[str | None, list[tuple[str, str]], str]:
    """A streamed chat's content, calls (name, arguments joined by index) and last finish_reason."""
    content, names, args, finish = None, {}, {}, None
    for e in events:
        for choice in e["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for call in delta.get("tool_calls") or ():
                if call.get("function", {}).get("name"):
                    names[call["index"]] = call["function"]["name"]
                    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                args[call["index"]] = args.get(call["index"], "") + (call.get("function", {}).get("arguments") or "")
            finish = choice["finish_reason"] or finish
    return content, [(names[k], args[k]) for k in sorted(names)], finish


@pytest.mark.parametrize("parser", sorted(_CALL_TEXTS))
@pytest.mark.parametrize("parallel", [None, False])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answers_tool_calls_are_the_ones_vllms_parser_reads(parser, parallel, stream):
    """With a parser named, a chat with tools gets the calls vLLM's chat server would give for the same text:
    whole or streamed, `finish_reason` tool_calls, the content left beside them, only the first call when
    `parallel_tool_calls` is false."""
    text = _CALL_TEXTS[parser]
    ing, tok = _tool_ingress(parser, text)
    body = {**TOOL_CHAT, "stream": stream}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    status, answer = _answer(ing, body, "chat")
    assert status == 200, answer
    # vLLM's server holds hermes to one call with a grammar (a structural tag): the engine gets it too
    grammar = ing.engine.requests[-1]["params"].get("structured_outputs")
    assert (grammar is not None and "structural_tag" in grammar) == (parser == "hermes" and parallel is False)
    content, calls = _vllms_reading(tok, parser, {k: v for k, v in body.items() if k != "stream"}, text)
    assert len(calls) == 2  # the answer calls twice
    if parallel is False:
        calls = calls[:1]
    if stream:
        got_content, got_calls, finish = _streamed(_events(answer))
        assert (got_content or None, finish) == (content or None, "tool_calls")
        assert [(n, json.loads(a)) for n, a in got_calls] == [(n, json.loads(a)) for n, a in calls]
        return
    choice = answer["choices"][0]
    message = choice["message"]
    assert (message["content"], choice["finish_reason"]) == (content, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in message["tool_calls"])


def test_a_parser_that_needs_special_tokens_in_the_text_gets_them_from_the_engine():
    """vLLM's hermes parser reads `<tool_call>` markers, so vLLM's server keeps special tokens in the text (its
    `adjust_request`): the engine is asked for them too; a chat without tools is not."""
    ing, _ = _tool_ingress("hermes", "plain answer")
    assert _answer(ing, TOOL_CHAT, "chat")[0] == 200
    assert ing.engine.requests[-1]["params"]["skip_special_tokens"] is False
    assert _answer(ing, CHAT, "chat")[0] == 200
    assert ing.engine.requests[-1]["params"].get("skip_special_tokens", True) is True


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_without_calls_and_a_chat_that_wants_none_are_text(stream):
    """No call in the answer: its text, the engine's finish_reason, no tool_calls; `tool_choice` none: the text
    as it is even where it reads as a call (vLLM's server does not parse it)."""
    for text, body in (("just words", TOOL_CHAT), (_CALL_TEXTS["pythonic"], {**TOOL_CHAT, "tool_choice": "none"})):
        ing, _ = _tool_ingress("pythonic", text)
        status, answer = _answer(ing, {**body, "stream": stream}, "chat")
        assert status == 200, answer
        if stream:
            assert _streamed(_events(answer)) == (text, [], "stop")
        else:
            assert answer["choices"][0]["message"] == {"role": "assistant", "content": text}
            assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "lookup"}}])
def test_a_tool_choice_without_a_parser_is_a_400_before_the_engine_is_asked(choice):
    """vLLM's server without --tool-call-parser refuses them too."""
    ing, _ = _tool_ingress(None, "x")
    status, answer = _answer(ing, {**TOOL_CHAT, "tool_choice": choice}, "chat")
    assert status == 400 and answer["error"]["param"] == "tool_choice"
    assert ing.engine.requests == []


_NAMED = {"type": "function", "function": {"name": "lookup"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("choice", "text", "finish"),
    [
        # "required": a JSON list of calls, finish_reason tool_calls; a named function: its arguments, "stop"
        (
            "required",
            '[{"name": "lookup", "parameters": {"q": "x"}}, {"name": "lookup", "parameters": {}}]',
            "tool_calls",
        ),
        (_NAMED, '{"q": "x"}', "stop"),
    ],
)
def test_a_required_or_named_tool_choice_is_decoded_under_vllms_grammar_and_read_as_its_calls(
    choice, text, finish, stream
):
    """As on vLLM's server with a parser: the engine decodes under the JSON schema vLLM makes of the tools
    (the same schema, as data), and the answer's calls are the ones vLLM's parser reads; the content is an
    empty string beside them."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    from kvmesh.deployments.structured_outputs import as_data

    ing, tok = _tool_ingress("pythonic", text)
    body = {**TOOL_CHAT, "tool_choice": choice}
    status, answer = _answer(ing, {**body, "stream": stream}, "chat")
    assert status == 200, answer
    request = ChatCompletionRequest(**body)
    cls = ParserManager.get_parser(tool_parser_name="pythonic", enable_auto_tools=True, tokenizer=tok)
    adjusted = cls(tok, request.tools).adjust_request(request)
    grammar = ing.engine.requests[-1]["params"]["structured_outputs"]
    assert grammar == as_data(adjusted.extract_structured_outputs()) and "json" in grammar
    _, _, calls = cls(tok, adjusted.tools).parse(text, adjusted, enable_auto_tools=True)
    expected = [(c.name, json.loads(c.arguments)) for c in calls]
    assert expected and expected[0] == ("lookup", {"q": "x"})
    if stream:
        content, got, last = _streamed(_events(answer))
        assert (content or "", [(n, json.loads(a)) for n, a in got], last) == ("", expected, finish)
        return
    choice_out = answer["choices"][0]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice_out["message"]["tool_calls"]]
    assert (choice_out["message"]["content"], got, choice_out["finish_reason"]) == ("", expected, finish)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object"}}}},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"regex": "[a-c]{3}"}},
        {"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "text"}},
    ],
)
def test_an_output_constraint_reaches_the_engine_as_vllms_server_reads_it(kind, extra):
    """`response_format` and vLLM's `structured_outputs` combine by vLLM's own rules (the response format wins),
    and the engine gets the result as data it builds vLLM's StructuredOutputsParams from."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from kvmesh.deployments.engine import EngineReplica
    from kvmesh.deployments.structured_outputs import as_data

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    body = {**(CHAT if kind == "chat" else {"model": "tiny", "prompt": "hello"}), **extra}
    status, answer = _answer(ing, body, kind)
    assert status == 200, answer
    params = ing.engine.requests[-1]["params"]
    vllm_request = ChatCompletionRequest(**body) if kind == "chat" else CompletionRequest(**body)
    assert params["structured_outputs"] == as_data(vllm_request.extract_structured_outputs())
    built = EngineReplica._sampling_params(SimpleNamespace(), params).structured_outputs
    assert built == vllm_request.extract_structured_outputs()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": ["json"]}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, None),  # one kind at most (vLLM's own check)
        ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, None),  # two, combined
    ],
)
def test_a_constraint_vllms_server_refuses_is_a_400_before_the_engine_is_asked(extra, param):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    status, answer = _answer(ing, {**CHAT, **extra}, "chat")
    assert status == 400 and not ing.engine.requests, answer
    if param is not None:
        assert answer["error"]["param"] == param
    with pytest.raises(Exception):  # noqa: B017 -- pydantic's ValidationError or vLLM's own
        ChatCompletionRequest(**{**CHAT, **extra}).extract_structured_outputs()


def test_a_parser_name_vllm_does_not_have_or_that_does_not_fit_the_model_is_refused_at_start():
    from transformers import AutoTokenizer

    from kvmesh.deployments.tool_calls import ToolCallParsing

    tok = AutoTokenizer.from_pretrained(_tiny_path())
    with pytest.raises(ValueError, match="unknown tool_call_parser 'hermess'.*hermes"):
        ToolCallParsing("hermess", tok)
    with pytest.raises(ValueError, match="llama3_json.*python_tag"):  # its marker is not in the tiny vocabulary
        ToolCallParsing("llama3_json", tok)


# --- log-probabilities, in vLLM's shapes -----------------------------------------------------------------------

# per token: (id, logprob, rank, decoded) rows in the engine's order (the sampled token first); the second has a
# token with no decoded text and one at minus infinity, the third none at all (text from the tokenizer)
_ROWS = [
    [(5, -0.25, 1, "ab"), (6, -1.5, 2, "c"), (7, -2.0, 3, "d")],
    [(9, -3.0, 2, None), (8, -0.5, 1, "x"), (4, float("-inf"), 3, "y")],
    [],
]
_ROW_IDS = [5, 9, 11]


class _LogprobEngine(_RecordingEngine):
    """Answers three tokens with `_ROWS` as their log-probabilities (a chunk per token when streaming)."""

    def __init__(self):
        super().__init__(finish="length")

        async def generate_full(request: dict) -> dict:
            self.requests.append(request)
            return {**_chunk("ab?z", _ROW_IDS, "length"), "logprobs": _ROWS, "ttft_s": 0.0}

        def generate(request: dict) -> _Stream:
            self.requests.append(request)
            stream = _Stream(False)
            pieces = [("ab", None), ("", None), ("?z", "length")]
            stream.chunks = [
                {**_chunk(text, [tid], finish), "logprobs": [row]}
                for (text, finish), tid, row in zip(pieces, _ROW_IDS, _ROWS)
            ]
            return stream

        self.generate_full = _Method(generate_full)
        self.generate = _Method(generate)


def _vllms_logprobs(
    kind: str, top: int, tok, token_ids, rows, offset: int = 0, as_ids: bool = False, listed: list | None = None
) -> dict:
    """vLLM's own chat or completion server functions on the same engine output (its Logprob objects);
    `as_ids`: a request's `return_tokens_as_token_ids`; `listed`: its `logprob_token_ids`."""
    import functools

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import Logprob

    server = SimpleNamespace(
        return_tokens_as_token_ids=False, _get_decoded_token=GenerateBaseServing._get_decoded_token
    )
    server._get_top_logprobs = functools.partial(OpenAIServingChat._get_top_logprobs, server)
    steps = [{t: Logprob(lp, rank, text) for t, lp, rank, text in row} or None for row in rows]
    if kind == "chat":
        made = OpenAIServingChat._create_chat_logprobs(server, token_ids, steps, tok, top, listed, as_ids)
        return made.model_dump()
    made = OpenAIServingCompletion._create_completion_logprobs(
        server, token_ids, steps, top, tok, listed, offset, as_ids
    )
    return made.model_dump()


class _DecodingTokenizer(_TextTokenizer):
    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ([ids] if isinstance(ids, int) else ids))


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "as token ids"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_log_probabilities_are_answered_in_vllms_shapes(kind, stream, as_ids):
    """The engine's per-token log-probabilities reach the client as vLLM's server writes them: a chat's
    `logprobs.content` with bytes and `top_logprobs` alternatives, a completion's tokens, offsets and top
    entries (one more than asked, OpenAI's rule); -inf as -9999; a token without decoded text from the
    tokenizer; streamed, each chunk carries its tokens' (a chunk whose text is held back too), the offsets going
    on across chunks. With `return_tokens_as_token_ids` every token is shown as "token_id:N", as vLLM's server
    shows it (a chat's sampled token keeping its text's bytes, the offsets going on by the placeholders)."""
    tok = _DecodingTokenizer()
    ing = _ingress(tokenizer=tok)
    ing.engine = _LogprobEngine()
    body = {**CHAT, "logprobs": True, "top_logprobs": 2} if kind == "chat" else {**TEXT, "logprobs": 2}
    status, answer = _answer(ing, {**body, "stream": stream, "return_tokens_as_token_ids": as_ids}, kind)
    assert status == 200, answer
    assert ing.engine.requests[-1]["params"]["logprobs"] == 2
    assert "return_tokens_as_token_ids" not in ing.engine.requests[-1]["params"]  # the answer's shape only
    if not stream:
        assert answer["choices"][0]["logprobs"] == _vllms_logprobs(kind, 2, tok, _ROW_IDS, _ROWS, as_ids=as_ids)
        shown = json.dumps(answer["choices"][0]["logprobs"])
        assert ("token_id:" in shown) == as_ids
        return
    chunks = [e["choices"][0] for e in _events(answer) if e["choices"]]
    got = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert len(got) == 3  # one per token: the held-back one included
    offset = 0
    for k, piece in enumerate(got):
        expected = _vllms_logprobs(kind, 2, tok, _ROW_IDS[k : k + 1], _ROWS[k : k + 1], offset, as_ids)
        assert piece == expected
        if kind == "completion":
            offset = expected["text_offset"][-1] + len(expected["tokens"][-1])


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_log_probabilities_of_listed_tokens_are_asked_and_answered_as_vllms_server_does(kind):
    """vLLM's `logprob_token_ids`: the engine is asked for the listed tokens' log-probabilities instead of the top
    ones (its SamplingParams built as vLLM's server builds them), and every token the engine scored is shown, as
    vLLM's server shows them; without `logprobs`, past 128 tokens or an id past the vocabulary: a 400 naming it."""
    from kvmesh.deployments.engine import EngineReplica

    tok = _DecodingTokenizer()
    ing = _ingress(tokenizer=tok)
    ing.engine = _LogprobEngine()
    asked = {**CHAT, "logprobs": True, "top_logprobs": 1} if kind == "chat" else {**TEXT, "logprobs": 1}
    listed = [7, 9]
    status, answer = _answer(ing, {**asked, "logprob_token_ids": listed}, kind)
    assert status == 200, answer
    params = ing.engine.requests[-1]["params"]
    assert params["logprob_token_ids"] == listed and "logprobs" not in params
    built = EngineReplica._sampling_params(SimpleNamespace(), params)
    assert built.logprob_token_ids == listed and built.logprobs is None
    expected = _vllms_logprobs(kind, 1, tok, _ROW_IDS, _ROWS, listed=listed)
    assert answer["choices"][0]["logprobs"] == expected
    assert expected != _vllms_logprobs(kind, 1, tok, _ROW_IDS, _ROWS)  # more shown than the top one
    assert _answer(ing, {**asked, "logprob_token_ids": []}, kind)[0] == 200  # none listed: the top ones
    assert ing.engine.requests[-1]["params"]["logprobs"] == 1
    sent = len(ing.engine.requests)
    without = {k: v for k, v in asked.items() if k not in ("logprobs", "top_logprobs")}
    for wrong, code in [
        ({**without, "logprob_token_ids": listed}, "invalid_value"),
        ({**asked, "logprob_token_ids": list(range(129))}, "invalid_value"),
        ({**asked, "logprob_token_ids": [1000]}, "invalid_token_id"),
        ({**asked, "logprob_token_ids": ["7"]}, "invalid_type"),
    ]:
        status, answer = _answer(ing, wrong, kind)
        assert status == 400 and (answer["error"]["param"], answer["error"]["code"]) == ("logprob_token_ids", code)
    assert len(ing.engine.requests) == sent


@pytest.mark.parametrize(
    ("kind", "extra", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as vLLM's model refuses it
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),  # the whole vocabulary: not served
        ("chat", {"logprobs": 1}, "logprobs"),
        ("completion", {"logprobs": 21}, "logprobs"),
        ("completion", {"logprobs": True}, "logprobs"),
    ],
)
def test_log_probabilities_asked_for_wrongly_are_a_400(kind, extra, param):
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    status, answer = _answer(ing, {**(CHAT if kind == "chat" else TEXT), **extra}, kind)
    assert status == 400 and answer["error"]["param"] == param and not ing.engine.requests


class _EchoStream(_Stream):
    """An engine stream whose text names its request (first prompt token and seed); `fail`: it ends with the
    engine's `error` after its first piece."""

    def __init__(self, name: str, hang: bool, fail: bool = False):
        super().__init__(hang)
        self.chunks = [_chunk(name, [5]), _chunk("", [], "error") if fail else _chunk("!", [6], "length")]


class _EchoEngine(_Engine):
    """An engine whose answers say which request they answer; `fail_seed`: the stream of that seed fails."""

    def __init__(self, hang: bool = False, fail_seed: int | None = None):
        super().__init__(hang)
        self.requests: list[dict] = []

        self.serve_ids: list[str] = []  # Serve's internal request id each call carries (its router keys by it)

        def name(request: dict) -> str:
            from ray.serve.context import _get_serve_request_context

            self.serve_ids.append(_get_serve_request_context()._internal_request_id)
            return f"{request['prompt_token_ids'][0]}/{request['params'].get('seed')}"

        async def generate_full(request: dict) -> dict:
            self.requests.append(request)
            if self.hang:
                await asyncio.Event().wait()
            return {**_chunk(name(request) + "!", [5, 6], "length"), "ttft_s": 0.0}

        def generate(request: dict) -> _Stream:
            self.requests.append(request)
            fail = request["params"].get("seed") == fail_seed
            self.streams.append(_EchoStream(name(request), self.hang, fail))
            return self.streams[-1]

        self.generate_full = _Method(generate_full)
        self.generate = _Method(generate)


FANNED = {"model": "tiny", "prompt": [[1, 2, 3], [4, 5]], "n": 2, "seed": 10, "max_tokens": 2}
FANNED_NAMES = ["1/10", "1/11", "4/10", "4/11"]  # prompt by prompt, each sample with its seed


async def _stream_events(response, scope, receive) -> list:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await response(scope, receive, send)
    raw = b"".join(m.get("body", b"") for m in sent)
    return [e[6:].decode() if e[6:] == b"[DONE]" else json.loads(e[6:]) for e in raw.split(b"\n\n") if e]


def test_n_samples_of_a_batch_answer_as_one_in_vllms_choice_order():
    async def run():
        ing = _ingress()
        ing._anonymous = dataclasses.replace(ing._anonymous, limits=Limits(max_concurrent=4))
        ing.engine = _EchoEngine()
        req, _, _ = _request(FANNED)
        response = await ing._generate(req, "completion")
        assert response.status_code == 200, response.body
        answer = json.loads(response.body)
        assert [(c["index"], c["text"]) for c in answer["choices"]] == [
            (i, name + "!") for i, name in enumerate(FANNED_NAMES)
        ]
        assert answer["usage"]["prompt_tokens"] == 5 and answer["usage"]["completion_tokens"] == 8  # prompts once
        assert len(response.headers["x-kvmesh-request-id"].split(",")) == 4
        assert sorted(r["prompt_token_ids"] for r in ing.engine.requests) == [[1, 2, 3]] * 2 + [[4, 5]] * 2
        assert len(set(ing.engine.serve_ids)) == 4 and all(ing.engine.serve_ids)  # four requests to Serve
        # each prompt's samples share one key (the router keeps them on one replica), the two prompts apart
        keys = {tuple(r["prompt_token_ids"]): set() for r in ing.engine.requests}
        for r in ing.engine.requests:
            keys[tuple(r["prompt_token_ids"])].add(r["samples_of"])
        assert [len(k) for k in keys.values()] == [1, 1] and keys[(1, 2, 3)] != keys[(4, 5)]
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        # a batch with one sample per prompt, and a single request: nothing to keep together
        ing.engine.requests.clear()
        req, _, _ = _request({**FANNED, "n": 1})
        assert (await ing._generate(req, "completion")).status_code == 200
        req, _, _ = _request({**FANNED, "n": 1, "prompt": [1, 2, 3]})
        assert (await ing._generate(req, "completion")).status_code == 200
        assert len(ing.engine.requests) == 3 and all("samples_of" not in r for r in ing.engine.requests)

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_a_prompts_samples_reach_the_prediction_ledger_together(stream, monkeypatch):
    """Which of a prompt's samples computes the prompt is the engine's order: their cached tokens are compared
    with the router's predictions per prompt (`deliver_samples`), once every sample has answered; a single
    request's alone (`deliver`)."""
    from kvmesh.deployments import local_state

    calls: list[tuple[str, object]] = []
    spy = SimpleNamespace(
        deliver=lambda request_id, cached: calls.append(("deliver", request_id)),
        deliver_samples=lambda got: calls.append(("samples", dict(got))),
        prediction=lambda request_id: None,
    )
    monkeypatch.setattr(local_state, "LEDGER", spy)

    async def run():
        ing = _ingress()
        ing._anonymous = dataclasses.replace(ing._anonymous, limits=Limits(max_concurrent=4))
        ing.engine = _EchoEngine()
        req, scope, receive = _request({**FANNED, "stream": stream})
        response = await ing._generate(req, "completion")
        assert response.status_code == 200
        if stream:
            await _stream_events(response, scope, receive)
        samples = [c for c in calls if c[0] == "samples"]
        assert [len(got) for _, got in samples] == [2, 2] and not [c for c in calls if c[0] == "deliver"]
        ids = [r for _, got in samples for r in got]
        assert sorted(ids) == sorted(response.headers["x-kvmesh-request-id"].split(","))
        calls.clear()
        req, _, _ = _request({**FANNED, "prompt": [1, 2, 3], "n": 1})
        assert (await ing._generate(req, "completion")).status_code == 200
        assert [c[0] for c in calls] == ["deliver"]

    asyncio.run(run())


def test_n_samples_of_a_batch_stream_as_one_with_one_usage_chunk_and_one_done():
    async def run():
        ing = _ingress()
        ing._anonymous = dataclasses.replace(ing._anonymous, limits=Limits(max_concurrent=4))
        ing.engine = _EchoEngine()
        req, scope, receive = _request({**FANNED, "stream": True, "stream_options": {"include_usage": True}})
        response = await ing._generate(req, "completion")
        assert response.status_code == 200
        events = await _stream_events(response, scope, receive)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 5
        assert usage["usage"]["completion_tokens"] == 8
        texts = [""] * 4
        for e in events[:-2]:
            assert e["id"] == usage["id"] and e["usage"] is None
            for c in e["choices"]:
                texts[c["index"]] += c["text"]
        assert texts == [name + "!" for name in FANNED_NAMES]
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        assert not any(s.cancelled for s in ing.engine.streams)  # each answered whole

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_a_choice_over_the_tenants_limit_refuses_the_request_and_frees_the_others(stream):
    """Each choice is a request to the tenant's limits: with one request of the tenant's two already running,
    two more choices are a 429, and the one already at the engine is cancelled and gives its slot back."""

    async def run():
        ing = _ingress(hang=True)
        ing.engine = _EchoEngine(hang=True)
        req, _, _ = _request({**BODY, "stream": stream})
        running = asyncio.create_task(ing._generate(req, "completion"))
        await asyncio.sleep(0.02)
        assert ing.admission.active("anonymous") == 1
        req, _, _ = _request({**BODY, "n": 2, "stream": stream})
        response = await ing._generate(req, "completion")
        assert response.status_code == 429, response.body
        assert ing.admission.active("anonymous") == 1  # the other request's slot only
        if stream:  # the other request's stream runs on; a choice that reached the engine was cancelled
            assert not ing.engine.streams[0].cancelled and all(s.cancelled for s in ing.engine.streams[1:])
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        ing.engine.hang = False
        req, _, _ = _request({**BODY, "n": 2})
        assert (await ing._generate(req, "completion")).status_code == 200

    asyncio.run(run())


def test_more_choices_than_the_tenant_may_run_at_once_is_a_400_naming_n():
    """Such a request could never be served whole: a 400 saying so (not a 429 inviting a retry)."""

    async def run():
        ing = _ingress()
        ing.engine = _EchoEngine()
        req, _, _ = _request({**BODY, "n": 3})
        response = await ing._generate(req, "completion")
        assert response.status_code == 400
        error = json.loads(response.body)["error"]
        assert error["param"] == "n" and error["code"] == "too_many_choices" and "at most 2" in error["message"]
        assert ing.engine.requests == [] and ing.admission.active("anonymous") == 0

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_a_request_of_several_choices_cancelled_gives_every_slot_back(stream):
    async def run():
        ing = _ingress(hang=True)
        ing.engine = _EchoEngine(hang=True)
        req, _, _ = _request({**BODY, "n": 2, "stream": stream})
        task = asyncio.create_task(ing._generate(req, "completion"))
        await asyncio.sleep(0.02)
        assert ing.admission.active("anonymous") == 2
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the choices' own cancellation
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        assert all(s.cancelled for s in ing.engine.streams)

    asyncio.run(run())


def test_a_choice_failing_mid_stream_ends_the_whole_stream_with_its_error(monkeypatch):
    """The merged stream ends with the failed choice's error; the sample that answered whole still reaches
    the prediction ledger (its prompt's deliveries handed on when the stream closes)."""
    from kvmesh.deployments import local_state

    delivered: list[dict] = []
    spy = SimpleNamespace(deliver_samples=lambda got: delivered.append(dict(got)), prediction=lambda rid: None)
    monkeypatch.setattr(local_state, "LEDGER", spy)

    async def run():
        ing = _ingress()
        ing.engine = _EchoEngine(fail_seed=11)
        req, scope, receive = _request({**BODY, "n": 2, "seed": 10, "stream": True})
        response = await ing._generate(req, "completion")
        events = await _stream_events(response, scope, receive)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert "error" in events[-2] and all("error" not in e for e in events[:-2])
        assert ing.admission.active("anonymous") == 0 and ing.admission.in_flight == 0
        assert len(delivered) == 1 and len(delivered[0]) == 1  # the seed-10 sample, alone
        assert list(delivered[0].values()) == [0]

    asyncio.run(run())


class _Letters:
    """A tokenizer whose token id i is the i-th letter."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i - 1) for i in ids)

    def encode(self, text: str, **kwargs) -> list[int]:
        return [ord(ch) - ord("a") + 1 for ch in text]


class _ScoringEngine(_Engine):
    """An engine answering tokens 5, 6 ("e", "f") with their log-probabilities, and the prompt's when asked
    (vLLM's shape: none for the first prompt token)."""

    def __init__(self):
        super().__init__(hang=False)
        self.params: list[dict] = []

        def pieces(request: dict) -> list[dict]:
            params = request["params"]
            self.params.append(params)
            ids = request["prompt_token_ids"]
            prompt_rows = [[]] + [[(t, -float(t), 1, None)] for t in ids[1:]]
            out = [_chunk("e", [5]), _chunk("f", [6], "length")][: params["max_tokens"]]
            out[-1] = {**out[-1], "finish_reason": "length"}
            scored = params.get("logprobs") is not None
            for k, piece in enumerate(out):
                piece["logprobs"] = [[(piece["token_ids"][0], -0.5, 1, None)]] if scored else None
                piece["prompt_logprobs"] = prompt_rows if k == 0 and "prompt_logprobs" in params else None
            return out

        async def generate_full(request: dict) -> dict:
            out = pieces(request)
            whole = {**out[-1], "text": "".join(p["text"] for p in out), "ttft_s": 0.0}
            whole["token_ids"] = [t for p in out for t in p["token_ids"]]
            whole["logprobs"] = None if out[0]["logprobs"] is None else [r for p in out for r in p["logprobs"]]
            whole["prompt_logprobs"] = out[0]["prompt_logprobs"]
            return whole

        def generate(request: dict) -> _Stream:
            stream = _Stream(False)
            stream.chunks = pieces(request)
            self.streams.append(stream)
            return stream

        self.generate_full = _Method(generate_full)
        self.generate = _Method(generate)


def _scoring_ingress():
    """An ingress whose tokenizer spells ids as letters and whose engine scores what it is asked to."""
    ing = _ingress()
    ing.tokenizer = _Letters()
    ing.engine = _ScoringEngine()
    return ing


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_an_echoed_completion_puts_its_prompt_and_its_log_probabilities_before_the_answer(stream):
    async def run():
        ing = _scoring_ingress()
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "echo": True, "logprobs": 0, "stream": stream}
        req, scope, receive = _request(body)
        response = await ing._generate(req, "completion")
        assert response.status_code == 200, response.body
        if stream:
            events = await _stream_events(response, scope, receive)
            choices = [c for e in events[:-1] for c in e["choices"]]
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
            scores = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
            offsets = [x for c in choices if c["logprobs"] for x in c["logprobs"]["text_offset"]]
        else:
            (choice,) = json.loads(response.body)["choices"]
            text, lp = choice["text"], choice["logprobs"]
            tokens, scores, offsets = lp["tokens"], lp["token_logprobs"], lp["text_offset"]
            assert json.loads(response.body)["usage"]["completion_tokens"] == 2
        assert text == "abcef"  # the prompt's ids decoded, then the answer
        assert tokens == ["a", "b", "c", "e", "f"] and offsets == [0, 1, 2, 3, 4]
        assert scores == [None, -2.0, -3.0, -0.5, -0.5]  # none for the first prompt token, as vLLM's
        assert ing.engine.params[0]["prompt_logprobs"] == 0

    asyncio.run(run())


def test_an_echoed_completion_with_max_tokens_0_answers_with_the_prompt_alone():
    """vLLM's rule: one token generated and counted, the prompt (as sent) alone shown."""

    async def run():
        ing = _scoring_ingress()
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 0, "echo": True}
        req, _, _ = _request(body)
        response = await ing._generate(req, "completion")
        assert response.status_code == 200, response.body
        answer = json.loads(response.body)
        assert answer["choices"][0]["text"] == "abc" and answer["choices"][0]["logprobs"] is None
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 1
        assert ing.engine.params[0]["max_tokens"] == 1 and "prompt_logprobs" not in ing.engine.params[0]

    asyncio.run(run())


def test_a_completions_prompt_log_probabilities_come_in_vllms_raw_shape_in_its_choice():
    async def run():
        ing = _scoring_ingress()
        req, _, _ = _request({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "prompt_logprobs": 0})
        response = await ing._generate(req, "completion")
        assert response.status_code == 200, response.body
        (choice,) = json.loads(response.body)["choices"]
        assert choice["text"] == "ef" and choice["logprobs"] is None  # not echoed, no sampled scores asked
        assert choice["prompt_logprobs"] == [
            None,
            {"2": {"logprob": -2.0, "rank": 1, "decoded_token": None}},
            {"3": {"logprob": -3.0, "rank": 1, "decoded_token": None}},
        ]

    asyncio.run(run())


def _tokenized(ing, path: str, body: dict) -> tuple[int, dict]:
    async def run():
        req, _, _ = _request(body, path)
        handler = ing.tokenize if path == "/tokenize" else ing.detokenize
        answer = await handler(req)
        if isinstance(answer, dict):
            return 200, answer
        return answer.status_code, json.loads(answer.body)

    return asyncio.run(run())


def test_tokenize_gives_the_ids_a_generation_request_sends_the_engine_and_detokenize_their_text():
    """vLLM's /tokenize and /detokenize: a completion's prompt and a chat's messages (through the model's
    template, with its tools) become exactly the ids the same generation request is routed and cached with;
    `return_token_strs` names each token; the ids' text comes back whole."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tiny_path())
    ing = _ingress(tokenizer=tok)
    ing.vocab_size = len(tok)
    ing.engine = _RecordingEngine()
    chat = {
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    for path, body in (("/v1/completions", {**BODY, "prompt": "The cache remembers"}), ("/v1/chat/completions", chat)):
        status, _ = _answer(ing, body, "completion" if "prompt" in body else "chat")
        assert status == 200
        sent = ing.engine.requests[-1]["prompt_token_ids"]
        asked = {k: v for k, v in body.items() if k in ("model", "prompt", "messages")}
        status, answer = _tokenized(ing, "/tokenize", asked)
        assert status == 200, answer
        assert answer == {"count": len(sent), "max_model_len": 4096, "tokens": sent, "token_strs": None}
        status, named = _tokenized(ing, "/tokenize", {**asked, "return_token_strs": True})
        assert named["token_strs"] == tok.convert_ids_to_tokens(sent) and len(named["token_strs"]) == len(sent)
        status, back = _tokenized(ing, "/detokenize", {"model": "tiny", "tokens": sent})
        assert status == 200 and back == {"prompt": tok.decode(sent)}
    assert (
        "The cache remembers"
        in _tokenized(ing, "/detokenize", {"tokens": tok.encode("The cache remembers")})[1]["prompt"]
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"messages": "Hi"}, 400, "messages"),
        ("/tokenize", {"prompt": [5, 2000]}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 1000]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1], "model": 5}, 400, "model"),
    ],
)
def test_a_bad_tokenize_or_detokenize_request_is_an_openai_error_naming_its_field(path, body, status, param):
    ing = _ingress(tokenizer=_TextTokenizer())
    got, answer = _tokenized(ing, path, body)
    assert (got, answer["error"]["param"]) == (status, param)
    assert ing.admission.active("anonymous") == 0  # the tenant's slot handed back


def test_tokenize_counts_a_prompt_longer_than_the_context_as_vllms_does():
    """A client may ask whether its prompt fits: the count comes back past the context (vLLM's /tokenize sets no
    limit either); a generation of the same prompt is a 400."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing.engine = _RecordingEngine()
    long = "x" * (ing.max_model_len + 10)
    status, answer = _tokenized(ing, "/tokenize", {"prompt": long})
    assert status == 200 and answer["count"] == ing.max_model_len + 11 > answer["max_model_len"]  # with a BOS
    status, refused = _answer(ing, {**BODY, "prompt": long})
    assert status == 400 and refused["error"]["code"] == "context_length_exceeded" and not ing.engine.requests


def test_a_tenant_that_may_start_no_request_cannot_tokenize_either():
    """A tokenisation holds the tokenizer every tenant shares: refused while the tenant is at its concurrency
    limit, as a generation would be; otherwise not counted as a request."""
    ing = _ingress(tokenizer=_TextTokenizer())
    ing._anonymous = dataclasses.replace(ing._anonymous, limits=Limits(max_concurrent=1))
    held = ing.admission.reserve(ing._anonymous)
    status, answer = _tokenized(ing, "/tokenize", {"prompt": "x"})
    assert status == 429, answer
    ing.admission.cancel(held)
    assert _tokenized(ing, "/tokenize", {"prompt": "x"})[0] == 200
    assert _tokenized(ing, "/tokenize", {"prompt": "x"})[0] == 200 and ing.admission.active("anonymous") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_an_echoed_chat_begins_its_answer_with_its_last_assistant_message_as_vllms_server_does(stream):
    """A chat's `echo`: where the last message is the assistant's (the answer's role), its text goes before the
    answer's content; streamed, as its own first chunk carrying the role, the answer's chunks after it without
    one. Another last message leaves the answer as it is."""

    async def run(messages: list[dict]) -> list:
        ing = _ingress(tokenizer=_TextTokenizer())
        ing.engine = _RecordingEngine()
        req, scope, receive = _request({**CHAT, "messages": messages, "echo": True, "stream": stream})
        response = await ing._generate(req, "chat")
        assert response.status_code == 200, response.body
        if not stream:
            (choice,) = json.loads(response.body)["choices"]
            return [choice["message"]]
        events = await _stream_events(response, scope, receive)
        return [c["delta"] for e in events[:-1] for c in e["choices"]]

    started = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer:"}]
    deltas = asyncio.run(run(started))
    if stream:
        assert deltas[0] == {"role": "assistant", "content": "The answer:"}
        assert "".join(d.get("content") or "" for d in deltas) == "The answer:ab"
        assert [d for d in deltas[1:] if "role" in d] == []
    else:
        assert deltas[0]["role"] == "assistant" and deltas[0]["content"] == "The answer:ab"
    plain = asyncio.run(run(started[:1]))
    assert "".join(d.get("content") or "" for d in plain) == "ab" and plain[0]["role"] == "assistant"
