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
        ({"model": "m", "prompt": "x", "echo": 1}, "echo", "invalid_type"),
        ({"model": "m", "prompt": "x", "echo": False, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),  # past vLLM's max_logprobs
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
    # a message's text parts kept: how they reach the template depends on it (`request_log.template_messages`)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert r.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
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


@pytest.mark.parametrize(
    ("role", "part"),
    [
        ("user", {"type": "input_text", "text": "a"}),  # the Responses API's: vLLM's chat model refuses it
        ("user", {"type": "text", "text": None}),
        ("user", {"type": "refusal", "refusal": None}),
        ("user", {"type": "thinking"}),
        ("user", {"type": "text", "text": "a", "uuid": "u"}),  # a media part's id: vLLM reads the part as media
        ("user", {"text": "no type"}),
        ("system", "a plain string"),  # a system message's parts are objects (vLLM's system message model)
    ],
)
def test_a_content_part_vllms_server_refuses_is_a_400(role, part):
    """Each is refused by vLLM's request model or its part parser (checked below on the same request there)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import _parse_chat_message_content_mm_part

    body = {"model": "m", "messages": [{"role": role, "content": [part]}]}
    e = err(proto.parse_chat, body)
    assert (e.status, e.param, e.code) == (400, "messages[0].content", "invalid_type")
    with pytest.raises(Exception):  # noqa: B017 -- pydantic's ValidationError or vLLM's own, by case
        request = ChatCompletionRequest(**body)
        for p in request.messages[0]["content"]:
            _parse_chat_message_content_mm_part(p)


def test_the_part_keys_left_on_a_text_part_are_the_ones_vllm_leaves():
    from vllm.renderers.chat_utils import _KNOWN_CONTENT_PART_FIELDS

    assert proto._PART_FIELDS == _KNOWN_CONTENT_PART_FIELDS


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
    first = proto.stream_chunk(req, "id", "he", None, created=1, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"} and first["usage"] is None
    last = proto.stream_chunk(req, "id", None, None, created=1, u=proto.usage(5, 2, 3))
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert proto.sse("[DONE]") == b"data: [DONE]\n\n"


@pytest.mark.parametrize("value", ["lots", -5, 0, 2.5, True])
def test_a_chats_max_tokens_is_checked_even_beside_max_completion_tokens(value):
    """max_completion_tokens wins, but a bad max_tokens beside it is a 400 naming it, as vLLM's model refuses
    it: taken silently, the client's mistake would go unseen."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}
    e = err(proto.parse_chat, {**chat, "max_tokens": value})
    assert (e.status, e.param) == (400, "max_tokens")
    req = proto.parse_chat({**chat, "max_tokens": 9})
    assert (req.params["max_tokens"], req.max_tokens_param) == (3, "max_completion_tokens")


@pytest.mark.parametrize("body", [{}, {"model": None}, {"model": ""}])
def test_a_request_that_names_no_model_is_for_the_served_one(body):
    """vLLM's `_is_model_supported`: a falsy model (left out, null or "") is its one served model; the ingress
    fills in the name its response echoes."""
    assert proto.parse_completion({**body, "prompt": "x"}).model == ""
    assert proto.parse_chat({**body, "messages": [{"role": "user", "content": "x"}]}).model == ""


@pytest.mark.parametrize("value", [10.0, 10.5, 100, 1e6, 0.01])
def test_repetition_penalty_takes_any_finite_positive_value_as_vllm(value):
    assert proto.parse_completion({"model": "m", "prompt": "x", "repetition_penalty": value}).params[
        "repetition_penalty"
    ] == float(value)


@pytest.mark.parametrize("value", [0, 0.0, -1, float("nan"), float("inf")])
def test_repetition_penalty_not_above_zero_or_not_finite_is_a_400(value):
    e = err(proto.parse_completion, {"model": "m", "prompt": "x", "repetition_penalty": value})
    assert (e.status, e.param) == (400, "repetition_penalty")


MSGS = [{"role": "user", "content": "x"}]
EXTRAS = [
    ("watermarking", True),
    ("thinking_token_budget", 10),
    ("routed_experts_prompt_start", 3),
    ("repetition_detection", {"window": 4}),
    ("use_beam_search", True),
    ("spaces_between_special_tokens", False),
    ("vllm_xargs", {"a": 1}),
    ("length_penalty", 2.0),
]


@pytest.mark.parametrize(("field", "value"), EXTRAS)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_vllm_extra_parameter_this_server_does_not_serve_is_refused_not_ignored(kind, field, value):
    body = {"model": "m", field: value, **({"prompt": "x"} if kind == "completion" else {"messages": MSGS})}
    e = err(proto.parse_completion if kind == "completion" else proto.parse_chat, body)
    assert (e.status, e.param, e.code) == (400, field, "unsupported_parameter")
    assert field in e.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template", "{{ messages }}"),
        ("include_reasoning", False),
        ("return_prompt_text", True),
        ("mm_processor_kwargs", {"num_crops": 4}),
    ],
)
def test_a_chat_setting_for_vllms_template_rendering_is_refused(field, value):
    e = err(proto.parse_chat, {"model": "m", "messages": MSGS, field: value})
    assert (e.status, e.param, e.code) == (400, field, "unsupported_parameter")


