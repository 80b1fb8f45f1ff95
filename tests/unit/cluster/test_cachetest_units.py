"""cachetest's drift units: each message of a logged chat found in its rendered prompt, as the template got it."""

from __future__ import annotations

import pytest
from tiny_chat import PARTS_TEMPLATE, tiny_tokenizer

from kvmesh.cluster.cachetest_analysis import prepare
from kvmesh.cluster.miss_reasons import text_units, unit_key
from kvmesh.cluster.request_log import CHAT, LoggedRequest


def _units(messages: list[dict], template: str | None):
    tok = tiny_tokenizer(template)
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
