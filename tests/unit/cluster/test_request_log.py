"""The request log reader: endpoint inference, one-line errors naming the line, the bundled example."""

import json

import pytest
from tiny_chat import tiny_tokenizer

from kvmesh.cluster.app_log import example_log
from kvmesh.cluster.request_log import CHAT, COMPLETIONS, RequestLogError, read_request_log


def _write(tmp_path, lines):
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_only_body_is_required_and_the_endpoint_is_inferred(tmp_path):
    p = _write(
        tmp_path,
        [
            json.dumps({"body": {"messages": [{"role": "user", "content": "hi"}]}}),
            json.dumps({"body": {"prompt": "hello"}, "tenant": "t1", "interaction": "x", "timestamp": 2}),
        ],
    )
    a, b = read_request_log(p)
    assert (a.id, a.endpoint, a.tenant, a.interaction) == ("line-1", CHAT, None, "line-1")
    assert (b.endpoint, b.tenant, b.interaction, b.timestamp) == (COMPLETIONS, "t1", "x", 2.0)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not JSON"),
        (json.dumps({"id": "a"}), "line 2: 'body' must be"),
        (json.dumps({"body": {"prompt": "x"}, "endpoint": "/v1/embeddings"}), "line 2: unknown endpoint"),
        (json.dumps({"body": {"prompt": "x"}, "endpoint": CHAT}), "line 2: endpoint /v1/chat/completions needs"),
        (json.dumps({"body": {"input": "x"}}), "line 2: body has neither"),
        (json.dumps({"body": {"prompt": [1, "a"]}}), "line 2: 'prompt' must be"),
        (json.dumps({"body": {"messages": [{"content": "x"}]}}), "line 2: messages[0] needs a 'role'"),
        (json.dumps({"body": {"prompt": "x"}, "timestamp": "now"}), "line 2: 'timestamp'"),
        (json.dumps({"id": "line-1", "body": {"prompt": "x"}}), "line 2: id 'line-1' already used on line 1"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, line, message):
    p = _write(tmp_path, [json.dumps({"body": {"prompt": "ok"}}), line])
    with pytest.raises(RequestLogError) as err:
        read_request_log(p)
    assert message in str(err.value) and str(p) in str(err.value)
    assert "\n" not in str(err.value)


def test_an_unreadable_line_is_named(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_bytes(b'{"body": {"prompt": "ok"}}\n\xff\xfe\n')
    with pytest.raises(RequestLogError, match="line 2: not UTF-8"):
        read_request_log(p)


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(RequestLogError, match="cannot open"):
        read_request_log(tmp_path / "nope.jsonl")
    with pytest.raises(RequestLogError, match="no requests"):
        read_request_log(_write(tmp_path, [""]))


def test_the_bundled_example_log_is_the_generator_output_and_has_the_promised_shapes():
    from pathlib import Path

    import kvmesh.cluster as cluster_pkg

    bundled = Path(next(iter(cluster_pkg.__path__))) / "traces" / "app_log.jsonl"
    reqs = read_request_log(bundled)
    assert [json.loads(line) for line in bundled.read_text().splitlines()] == json.loads(
        json.dumps(example_log(), sort_keys=True)
    )
    assert len({r.tenant for r in reqs}) >= 3
    assert {r.extra["variant"] for r in reqs} >= {"plain", "template", "whitespace", "tool_order"}
    assert any(r.endpoint == COMPLETIONS for r in reqs) and any(len(r.body.get("messages", [])) >= 4 for r in reqs)
    assert any("Tools" in r.body["messages"][0]["content"] for r in reqs if r.is_chat)


def test_a_chat_template_that_fails_bare_after_its_checks_falls_back_to_the_tokenizers():
    """After its first renders were checked against the tokenizer's, the compiled template renders alone; one
    that then fails (a message shape the first ones lacked) used to call itself until RecursionError."""
    from kvmesh.cluster.request_log import ChatRenderer

    class Tokenizer:
        chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | no_such_filter if m['role'] == 'tool' else m['content'] }}\n{% endfor %}"  # noqa: E501
        special_tokens_map = {"bos_token": "<s>"}

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    render = ChatRenderer(Tokenizer())
    for i in range(6):
        assert render([{"role": "user", "content": f"hi {i}"}]) == f"user: hi {i}\n"
    assert render([{"role": "tool", "content": "x"}]) == "tool: x\n"