def test_vllms_defaults_for_the_refused_extras_change_nothing_and_are_accepted():
    chat = {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "bad_words": [],
        "allowed_token_ids": None,
        "truncate_prompt_tokens": None,
        "return_token_ids": False,
        "use_beam_search": False,
        "spaces_between_special_tokens": True,
        "chat_template_kwargs": {},
        "priority": 0,
        "parallel_tool_calls": False,  # OpenAI's, meaningless without tools (refused)
        "user": "u",
        "request_id": "client-chosen-id",  # names the request, shapes nothing: accepted (kvmesh keeps its own ids)
        "session_id": "conv-42",  # the same for its session
        "stream_interval": 4,  # how tokens are grouped into stream chunks: the output is the same
        "metadata": {"a": "b"},  # neither served nor known to vLLM: ignored, as vLLM ignores it
    }
    assert proto.parse_chat({"model": "m", "messages": MSGS, **chat}).messages
    assert proto.parse_completion({"model": "m", "prompt": "x", "add_special_tokens": True}).prompt_text == "x"
    # a chat-only field is not vLLM's on completions: ignored there, as vLLM ignores it
    assert proto.parse_completion({"model": "m", "prompt": "x", "continue_final_message": True}).prompt_text == "x"
    # add_special_tokens: served (the tokenizer's special tokens, the endpoint's default when left out)
    plain = proto.parse_completion({"model": "m", "prompt": "x", "add_special_tokens": False})
    assert plain.add_special_tokens is False
    assert proto.parse_chat({"model": "m", "messages": MSGS}).add_special_tokens is None
    assert err(proto.parse_chat, {"model": "m", "messages": MSGS, "add_special_tokens": "no"}).param == (
        "add_special_tokens"
    )


STREAM_OPTIONS = [
    (False, {}),
    (False, None),
    (False, {"include_usage": True}),
    (False, {"include_usage": False}),
    (True, {}),
    (True, {"include_usage": None}),
    (True, {"include_usage": True}),
    (True, {"include_usage": False, "continuous_usage_stats": True}),
    (True, {"include_usage": True, "continuous_usage_stats": True}),
    (True, {"include_usage": True, "continuous_usage_stats": None}),
    (True, {"continuous_usage_stats": True}),
    (True, "yes-please"),
    (True, {"include_usage": [True]}),
]


