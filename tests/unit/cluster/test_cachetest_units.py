"""cachetest's drift units: each message of a logged chat found in its rendered prompt, as the template got it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvmesh.cluster.cachetest_analysis import prepare
from kvmesh.cluster.miss_reasons import text_units, unit_key
from kvmesh.cluster.request_log import CHAT, LoggedRequest

# Gemma 3's content handling on the tiny model's role markers: it loops over a message's parts and trims them
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _tokenizer(template: str | None = None):
    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    tok = AutoTokenizer.from_pretrained(
        build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")
    )
    if template is not None:
        tok.chat_template = template
    return tok


def _units(messages: list[dict], template: str | None):
    tok = _tokenizer(template)
    [p] = prepare([LoggedRequest("r", {"messages": messages}, CHAT)], tok, 16)
    return p


PARTS = [{"type": "text", "text": "Context: the red fox. "}, {"type": "text", "text": " Question: what colour?"}]


def test_a_template_that_loops_over_parts_has_a_unit_per_message():
    """The parts render one after another without the newline `content_text` joins them with: each is found in
    turn (trimmed by the template: found without its surrounding whitespace)."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": PARTS},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "and the dog?"},
    ]
    p = _units(messages, PARTS_TEMPLATE)
    assert [key for key, _ in p.units] == [
        unit_key("system", "be brief"),
        unit_key("user", "Context: the red fox. \n Question: what colour?"),
        unit_key("assistant", "red"),
        unit_key("user", "and the dog?"),
    ]
    ends = [end for _, end in p.units]
    assert ends == sorted(ends) and ends[-1] < len(p.tok.ids)


def test_a_developer_message_merged_into_the_system_message_is_one_unit_and_the_rest_follow():
    """The tiny model's template does not know the developer role: its text is merged into the leading system
    message, where the units are looked for, and every later message still has its unit."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "developer", "content": "now answer in French"},
        {"role": "user", "content": "and the dog?"},
    ]
    p = _units(messages, None)
    assert [key for key, _ in p.units] == [
        unit_key("system", "be brief now answer in French"),
        unit_key("user", "hi"),
        unit_key("assistant", "hello"),
        unit_key("user", "and the dog?"),
    ]


@pytest.mark.parametrize(
    ("contents", "found"),
    [
        ([("user", ["alpha", "beta"]), ("assistant", "gamma")], 2),
        ([("user", ["beta", "alpha"]), ("assistant", "gamma")], 0),  # in order only
        ([("user", ["", "alpha", ""]), ("assistant", "gamma")], 2),  # empty parts render nothing
        ([("user", []), ("assistant", "gamma")], 0),  # no text: the search stops, as for an empty string
        ([("user", "  alpha"), ("assistant", " gamma ")], 2),  # a trimmed text found without its whitespace
    ],
)
def test_text_units_find_each_part_in_turn(contents, found):
    rendered = "[U]alpha beta[E][A]gamma[E]"
    offsets = [(i, i + 1) for i in range(len(rendered))]
    units = text_units(rendered, contents, offsets)
    assert len(units) == found
    if found:
        assert units[-1][1] == rendered.index("gamma") + len("gamma")
