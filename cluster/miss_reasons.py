"""Why each uncached prompt token missed: exactly one reason per token, so per request the reasons sum to
its uncached tokens (`prompt_tokens - cached_tokens`).

Reasons, walked over the uncached positions [cached, n) of one prompt of n tokens, blocks of B tokens:
- `partial_block`: positions at or past ((n - 1) // B) * B, the tail vLLM never serves from cache (only
  full blocks are cached and the last prompt token is always computed); and, in the first block never
  computed, the tokens up to `partial_end` that do match an earlier prompt (a match shorter than a block);
- in full blocks that this tenant and model computed before (`seen_blocks`, a leading-block count):
  `misrouted` up to the prefix another replica or tier held at placement (`elsewhere_blocks`, from the
  router), then `partial_chunk` up to the prefix an LMCache tier held but could load only in part, as it
  loads whole chunks (`tier_blocks`, from the router), `evicted` beyond; `unknown` when no router told us
  (a peer endpoint);
- in full blocks never computed for this tenant and model: `isolated` up to the prefix another tenant
  computed (same tokens, another salt) -- but `adapter` first, up to the prefix the same tenant computed
  under another model or adapter -- then `drift` up to the end of the prompt's leading messages (or lines)
  whose text matches an earlier prompt's while the token ids differ (template, whitespace, tool order,
  tokenizer), and `cold` for the rest.
Every limit is a prefix length, so the partition is computed in O(1) per request (`attribute`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

REASONS = (
    "cold",
    "evicted",
    "misrouted",
    "partial_chunk",
    "isolated",
    "partial_block",
    "drift",
    "adapter",
    "unknown",
)


def attribute(
    n: int,
    cached: int,
    block_size: int,
    *,
    seen_blocks: int = 0,
    isolated_blocks: int = 0,
    adapter_blocks: int = 0,
    drift_end: int = 0,
    partial_end: int = 0,
    elsewhere_blocks: int | None = None,
    tier_blocks: int = 0,
) -> dict[str, int]:
    """Uncached tokens by reason (only non-zero reasons); the values sum to max(0, n - cached)."""
    cached = max(0, min(cached, n))
    out: dict[str, int] = {}
    cacheable_end = max(cached, ((n - 1) // block_size) * block_size) if n > 0 else 0
    if n > cacheable_end:
        out["partial_block"] = n - cacheable_end
    pos = cached
    seen_end = min(cacheable_end, max(pos, seen_blocks * block_size))
    if seen_end > pos:
        if elsewhere_blocks is None:
            out["unknown"] = seen_end - pos
        else:
            elsewhere = min(seen_end, max(pos, elsewhere_blocks * block_size))
            _add(out, "misrouted", elsewhere - pos)
            in_tier = min(seen_end, max(elsewhere, tier_blocks * block_size))
            _add(out, "partial_chunk", in_tier - elsewhere)
            _add(out, "evicted", seen_end - in_tier)
        pos = seen_end
    # a match that ends inside the next block (shorter than a block, so never cacheable); one running on past it
    # (the same prompt under another model, say) is no partial block: the reasons after this one say why
    partial_limit = partial_end if partial_end < (pos // block_size + 1) * block_size else 0
    for reason, limit in (
        ("partial_block", partial_limit),
        ("adapter", adapter_blocks * block_size),
        ("isolated", isolated_blocks * block_size),
        ("drift", drift_end),
    ):
        upto = min(cacheable_end, max(pos, limit))
        _add(out, reason, upto - pos)
        pos = upto
    _add(out, "cold", cacheable_end - pos)
    return out


def _add(out: dict[str, int], reason: str, tokens: int) -> None:
    if tokens > 0:
        out[reason] = out.get(reason, 0) + tokens


# ----------------------------------------------------------------------------------- text units
_WORD = re.compile(r"\w+")
_MARKUP = re.compile(r"<\|[^|>]*\|>|</?s>")  # chat-template special tokens: markup, not words


@lru_cache(maxsize=65536)
def unit_key(role: str, text: str) -> tuple:
    """What "the same text" means for drift: the words of a message, in any order (so whitespace,
    punctuation, template separators and tool order do not count), and its role."""
    return (role, tuple(sorted(w.lower() for w in _WORD.findall(text))))


def text_units(
    rendered: str, contents: Sequence[tuple[str, str | Sequence[str]]], offsets: Sequence[tuple[int, int]]
) -> list:
    """[(key, token_end)] for each message found in order in `rendered`, until one is not; token_end is the
    index just past the last token that overlaps the message (`offsets`: per token (start, end) chars). A
    message is (role, its text), or (role, its texts in the order its template renders them: a list of text
    parts, each found in turn; its key is their words). A text is looked for as it is, then without its
    surrounding whitespace (a template that trims it)."""
    units = []
    pos = 0
    tok = 0
    for role, content in contents:
        texts = [content] if isinstance(content, str) else [t for t in content if t]
        end_char = _find_in_order(rendered, texts, pos)
        if end_char < 0:
            break
        while tok < len(offsets) and offsets[tok][0] < end_char:
            tok += 1
        units.append((unit_key(role, "\n".join(texts)), tok))
        pos = end_char
    return units


def _find_in_order(rendered: str, texts: Sequence[str], pos: int) -> int:
    """The end of the last of `texts` found one after another in `rendered` from `pos`; -1 when one is not (or
    there is no text)."""
    if not texts or not any(texts):
        return -1
    for text in texts:
        at = rendered.find(text, pos)
        if at < 0 and text.strip() and text.strip() != text:
            text = text.strip()
            at = rendered.find(text, pos)
        if at < 0:
            return -1
        pos = at + len(text)
    return pos


def drift_kind(a: str, b: str) -> str:
    """A label for why two texts with the same words tokenise differently."""
    if "".join(a.split()) == "".join(b.split()):
        return "whitespace"
    wa, wb = (_WORD.findall(_MARKUP.sub(" ", t).lower()) for t in (a, b))
    if wa == wb:
        return "template"
    if sorted(wa) == sorted(wb):
        return "tool order"
    return "tokenizer"