@pytest.mark.parametrize(("stream", "options"), STREAM_OPTIONS)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_options_are_taken_and_refused_as_vllm_takes_and_refuses_them(kind, stream, options):
    """vLLM 0.32's request models and `should_include_usage`: options are refused only when given (not {}) with a
    stream that is not one; a null flag is false; running usage needs the final usage asked for too."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage
    from vllm.exceptions import VLLMValidationError

    body = {"model": "m", "stream": stream, "stream_options": options}
    body.update({"prompt": "x"} if kind == "completion" else {"messages": MSGS})
    try:
        vllm_request = (CompletionRequest if kind == "completion" else ChatCompletionRequest)(**body)
        expected = should_include_usage(vllm_request.stream_options, False)
    except (ValueError, VLLMValidationError):  # pydantic's ValidationError is a ValueError
        expected = None
    parse = proto.parse_completion if kind == "completion" else proto.parse_chat
    if expected is None:
        assert err(parse, body).status == 400
    else:
        r = parse(body)
        assert (r.include_usage, r.continuous_usage) == expected


def test_every_field_of_vllms_own_requests_is_served_or_refused():
    """The parser's tables cover vLLM 0.32's request models, and what they accept is vLLM's default: a field
    vLLM adds and this server leaves out of them would be ignored where vLLM acts on it."""
    # vLLM is a dependency of the project: a missing module fails this test rather than skipping it
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as chat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as completion

    for kind, model in (("chat", chat), ("completion", completion)):
        missing = set(model.model_fields) - proto.known_fields(kind)
        assert not missing, (kind, missing)
        extras = proto._VLLM_EXTRAS | proto._VLLM_EXTRAS_BY_KIND[kind]
        for name, harmless in extras.items():
            default = model.model_fields[name].get_default(call_default_factory=True)
            if harmless:  # vLLM's default, or an empty value where its default is None (vLLM reads it as none)
                assert default == harmless[0] or (default is None and not harmless[0]), (kind, name, default)
            else:
                assert default is None, (kind, name, default)


@pytest.mark.parametrize("model", [False, 0, [], {}])
def test_a_falsy_model_that_is_not_a_string_is_refused_not_taken_for_no_model(model):
    assert err(proto.parse_chat, {"model": model, "messages": MSGS}).code == "invalid_type"


def test_a_bool_is_not_taken_for_a_harmless_number():
    body = {"model": "m", "prompt": "x", "length_penalty": True}
    assert err(proto.parse_completion, body).code == "unsupported_parameter"


def test_a_harmless_number_counts_whatever_its_kind():
    assert proto.parse_completion({"model": "m", "prompt": "x", "length_penalty": 1}).prompt_text == "x"  # vLLM: 1.0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_priority_is_vllms_integer(kind):
    """vLLM's `priority`: any integer, negative too; left out, None (the tenant's floor or 0 then applies)."""
    base = {"model": "m", **({"prompt": "x"} if kind == "completion" else {"messages": MSGS})}
    parse = proto.parse_completion if kind == "completion" else proto.parse_chat
    assert parse(base).priority is None
    assert parse({**base, "priority": -7}).priority == -7 and parse({**base, "priority": 3.0}).priority == 3
    for wrong in (True, 1.5, "1"):
        assert err(parse, {**base, "priority": wrong}).param == "priority"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
def test_a_null_content_is_taken_where_vllm_takes_it_and_refused_where_it_refuses_it(role):
    """vLLM's request model takes an assistant's null content (no text: a turn it renders empty) and refuses any
    other role's; the ingress does the same, and puts it as no parts."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": role, "content": None}]}
    try:
        ChatCompletionRequest(**body)
        vllm_takes = True
    except ValueError:
        vllm_takes = False
    if vllm_takes:
        assert proto.parse_chat(body).messages[1] == {"role": role, "content": []}
    else:
        assert err(proto.parse_chat, body).param == "messages[1].content"
    assert vllm_takes == (role == "assistant")


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
def test_a_message_without_content_is_taken_as_vllm_takes_it(role):
    """vLLM's request model takes a message with no `content` key at all, whatever its role (its custom-role
    message form), and renders an empty turn; the ingress takes it too, as no parts (it was refused)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": role}]}
    ChatCompletionRequest(**body)  # raises if vLLM refused it
    assert proto.parse_chat(body).messages[1] == {"role": role, "content": []}


def test_an_assistants_reasoning_is_kept_under_either_name_and_must_be_text():
    """Interleaved thinking: an assistant turn's `reasoning` (or the deprecated `reasoning_content`, which vLLM's
    server renames) goes to the template; another role's is not rendered, a `task` string is kept; reasoning
    that is not text is a 400 naming it (vLLM's template call would fail on it)."""
    msgs = [
        {"role": "user", "content": "x", "reasoning": "ignored", "task": "t"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
    got = proto.parse_chat({"model": "m", "messages": msgs}).messages
    assert got[0] == {"role": "user", "content": "x", "task": "t"}
    assert got[1] == {"role": "assistant", "content": "a", "reasoning": "r"}
    msgs[1]["reasoning"] = ["not", "text"]
    e = err(proto.parse_chat, {"model": "m", "messages": msgs})
    assert (e.param, e.code) == ("messages[1].reasoning", "invalid_type")


def test_an_assistant_turn_with_tool_calls_keeps_them_as_the_template_gets_them():
    """As vLLM's server: the calls kept in its request model's key order with their JSON arguments read (not an
    object: an empty one), a null content as none; an empty list is no calls; a malformed call is a 400."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}, "x": 1}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    kept = proto.parse_chat({"model": "m", "messages": msgs}).messages[1]
    assert kept == {
        "role": "assistant",
        "content": [],
        "tool_calls": [{"id": "c1", "function": {"arguments": {"a": [1]}, "name": "f"}, "type": "function", "x": 1}],
    }
    assert list(kept["tool_calls"][0]) == ["id", "function", "type", "x"]
    msgs[1]["tool_calls"] = []
    assert proto.parse_chat({"model": "m", "messages": msgs}).messages[1] == {"role": "assistant", "content": []}
    for broken in ({**call, "id": None}, {**call, "type": "custom"}, {**call, "function": {"name": "f"}}, "c1"):
        msgs[1]["tool_calls"] = [broken]
        e = err(proto.parse_chat, {"model": "m", "messages": msgs})
        assert (e.param, e.code) == ("messages[1].tool_calls[0]", "invalid_type"), broken
    msgs[1]["tool_calls"] = {"id": "c1"}
    assert err(proto.parse_chat, {"model": "m", "messages": msgs}).param == "messages[1].tool_calls"
    # a developer message's own tools (vLLM's extension, rendered there) are refused, not dropped unsaid
    developer = [{"role": "developer", "content": "d", "tools": [{"type": "function", "function": {"name": "f"}}]}]
    assert err(proto.parse_chat, {"model": "m", "messages": developer}).param == "messages[0].tools"


_T = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": {"f": 1}}, "tools"),
        ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"function": {"name": 3}}]}, "tools[0].function.name"),
        ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
        ({"tools": [{"function": {"name": "f", "description": 1}}]}, "tools[0].function.description"),
        ({"tool_choice": "auto"}, "tool_choice"),  # a choice without tools
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [_T], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [_T], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
        ({"tools": [_T], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [_T], "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ],
)
def test_tools_vllms_server_refuses_are_a_400_naming_the_field(extra, param):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": MSGS, **extra}
    e = err(proto.parse_chat, body)
    assert (e.status, e.param) == (400, param)
    with pytest.raises(Exception):  # noqa: B017 -- pydantic's ValidationError or vLLM's own
        ChatCompletionRequest(**body)


def test_a_chats_tool_choice_is_vllms():
    """Tools and no choice: "auto"; no tools: "none"; a named function is put as vLLM's model puts it."""
    assert proto.parse_chat({"model": "m", "messages": MSGS}).tool_choice == "none"
    assert proto.parse_chat({"model": "m", "messages": MSGS, "tools": [_T]}).tool_choice == "auto"
    named = {"type": "function", "function": {"name": "f"}}
    req = proto.parse_chat({"model": "m", "messages": MSGS, "tools": [_T], "tool_choice": named})
    assert req.tool_choice == named and req.template_kwargs["tools"] == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    ]
    # nothing for the template but its generation prompt
    no_tools = proto.parse_chat({"model": "m", "messages": MSGS, "tool_choice": "none"})
    assert no_tools.template_kwargs == {"add_generation_prompt": True}
    completion = {"model": "m", "prompt": "x", "tools": [_T]}
    assert err(proto.parse_completion, completion).code == "unsupported_parameter"  # a completion has no tools


@pytest.mark.parametrize(
    ("given", "passed"),
    [
        (None, {}),
        ({}, {}),
        ({"enable_thinking": False}, {"enable_thinking": False}),
        ({"enable_thinking": None, "mode": "auto", "x": 1}, {"x": 1}),  # vLLM leaves null and "auto" values out
        # the server's own settings: vLLM's request fields override the first two, the prompt is the same for
        # the other two
        ({"add_generation_prompt": False, "continue_final_message": True}, {}),
        ({"tokenize": True, "return_dict": True, "documents": [{"text": "d"}]}, {"documents": [{"text": "d"}]}),
    ],
)
def test_chat_template_kwargs_reach_the_template_as_vllm_passes_them(given, passed):
    body = {"model": "m", "messages": MSGS, "chat_template_kwargs": given}
    assert proto.parse_chat(body).template_kwargs == {**passed, "add_generation_prompt": True}


@pytest.mark.parametrize(
    ("given", "param"),
    [
        ([1], "chat_template_kwargs"),
        ("x", "chat_template_kwargs"),
        ({"chat_template": "{{ messages }}"}, "chat_template_kwargs.chat_template"),
        ({"chat_template": "auto"}, "chat_template_kwargs.chat_template"),  # vLLM refuses it before leaving "auto" out
        ({"tools": [{"type": "function"}]}, "chat_template_kwargs.tools"),
        # with `tokenize` true (vLLM then tokenises in apply_chat_template), settings that would cut the prompt
        ({"tokenize": True, "truncation": True}, "chat_template_kwargs.truncation"),
        ({"tokenize": True, "padding": "max_length"}, "chat_template_kwargs.padding"),
        ({"tokenize": True, "max_length": 4}, "chat_template_kwargs.max_length"),
        ({"return_assistant_tokens_mask": True}, "chat_template_kwargs.return_assistant_tokens_mask"),
        # what apply_chat_template passes the template itself: given again, its call fails
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"conversation": []}, "chat_template_kwargs.conversation"),
        ({"conversations": []}, "chat_template_kwargs.conversations"),
        ({"self": 1}, "chat_template_kwargs.self"),
        # transformers iterates documents and refuses any that is not an object
        ({"documents": 5}, "chat_template_kwargs.documents"),
        ({"documents": "x"}, "chat_template_kwargs.documents"),
        ({"documents": [1]}, "chat_template_kwargs.documents"),
        ({"documents": [{"text": "d"}, "e"]}, "chat_template_kwargs.documents"),
        ({"documents": True}, "chat_template_kwargs.documents"),
    ],
)
def test_chat_template_kwargs_that_are_no_template_variables_are_refused(given, param):
    e = err(proto.parse_chat, {"model": "m", "messages": MSGS, "chat_template_kwargs": given})
    assert (e.status, e.param) == (400, param)
    assert "\n" not in e.message


