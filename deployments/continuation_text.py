"""The text of a migrated stream, detokenized in the ingress as the dead replica would have done it.

Why: a continuation is a new engine request whose prompt is the original prompt plus the tokens the
client already has. vLLM primes its detokenizer (tokenizers' DecodeStream) with that prompt, and a
prompt whose tail holds an incomplete or invalid UTF-8 sequence (the first bytes of a character, or
byte tokens that never form one) leaves DecodeStream holding back text it then emits with the first
new token: the client would see part of its text twice, or the prompt. The token ids a continuation
streams are exact (greedy decoding, same prefix); only their text is suspect. So the ingress replays
the dead replica's detokenizer: a DecodeStream primed with the original prompt, stepped through the
tokens already sent (their text is what the client has), then stepped through each new token. That
is the same library and the same algorithm vLLM runs (`FastIncrementalDetokenizer`), so the client
gets the text an untouched run would have sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

# vLLM's FastIncrementalDetokenizer recovers from this DecodeStream error by starting a fresh stream
INVALID_PREFIX = "Invalid prefix encountered"


class ContinuationText:
    """Incremental text for the new tokens of a continuation (`step(token_id) -> text`)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], sent_ids: Sequence[int], skip_special_tokens=True):
        self._tokenizer = tokenizer  # a `tokenizers.Tokenizer` (a fast HF tokenizer's `_tokenizer`)
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        for token in sent_ids:  # the text of these reached the client from the dead replica
            self.step(token)

    def step(self, token_id: int) -> str:
        """The text `token_id` adds ("" while the detokenizer holds it back), as vLLM's step does."""
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            text = None
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            text = self._stream.step(self._tokenizer, token_id)
        return text or ""

    def text(self, token_ids: Sequence[int]) -> str:
        return "".join(self.step(t) for t in token_ids)


def rust_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (what vLLM's detokenizer uses)."""
    inner = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
    if inner is None:
        raise TypeError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend to detokenize with")
    return inner
