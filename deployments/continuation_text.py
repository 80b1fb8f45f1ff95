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

Stop strings too: vLLM holds back the last (longest stop string - 1) characters of a stream that has stop
strings, and cuts the text where one completes. The new replica sees only its own tokens' text, so it
could neither send what the dead replica held back nor find a stop string that spans the move. So the
ingress keeps the whole output text (the tokens sent plus the new ones), searches it as vLLM does
(`first_stop`, after `min_tokens` output tokens) and sends from what the client already has up to the
held-back tail, or to the stop string, where the stream ends (`stopped`); the tokens after the one that
completed it are dropped, as vLLM drops them. A stop token (EOS, or one of `stop_token_ids`) that ends the
request is counted but never decoded: vLLM leaves its text out of the output. With
`include_stop_str_in_output` vLLM holds nothing back, keeps the stop string in the text and decodes the stop
token too; so does this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

# vLLM's FastIncrementalDetokenizer recovers from this DecodeStream error by starting a fresh stream
INVALID_PREFIX = "Invalid prefix encountered"


def first_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """(stop string, where it starts) for the stop string completing earliest in `text`, searched as far
    back as one that ends within its last `new_chars` characters could start; ties to the first listed.
    vLLM's rule for stop strings (its `check_stop_strings`)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at != -1 and (best is None or at + len(stop) < best[1] + len(best[0])):
            best = (stop, at)
    return best


class ContinuationText:
    """Incremental text for the new tokens of a continuation (`take(token_ids, finished, stop_token)`)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        sent_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        delivered_chars: int | None = None,
        include_stop: bool = False,
    ):
        self._tokenizer = tokenizer  # a `tokenizers.Tokenizer` (a fast HF tokenizer's `_tokenizer`)
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self._stops = [x for x in stop if x]
        self._include = include_stop  # include_stop_str_in_output
        # vLLM's stop buffer: none when the stop string is kept in the text
        self._hold = 0 if include_stop else max((len(x) for x in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        self._tokens = len(sent_ids)
        # the whole output text so far: the dead replica's for the tokens it sent (no stop string had
        # completed in it, or it would have finished), of which the client has `delivered_chars`
        self.output = "".join(self.step(token) for token in sent_ids)
        self._delivered = len(self.output) if delivered_chars is None else min(delivered_chars, len(self.output))
        self.stopped: str | None = None  # the stop string the output ended at

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

    def take(self, token_ids: Sequence[int], finished: bool = False, stop_token: bool = False) -> tuple[str, int]:
        """(the text to send for these new tokens, how many of them are kept). The text is what the client
        lacks, less the held-back tail unless `finished` (the engine ended the request) or a stop string
        completed. With `stop_token` the last id is the stop token (EOS or one of `stop_token_ids`) that
        ended the request: counted, and decoded only when the stop is kept in the text (vLLM's detokenizer
        skips it otherwise). Tokens after the one completing a stop string are not kept: vLLM drops them, and
        usage must not count them."""
        kept = 0
        for i, token in enumerate(token_ids):
            if self.stopped is not None:
                break
            kept += 1
            self._tokens += 1
            if stop_token and i == len(token_ids) - 1 and not self._include:
                break
            new = self.step(token)
            self.output += new
            if self._stops and new and self._tokens > self._min_tokens:
                found = first_stop(self.output, len(new), self._stops)
                if found is not None:  # the text ends where the stop string starts, or after it when kept
                    end = found[1] + len(found[0]) if self._include else found[1]
                    self.stopped, self.output = found[0], self.output[:end]
        end = len(self.output) if finished or self.stopped is not None else len(self.output) - self._hold
        out = self.output[self._delivered : end] if end > self._delivered else ""
        self._delivered = max(self._delivered, end)
        return out, kept

    def text(self, token_ids: Sequence[int], finished: bool = False, stop_token: bool = False) -> str:
        """`take`'s text alone."""
        return self.take(token_ids, finished, stop_token)[0]


def rust_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (what vLLM's detokenizer uses)."""
    inner = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
    if inner is None:
        raise TypeError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend to detokenize with")
    return inner