@pytest.mark.parametrize(
    "given",
    [
        # how the rendered text would be tokenised: nothing, as vLLM renders text unless `tokenize` is true
        {"padding": True},
        {"padding": "max_length", "max_length": 8},
        {"truncation": True, "max_length": "x"},
        {"return_tensors": "pt", "tokenizer_kwargs": {"add_special_tokens": True}},
        {"tokenize": False, "truncation": True},
        # ... and, tokenised, nothing for one text
        {"tokenize": True, "padding": True, "truncation": False},
        # vLLM's server sets these itself, whatever the request gives
        {"add_generation_prompt": "x", "continue_final_message": 1, "return_dict": "yes"},
        {"return_assistant_tokens_mask": False},
    ],
)
def test_chat_template_kwargs_that_change_nothing_for_a_rendered_text_are_accepted_and_dropped(given):
    body = {"model": "m", "messages": MSGS, "chat_template_kwargs": {**given, "flag": 1}}
    assert proto.parse_chat(body).template_kwargs == {"flag": 1, "add_generation_prompt": True}


@pytest.mark.parametrize("documents", [[], [{"title": "t", "text": "d"}], {}, ""])
def test_documents_are_passed_as_transformers_takes_them(documents):
    body = {"model": "m", "messages": MSGS, "chat_template_kwargs": {"documents": documents}}
    assert proto.parse_chat(body).template_kwargs == {"documents": documents, "add_generation_prompt": True}