def test_a_logged_request_is_tokenised_as_the_ingress_tokenises_it():
    """The cache test predicts from the ids the ingress will make: the same messages for the template (text
    parts joined by newlines, developer as system, names kept), the same special tokens (a completion's BOS)."""
    from kvmesh.cluster.request_log import LoggedRequest, prompt_ids, template_messages
    from kvmesh.deployments.openai_protocol import parse_chat

    class Tokenizer:
        def __init__(self):
            self.seen: list = []

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            self.seen.append(messages)
            return "|".join(f"{m['role']}:{m.get('name', '')}:{m['content']}" for m in messages)

        def encode(self, text, add_special_tokens=True):
            return ([0] if add_special_tokens else []) + [ord(c) for c in text]

    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    tok = Tokenizer()
    chat = LoggedRequest("c", {"model": "m", "messages": messages}, CHAT)
    ids = prompt_ids(chat, tok)
    served = template_messages(parse_chat({"model": "m", "messages": messages}).messages, None)
    assert tok.seen[-1] == served and ids[0] != 0
    completion = LoggedRequest("p", {"model": "m", "prompt": "hi"}, COMPLETIONS)
    assert prompt_ids(completion, tok) == [0, ord("h"), ord("i")]


TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    "message, said",
    [
        (
            {"role": "assistant", "content": None, "tool_calls": [{**TOOL_CALL, "function": {"name": "weather"}}]},
            "'messages[1].tool_calls[0]' must be",
        ),
        ({"role": "user", "content": None}, "messages[1].content must be a string or a list of text parts"),
        (
            {"role": "tool", "tool_call_id": 5, "content": "sunny"},
            "'messages[1].tool_call_id' must be a string",
        ),
        ({"role": "function", "content": "sunny"}, "messages[1].role must be one of system, developer, user"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "messages[1].content: only text parts"),
        ({"role": "user", "content": "x", "name": 7}, "messages[1].name must be a string"),
    ],
)
def test_a_logged_message_the_ingress_refuses_is_refused_with_the_ingress_reason(tmp_path, message, said):
    """A chat kvmesh's ingress would refuse (`openai_protocol.parse_chat`) is not rendered into a prompt with
    the literal text 'None' or a role the template never sees: the log's reader gives the ingress's reason."""
    from kvmesh.deployments import openai_protocol

    body = {"messages": [{"role": "user", "content": "weather in Paris?"}, message]}
    with pytest.raises(openai_protocol.OpenAIError) as ingress:
        openai_protocol.parse_chat(body)
    p = _write(tmp_path, [json.dumps({"body": {"prompt": "ok"}}), json.dumps({"body": body})])
    with pytest.raises(RequestLogError) as err:
        read_request_log(p)
    assert str(err.value) == f"{p} line 2: {ingress.value.message.rstrip('.')}"
    assert str(err.value).startswith(f"{p} line 2: {said}") and "\n" not in str(err.value)


def test_a_logged_chat_the_ingress_serves_is_read_and_templated_as_the_ingress_templates_it(tmp_path):
    from kvmesh.cluster.request_log import template_messages
    from kvmesh.deployments import openai_protocol

    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
            {"role": "assistant", "content": ""},
        ]
    }
    [req] = read_request_log(_write(tmp_path, [json.dumps({"body": body})]))
    served = openai_protocol.parse_chat({"model": "m", **body}).messages
    checked = [openai_protocol.chat_message(m, i) for i, m in enumerate(req.body["messages"])]
    assert checked == served
    assert template_messages(checked, None) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]


# content-format cases: vLLM's detection (renderers/hf.py) is the reference for each
CONTENT_FORMAT_TEMPLATES = [
    "{% for message in messages %}{{ message['content'] }}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    # through a {% set %} alias, a slice and filters
    "{% set msgs = messages %}{% set rest = msgs[1:] %}{% for m in rest | list %}"
    "{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}",
    # the content handed to a macro, by position and by keyword, under another name
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(x, c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(1, c=m['content']) }}{% endfor %}",
    # a macro looping over what is not the content; one whose parameter is named content but is given none
    "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ show(m.role) }}"
    "{% endfor %}",
    "{% macro show(content) %}{% for p in content %}{{ p }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.role) }}{% endfor %}",
    # a loop over a variable named content outside macros
    "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
    # a tuple target the rule cannot follow; a template that does not parse or compile
    "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}",
    "{{ messages | no_such_filter }}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
    # transformers' {% generation %} block and loop controls
    "{% for m in messages %}{% generation %}{% for p in m.content %}{% if loop.first %}{% continue %}{% endif %}"
    "{{ p.text }}{% endfor %}{% endgeneration %}{% endfor %}",
    # Qwen-style: content read as a string only
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}{{ content }}{%- endfor %}",
]


@pytest.mark.parametrize("template", CONTENT_FORMAT_TEMPLATES)
def test_a_templates_content_format_is_detected_as_vllm_detects_it(template):
    """Whether a chat template gets a message's text parts as a list ("openai") or joined ("string"): the
    answer of vLLM 0.32's own detection (its `--chat-template-content-format auto`) for every template."""
    from vllm.renderers.hf import _detect_content_format, _detect_developer_role_support

    from kvmesh.cluster.request_log import content_format, supports_developer

    assert content_format(template) == _detect_content_format(template, default="string")
    for named in (template, template + "{% if m.role == 'developer' %}{% endif %}"):
        assert supports_developer(named) == _detect_developer_role_support(named)


