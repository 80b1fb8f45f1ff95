"""Fuzzing the live ingress with schemathesis over its own OpenAPI schema.

FastAPI's `/openapi.json` lists every path but no request bodies (the handlers read raw bodies so they
can answer malformed JSON with OpenAI-style errors), so the schema is enriched here with the OpenAI
request shapes before schemathesis generates cases from it: POSITIVE cases (valid by the schema, many
reaching the engines) and NEGATIVE ones (violating it: wrong types, missing fields, garbage bytes).
Raw cases (random bytes, content types, Authorization headers) come from plain hypothesis.

Checks on every response: no 5xx; a 4xx is a JSON body `{"error": {"message": str, "type": str, ...}}`;
a 2xx is valid JSON or a well-formed SSE stream ending in `data: [DONE]`; no request hangs past the
timeout. Afterwards the server is healthy and still serves a normal completion. The counts (cases
tried, failures) are printed for the closing note.
"""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tenant_app import KEYS, auth

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0
STRING = {"type": "string", "maxLength": 80}
SHORT_TEXT = {"type": "string", "minLength": 1, "maxLength": 60}
TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1100}, "minItems": 1, "maxItems": 40}
SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 6},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0.01, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**31},
    "stream": {"type": "boolean"},
    "stop": {"oneOf": [STRING, {"type": "array", "items": STRING, "maxItems": 4}]},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "include_stop_str_in_output": {"type": "boolean"},
    "return_token_ids": {"type": "boolean"},
    "priority": {"type": "integer", "minimum": -5, "maximum": 5},
    "truncate_prompt_tokens": {"type": "integer", "minimum": -2, "maximum": 5000},
    "truncation_side": {"type": "string", "enum": ["left", "right", "middle"]},
    "allowed_token_ids": {"type": "array", "items": {"type": "integer", "minimum": -1, "maximum": 1100}, "maxItems": 4},
    "bad_words": {"type": "array", "items": STRING, "maxItems": 3},
    "return_tokens_as_token_ids": {"type": "boolean"},
    "user": STRING,
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
}
COMPLETION = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string", "enum": ["tiny"]},
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1, "maxLength": 200},
                TOKENS,
                # a batch of prompts: one choice each (times n)
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": 60},
                    "minItems": 2,
                    "maxItems": 3,
                },
                {"type": "array", "items": TOKENS, "minItems": 2, "maxItems": 3},
            ]
        },
        "echo": {"type": "boolean"},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 2},
        "logprob_token_ids": {"type": "array", "items": TOKENS["items"], "maxItems": 3},
        **SAMPLING,
    },
}
CHAT = {
    "type": "object",
    # a chat without max_tokens answers to the end of the context: on the tiny model that is up to 2,000
    # tokens of CPU decode per case (the default's own test is tests/unit/deployments/test_ingress_handlers.py)
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string", "enum": ["tiny"]},
        "messages": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["system", "user", "assistant"]},
                    "content": {"type": "string", "maxLength": 120},
                },
            },
        },
        "echo": {"type": "boolean"},
        "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"},
        "reasoning_effort": {"type": "string", "enum": ["none", "low", "high", "extreme"]},
        "documents": {"type": "array", "maxItems": 2, "items": {"type": "object"}},
        **SAMPLING,
    },
}
TOKENIZE = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "enum": ["tiny"]},
        "prompt": {"type": "string", "maxLength": 200},
        "messages": CHAT["properties"]["messages"],
        "return_token_strs": {"type": "boolean"},
    },
}
DETOKENIZE = {
    "type": "object",
    "required": ["tokens"],
    "properties": {"model": {"type": "string", "enum": ["tiny"]}, "tokens": TOKENS},
}
LOOKUP = {
    "type": "object",
    "required": ["hashes"],
    "properties": {"hashes": {"type": "array", "maxItems": 20, "items": {"type": "integer"}}},
}
BODIES = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/kvmesh/index/lookup": LOOKUP,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}
EXAMPLES = {  # per (path, mode): enough to cover the shapes, small enough for a 2-core CI machine
    ("/v1/completions", "positive"): 80,
    ("/v1/completions", "negative"): 120,
    ("/v1/chat/completions", "positive"): 60,
    ("/v1/chat/completions", "negative"): 120,
    ("/kvmesh/index/lookup", "positive"): 30,
    ("/kvmesh/index/lookup", "negative"): 50,
    ("/tokenize", "positive"): 30,
    ("/tokenize", "negative"): 40,
    ("/detokenize", "positive"): 20,
    ("/detokenize", "negative"): 30,
}
OTHER_EXAMPLES = 5  # GET endpoints without inputs
STREAM_EVENTS_READ = 4096  # more than any answer here carries (64 choices x 16 tokens at most)


def enriched_schema(raw: dict) -> dict:
    schema = copy.deepcopy(raw)
    for path, body in BODIES.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return schema


class Tally:
    def __init__(self):
        self.cases = 0
        self.by_status: dict[int, int] = {}
        self.failures: list[str] = []

    def fail(self, what: str, detail: str):
        if len(self.failures) < 50:
            self.failures.append(f"{what}: {detail[:300]}")


