"""OpenAI request validation and response shapes (deployments/openai_protocol.py): what is accepted, what
is refused with which param and code."""

from __future__ import annotations

import pytest

from kvmesh.deployments import openai_protocol as proto


# ---------------------------------------------------------------------------- request validation
def err(fn, body) -> proto.OpenAIError:
    with pytest.raises(proto.OpenAIError) as info:
        fn(body)
    return info.value


def test_completion_accepts_text_token_ids_and_single_item_batches():
    r = proto.parse_completion(
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
        }
    )
    assert (r.prompt_text, r.stream, r.include_usage, r.params["max_tokens"]) == ("hi", True, True, 3)
    assert proto.parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt_ids == [1, 2, 3]
    assert proto.parse_completion({"model": "m", "prompt": ["x"]}).prompt_text == "x"
    assert proto.parse_completion({"model": "m", "prompt": [[4, 5]]}).prompt_ids == [4, 5]
    assert proto.parse_completion({"model": "m", "prompt": "x"}).params["max_tokens"] == proto.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"prompt": "x"}, "model", "missing_required_parameter"),
        ({"model": 3, "prompt": "x"}, "model", "invalid_type"),
        ({"model": "m"}, "prompt", "missing_required_parameter"),
        ({"model": "m", "prompt": ""}, "prompt", "empty_prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": [1, True]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": {"a": 1}}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
        ({"model": "m", "prompt": "x", "temperature": -1}, "temperature", "invalid_value"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "prompt": "x", "n": 2}, "n", "invalid_value"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
        ({"model": "m", "prompt": "x", "stop": 5}, "stop", "invalid_type"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
        ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs", "unsupported_parameter"),
    ],
)
def test_completion_rejects_bad_fields_with_param_and_code(body, param, code):
    e = err(proto.parse_completion, body)
    assert (e.status, e.param, e.code) == (400, param, code)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_validation():
    r = proto.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        }
    )
    # a message's text parts joined as vLLM joins them
    assert r.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"}]
    assert err(proto.parse_chat, {"model": "m"}).code == "missing_required_parameter"
    assert err(proto.parse_chat, {"model": "m", "messages": []}).code == "empty_prompt"
    assert err(proto.parse_chat, {"model": "m", "messages": "hi"}).code == "invalid_type"
    assert (
        err(proto.parse_chat, {"model": "m", "messages": [{"role": "x", "content": "a"}]}).param == "messages[0].role"
    )
    assert err(proto.parse_chat, {"model": "m", "messages": [{"role": "user", "content": 5}]}).code == "invalid_type"
    assert (
        err(
            proto.parse_chat,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        ).code
        == "invalid_type"
    )


def test_parse_json_errors():
    for raw in (b"", b"{x", b"[1]", b"\xff\xfe"):
        assert err(proto.parse_json, raw).code == "invalid_json"
    assert proto.parse_json(b'{"a": 1}') == {"a": 1}


def test_stream_chunks_have_openai_shape():
    req = proto.parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    first = proto.stream_chunk(req, "id", "he", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"} and first["usage"] is None
    last = proto.stream_chunk(req, "id", None, None, u=proto.usage(5, 2, 3))
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert proto.sse("[DONE]") == b"data: [DONE]\n\n"