ONE_MESSAGE = (
    "{% if messages | length > 1 %}{{ raise_exception('Only one message, please.\\nSee the docs.') }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
)
ADDS_A_NUMBER = "{% for m in messages %}{{ m['content'] + (1 if m['role'] == 'assistant' else '') }}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (ONE_MESSAGE, "the model's chat template refused it: Only one message, please. See the docs."),
        (ADDS_A_NUMBER, "the model's chat template refused it: "),  # a TypeError out of the render, not a template's
    ],
)
def test_a_logged_chat_the_models_template_fails_on_is_an_error_naming_its_line(tmp_path, template, reason):
    """The ingress answers it with a 400: the log's reader says which line, on one line (`kvmesh cachetest` exits 2),
    whether it renders through the tokenizer or its compiled template."""
    from kvmesh.cluster.cachetest_analysis import prepare
    from kvmesh.cluster.request_log import ChatRenderer, prompt_ids, prompt_text

    ok = {"messages": [{"role": "user", "content": "hi"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    p = _write(tmp_path, [json.dumps({"body": ok}), json.dumps({"body": ok}), json.dumps({"body": bad})])
    reqs = read_request_log(p)
    tok = tiny_tokenizer(template)
    for attempt in (
        lambda: prepare(reqs, tok, 16),
        lambda: prompt_ids(reqs[2], tok),
        lambda: [prompt_text(r, tok, ChatRenderer(tok, verify=0)) for r in reqs],
    ):
        with pytest.raises(RequestLogError) as err:
            attempt()
        assert str(err.value).startswith(f"{p} line 3: {reason}") and "\n" not in str(err.value)


def test_a_logged_prompt_the_tokenizer_refuses_is_an_error_naming_its_line(tmp_path):
    """A lone UTF-16 surrogate (JSON allows it; the ingress answers a 400)."""
    from kvmesh.cluster.cachetest_analysis import prepare

    lines = [
        json.dumps({"body": {"prompt": "fine"}}),
        json.dumps({"body": {"messages": [{"role": "user", "content": "a\ud800b"}]}}),
    ]
    reqs = read_request_log(_write(tmp_path, lines))
    with pytest.raises(RequestLogError, match=r"line 2: the prompt cannot be tokenized: it holds a lone UTF-16"):
        prepare(reqs, tiny_tokenizer(), 16)


def test_chat_template_kwargs_a_vllm_server_ignores_when_it_renders_text_are_read(tmp_path):
    """`padding` and the like are apply_chat_template's tokenising settings: the text it renders is the same."""
    from kvmesh.cluster.request_log import prompt_ids

    plain = {"messages": [{"role": "user", "content": "hi"}]}
    lines = [
        json.dumps({"body": plain}),
        json.dumps({"body": {**plain, "chat_template_kwargs": {"padding": True}}}),
        json.dumps({"body": {**plain, "chat_template_kwargs": {"truncation": True, "max_length": 2}}}),
    ]
    reqs = read_request_log(_write(tmp_path, lines))
    tok = tiny_tokenizer()
    assert prompt_ids(reqs[0], tok) == prompt_ids(reqs[1], tok) == prompt_ids(reqs[2], tok)


def test_the_compiled_template_renders_what_apply_chat_template_renders_after_its_checks():
    """transformers' own compile: its `tojson` does not escape HTML characters as Jinja's does, and the request's
    variables override the special tokens, as in apply_chat_template."""
    from kvmesh.cluster.request_log import CHAT, ChatRenderer, LoggedRequest, prompt_text

    tok = tiny_tokenizer(
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    render = ChatRenderer(tok)
    for i in range(5):
        body = {"messages": [{"role": "user", "content": f"plain {i}"}]}
        prompt_text(LoggedRequest(f"r{i}", body, CHAT), tok, render)
    assert render.verify == 0 and render.template is not None
    for body in (
        {"messages": [{"role": "user", "content": "if a < b && c > d: print('x')"}]},
        {"messages": [{"role": "user", "content": "é"}], "chat_template_kwargs": {"bos_token": "<B>"}},
    ):
        req = LoggedRequest("r", body, CHAT)
        assert prompt_text(req, tok, render) == prompt_text(req, tok)
    assert render.template is not None


def test_empty_text_parts_are_dropped_before_the_parts_are_joined_as_vllm_drops_them():
    from kvmesh.cluster.request_log import content_text

    parts = [{"type": "text", "text": t} for t in ("a", "", "b", "")]
    assert content_text(parts) == "a\nb"
    assert content_text([{"type": "text", "text": ""}]) == ""
    assert content_text([{"type": "text", "text": " "}, {"type": "text", "text": "b"}]) == " \nb"