def test_a_completions_null_max_tokens_is_its_default_as_in_vllms_request_model():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for body in ({"model": "m", "prompt": "x"}, {"model": "m", "prompt": "x", "max_tokens": None}):
        assert proto.parse_completion(body).params.get("max_tokens") == CompletionRequest(**body).max_tokens == 16


def test_an_echoed_completion_asks_for_its_prompts_log_probabilities_and_may_ask_for_no_answer():
    """vLLM's rules: echo with `logprobs` asks the engine for the prompt's too, at the same count; echo with
    max_tokens 0 generates one token and answers with the prompt alone. A chat's echo is its last message's
    text when that is the assistant's (the answer's role; parts joined as vLLM joins them), "" otherwise."""
    plain = proto.parse_completion({"model": "m", "prompt": "x", "echo": True})
    assert plain.echo and not plain.echo_only and "prompt_logprobs" not in plain.params
    scored = proto.parse_completion({"model": "m", "prompt": [1, 2], "echo": True, "logprobs": 2, "max_tokens": 0})
    assert scored.echo and scored.echo_only
    assert scored.params["max_tokens"] == 1 and scored.params["prompt_logprobs"] == 2 and scored.top_logprobs == 2
    unechoed = proto.parse_completion({"model": "m", "prompt": "x", "echo": False, "logprobs": 1})
    assert not unechoed.echo and "prompt_logprobs" not in unechoed.params
    user_last = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    assert proto.parse_chat({**user_last, "echo": True}).chat_echo == ""
    assert proto.parse_chat(user_last).chat_echo is None and not proto.parse_chat(user_last).echo
    parts = [{"type": "text", "text": "The answer"}, {"type": "text", "text": "is"}]
    started = {**user_last, "messages": [*user_last["messages"], {"role": "assistant", "content": parts}]}
    assert proto.parse_chat({**started, "echo": True}).chat_echo == "The answer\nis"
    # vLLM asks the engine for the echoed chat's prompt scores too (so it reads no cache for it), at the count
    # of alternatives asked for the answer, 0 without
    assert proto.parse_chat({**started, "echo": True}).params["prompt_logprobs"] == 0
    scored = proto.parse_chat({**started, "echo": True, "logprobs": True, "top_logprobs": 2})
    assert scored.params["prompt_logprobs"] == 2
    assert proto.parse_chat({**started, "echo": True, "prompt_logprobs": 1}).params["prompt_logprobs"] == 1
    assert proto.parse_chat(started).params.get("prompt_logprobs") is None
    assert proto.parse_chat({**started, "echo": False}).chat_echo is None
    e = err(proto.parse_chat, {**started, "echo": "yes"})
    assert (e.status, e.param, e.code) == (400, "echo", "invalid_type")


def test_a_prompts_log_probabilities_are_asked_as_vllm_takes_them():
    """vLLM's `prompt_logprobs` (0-20 here, -1 for the whole vocabulary refused as for `top_logprobs`); a stream
    carries none, so asking for some there is a 400, as on vLLM's server; 0 asks for nothing to show."""
    r = proto.parse_completion({"model": "m", "prompt": "x", "prompt_logprobs": 2})
    assert r.params["prompt_logprobs"] == 2 and not r.echo
    chat = proto.parse_chat({"model": "m", "messages": MSGS, "prompt_logprobs": 0, "stream": True})
    assert chat.params["prompt_logprobs"] == 0
    for body in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        e = err(proto.parse_completion, {"model": "m", "prompt": "x", **body})
        assert (e.status, e.param) == (400, "prompt_logprobs")
    # an echo's derived count does not replace the one asked for
    echoed = proto.parse_completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 3, "prompt_logprobs": 1})
    assert echoed.params["prompt_logprobs"] == 1
