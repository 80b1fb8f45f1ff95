"""Several choices in one request (fan_out.py): how a request splits into one body per choice, and how the
choices' answers merge back in vLLM's shape (choice order, usage, a stream's events). The ingress's handling
of them (admission, cancellation, a failed choice) is in test_ingress_handlers.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.deployments import fan_out
from kvmesh.deployments.openai_protocol import OpenAIError, sse


def test_one_choice_is_left_to_the_common_path():
    assert fan_out.plan({"prompt": "a"}, "completion") is None
    assert fan_out.plan({"prompt": [1, 2, 3], "n": 1}, "completion") is None
    assert fan_out.plan({"prompt": ["a"]}, "completion") is None  # a batch of one is that prompt
    assert fan_out.plan({"prompt": [[1, 2]], "n": None}, "completion") is None
    assert fan_out.plan({"messages": [], "prompt": ["a", "b"]}, "chat") is None  # a chat has no batches


def test_n_samples_get_vllms_child_seeds_and_one_choice_each():
    body = {"prompt": "a", "n": 3, "seed": 7, "max_tokens": 2}
    fan = fan_out.plan(body, "completion")
    assert fan is not None and fan.n == 3
    assert [c["seed"] for c in fan.children] == [7, 8, 9]  # as vLLM's parallel sampling seeds its children
    assert all(c["n"] == 1 and c["prompt"] == "a" and c["max_tokens"] == 2 for c in fan.children)
    assert body["n"] == 3 and body["seed"] == 7  # the request itself is left as sent
    unseeded = fan_out.plan({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "chat")
    assert unseeded is not None and all("seed" not in c and "prompt" not in c for c in unseeded.children)


def test_a_batch_is_split_prompt_by_prompt_then_sample_by_sample():
    fan = fan_out.plan({"prompt": ["a", "b"], "n": 2, "seed": 0}, "completion")
    assert fan is not None
    assert [(c["prompt"], c["seed"]) for c in fan.children] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert [fan.prompt_of(i) for i in range(4)] == [0, 0, 1, 1]
    assert [fan.first_of_prompt(i) for i in range(4)] == [True, False, True, False]
    ids = fan_out.plan({"prompt": [[1, 2], [3]]}, "completion")
    assert ids is not None and [c["prompt"] for c in ids.children] == [[1, 2], [3]]
    assert all("seed" not in c for c in ids.children)


RUNNING_USAGE = {"include_usage": True, "continuous_usage_stats": True}
RUNNING_PARAM = "stream_options.continuous_usage_stats"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": 1.5}, "n"),
        ({"prompt": "a", "n": True}, "n"),
        ({"prompt": "a", "n": "2"}, "n"),
        ({"prompt": "a", "n": float("inf")}, "n"),
        ({"prompt": "a", "n": fan_out.MAX_CHOICES + 1}, "n"),
        ({"prompt": ["a"] * 9, "n": 8}, "n"),  # 72 choices
        ({"prompt": ["a", [1, 2]]}, "prompt"),
        ({"prompt": "a", "n": 2, "stream": True, "stream_options": RUNNING_USAGE}, RUNNING_PARAM),
    ],
)
def test_what_cannot_be_split_is_a_400_naming_its_field(body, param):
    with pytest.raises(OpenAIError) as err:
        fan_out.plan(body, "completion")
    assert err.value.status == 400 and err.value.param == param


def _answer(text: str, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def test_answers_merge_in_choice_order_counting_each_prompt_once():
    fan = fan_out.plan({"prompt": ["a", "b"], "n": 2}, "completion")
    assert fan is not None
    answers = [_answer("a0", 5, 2, 0), _answer("a1", 5, 3, 4), _answer("b0", 7, 1, 2), _answer("b1", 7, 2, 6)]
    merged = fan_out.merge_full(fan, answers, "cmpl-all", 9)
    assert merged["id"] == "cmpl-all" and merged["created"] == 9 and merged["model"] == "tiny"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    # each prompt once (and its cached tokens from its first sample), every choice's completion tokens
    assert merged["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 8,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert answers[1]["choices"][0]["index"] == 0  # the choices' own answers are left as they were


def test_kvmeshs_headers_are_joined_per_choice():
    joined = fan_out.merge_headers(
        [{"x-kvmesh-replica": "r0", "content-type": "a"}, {"x-kvmesh-replica": "r1", "x-kvmesh-predicted": "3"}]
    )
    assert joined == {"x-kvmesh-replica": "r0,r1", "x-kvmesh-predicted": ",3"}


def _chunk(text: str, finish: str | None = None) -> dict:
    return {
        "id": "cmpl-child",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": None,
    }


def _usage_chunk(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": "cmpl-child",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def _events(raw: bytes) -> list:
    out = []
    for event in raw.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: ")
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def _pieces(*pieces: bytes):
    for p in pieces:
        await asyncio.sleep(0)
        yield p


def test_streams_merge_with_their_indices_and_one_usage_chunk_and_done():
    fan = fan_out.plan({"prompt": "a", "n": 2, "stream": True}, "completion")
    assert fan is not None
    merge = fan_out.StreamMerge(fan, "cmpl-all", 9)
    first = sse(_chunk("x")) + sse(_chunk("y", "length")) + sse(_usage_chunk(4, 2)) + sse("[DONE]")
    second = sse(_chunk("p")) + sse(_chunk("q", "length")) + sse(_usage_chunk(4, 2)) + sse("[DONE]")
    cut = len(second) // 2 + 3  # an event cut across two reads waits for its end

    async def run() -> bytes:
        streams = [_pieces(first), _pieces(second[:cut], second[cut:])]
        return b"".join([p async for p in fan_out.merged_stream(streams, merge)])

    events = _events(asyncio.run(run()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = [e for e in events[:-1] if not e["choices"]]
    assert len(usage) == 1 and events[-2] is usage[0]
    assert usage[0]["usage"]["prompt_tokens"] == 4 and usage[0]["usage"]["completion_tokens"] == 4
    texts = {0: "", 1: ""}
    for e in events[:-2]:
        assert e["id"] == "cmpl-all" and e["created"] == 9
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "xy", 1: "pq"}


def test_an_error_in_one_choice_ends_the_stream_and_closes_the_others():
    fan = fan_out.plan({"prompt": "a", "n": 2, "stream": True}, "completion")
    assert fan is not None
    closed: list[str] = []

    async def failing():
        yield sse(_chunk("x"))
        await asyncio.sleep(0)
        yield sse({"error": {"message": "engine failed", "type": "server_error"}}) + sse("[DONE]")

    async def endless():
        try:
            while True:
                yield sse(_chunk("p"))
                await asyncio.sleep(0.001)
        finally:
            closed.append("endless")

    async def run() -> bytes:
        merge = fan_out.StreamMerge(fan, "cmpl-all", 9)
        return b"".join([p async for p in fan_out.merged_stream([failing(), endless()], merge)])

    events = _events(asyncio.run(run()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "error" in events[-2] and all("error" not in e for e in events[:-2])
    assert closed == ["endless"]


def test_a_stream_whose_choices_sent_no_usage_ends_with_done_alone():
    """Choices send a usage chunk only when the request asked for usage; without them the merged stream sends
    none either."""
    fan = fan_out.plan({"prompt": "a", "n": 2, "stream": True}, "completion")
    assert fan is not None
    merge = fan_out.StreamMerge(fan, "cmpl-all", 9)
    for choice in (0, 1):
        out, failed = merge.feed(choice, sse(_chunk("x", "length")) + sse("[DONE]"))
        assert not failed and [e["choices"][0]["index"] for e in _events(out)] == [choice]
    assert merge.tail() == sse("[DONE]")


def test_a_prompts_sample_deliveries_go_on_together_or_what_came_when_the_request_ends_early():
    got: list[dict] = []
    whole = fan_out.SampleDeliveries(2, got.append)
    whole.add("a", 0)
    assert got == []
    whole.add("b", 608)
    assert got == [{"a": 0, "b": 608}]
    whole.flush()  # already handed on: nothing twice
    assert got == [{"a": 0, "b": 608}]
    got.clear()
    cut = fan_out.SampleDeliveries(3, got.append)
    cut.add("a", 608)
    cut.flush()  # the request ended with two samples unanswered
    cut.add("b", 0)  # one answering after: alone
    assert got == [{"a": 608}, {"b": 0}]
    empty = fan_out.SampleDeliveries(2, got.append)
    empty.flush()
    assert got == [{"a": 608}, {"b": 0}]  # nothing came: nothing handed on