def check_response(tally: Tally, what: str, status: int, ctype: str, text: str):
    tally.cases += 1
    tally.by_status[status] = tally.by_status.get(status, 0) + 1
    if status >= 500:
        return tally.fail(what, f"{status} {text}")
    if status >= 400:
        try:
            err = json.loads(text)["error"]
            assert isinstance(err["message"], str) and isinstance(err["type"], str)
        except Exception:
            tally.fail(what, f"{status} not an OpenAI error body: {text}")
        return
    if ctype.startswith("text/event-stream"):
        events = [line for line in text.splitlines() if line]
        if not events or events[-1] != "data: [DONE]" or not all(e.startswith("data: ") for e in events):
            return tally.fail(what, f"malformed SSE: {text}")
        for e in events[:-1]:
            try:
                payload = json.loads(e[6:])
            except ValueError:
                return tally.fail(what, f"SSE event not JSON: {e}")
            if "error" in payload:
                return tally.fail(what, f"error inside a 200 stream: {e}")
    elif ctype.startswith("application/json"):
        try:
            json.loads(text)
        except ValueError:
            tally.fail(what, f"2xx body not JSON: {text}")


@pytest.fixture(scope="module")
def schema(live_app):
    import schemathesis

    raw = httpx.get(live_app.url + "/openapi.json", timeout=60).json()
    loaded = schemathesis.openapi.from_dict(enriched_schema(raw))
    # schemathesis stops reading an event stream after 20 events and closes it (a stream may never end): ours
    # end, and their whole shape is what is checked (`[DONE]` last), so every event is read
    loaded.config.max_stream_events = STREAM_EVENTS_READ
    return loaded


@pytest.fixture(scope="module")
def tally():
    return Tally()


def _run_operation(live_app, op, mode, n, tally):
    import requests
    from schemathesis import GenerationMode

    headers = auth(KEYS["acme"])

    @settings(max_examples=n, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case):
        what = f"{mode} {case.method} {case.path} body={case.body!r:.200}"
        try:
            resp = case.call(base_url=live_app.url, headers=headers, timeout=TIMEOUT_S)
        except requests.Timeout:
            tally.cases += 1
            return tally.fail(what, f"no response within {TIMEOUT_S} s")
        ctype = resp.headers.get("content-type") or [""]  # schemathesis: header -> list of values
        check_response(tally, what, resp.status_code, ctype[0] if isinstance(ctype, list) else ctype, resp.text)

    run()


def test_schemathesis_cases_never_5xx_or_malformed(live_app, schema, tally):
    ran = set()
    for op_result in schema.get_all_operations():
        op = op_result.ok()
        for mode in ("positive", "negative"):
            n = EXAMPLES.get((op.path, mode), OTHER_EXAMPLES if mode == "positive" else 0)
            if n:
                _run_operation(live_app, op, mode, n, tally)
                ran.add((op.path, mode))
    assert set(EXAMPLES) <= ran, f"operations missing from /openapi.json: {set(EXAMPLES) - ran}"
    print(f"\nschemathesis fuzz: {tally.cases} cases, {len(tally.failures)} failures, statuses {tally.by_status}")
    assert tally.by_status.get(200, 0) >= 20, "too few valid cases reached the engines to mean anything"
    assert not tally.failures, "\n".join(tally.failures)


RAW = Tally()  # the raw-input cases, summed over hypothesis examples
HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(
        ["/v1/completions", "/v1/chat/completions", "/kvmesh/index/lookup", "/tokenize", "/detokenize"]
    ),
    body=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
            lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
            max_leaves=12,
        ).map(lambda v: json.dumps(v).encode()),
    ),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
    # mostly a valid key, so most raw bodies get past auth and reach the parser
    authorization=st.one_of(st.just("good"), st.just("good"), st.just("good"), st.none(), HEADER_TEXT),
)
def test_raw_bodies_and_headers(live_app, path, body, content_type, authorization):
    headers = {"Content-Type": content_type} if content_type else {}
    if authorization == "good":
        headers.update(auth(KEYS["acme"]))
    elif authorization is not None:
        headers["Authorization"] = authorization
    before = len(RAW.failures)
    try:
        resp = httpx.post(live_app.url + path, content=body, headers=headers, timeout=TIMEOUT_S)
    except httpx.TimeoutException:
        RAW.cases += 1
        RAW.fail(f"raw {path}", "timeout")
        pytest.fail(f"no response within {TIMEOUT_S} s for {path} {body!r:.100}")
    check_response(RAW, f"raw {path} {body!r:.100}", resp.status_code, resp.headers.get("content-type", ""), resp.text)
    assert len(RAW.failures) == before, RAW.failures[before:]


def test_server_healthy_after_fuzzing(live_app):
    print(f"\nraw fuzz: {RAW.cases} cases, {len(RAW.failures)} failures, statuses {RAW.by_status}")
    assert httpx.get(live_app.url + "/health", timeout=30).status_code == 200
    resp = httpx.post(
        live_app.url + "/v1/completions",
        headers=auth(KEYS["acme"]),
        timeout=120,
        json={"model": "tiny", "prompt": "still serving?", "max_tokens": 3},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
