"""Token log-probabilities in an answer, in the shapes vLLM's server gives them (no Ray, no vLLM: unit-testable).

The engine reports, for each new token, the sampled token's log-probability and the top ones by rank
(`engine.logprob_rows`: (id, logprob, rank, decoded text), the sampled token first, in vLLM's order). A chat
gets them as OpenAI's `logprobs.content` (each token with its bytes and its `top_logprobs`), a completion as
`tokens`, `token_logprobs`, `top_logprobs` and `text_offset`, by vLLM's rules: a log-probability below
-9999 is -9999 (OpenAI's stand-in for minus infinity), a token's text is the engine's decoded text, or the
tokenizer's where the engine gave none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Row = Sequence[tuple[int, float, "int | None", "str | None"]]
FLOOR = -9999.0


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def id_placeholder(token_id: int) -> str:
    """A token shown as its id (vLLM's `return_tokens_as_token_ids`: text a client need not decode)."""
    return f"token_id:{token_id}"


def chat_logprobs(
    token_ids: Sequence[int], rows: Sequence[Row], top: int, decode: Callable[[int], str], as_ids: bool = False
) -> dict:
    """`choices[i].logprobs` of a chat answer (or of a streamed chunk, for its tokens): `top` alternatives per
    token (the request's `top_logprobs`), taken in the engine's order as vLLM takes them. `as_ids`: every token
    shown as `id_placeholder`, the sampled token's bytes still its text's, as vLLM's server shows them."""
    content = []
    for token_id, row in zip(token_ids, rows):
        step = {tid: (lp, decoded) for tid, lp, _, decoded in row}
        if token_id not in step:  # the engine gave no log-probability for it: its text only, as vLLM
            token = id_placeholder(token_id) if as_ids else decode(token_id)
            content.append({"token": token, "logprob": FLOOR, "bytes": _bytes(token), "top_logprobs": []})
            continue
        logprob, decoded = step[token_id]
        alternatives = []
        for i, (tid, (lp, text)) in enumerate(step.items()):
            if i >= top:
                break
            alt = id_placeholder(tid) if as_ids else text if text is not None else decode(tid)
            alternatives.append({"token": alt, "logprob": max(lp, FLOOR), "bytes": _bytes(alt)})
        shown = id_placeholder(token_id) if as_ids else decoded if decoded is not None else decode(token_id)
        content.append(
            {
                "token": shown,
                "logprob": max(logprob, FLOOR),
                "bytes": None if decoded is None else _bytes(decoded),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int],
    rows: Sequence[Row],
    top: int,
    decode: Callable[[int], str],
    offset: int = 0,
    as_ids: bool = False,
) -> dict:
    """`choices[i].logprobs` of a completion (or of a streamed chunk, for its tokens, its text offsets going on
    from `offset`): the sampled token and `top` alternatives per token (`top` + 1 entries, OpenAI's rule as
    vLLM applies it), each token's offset in the answer's text. `as_ids`: every token shown as
    `id_placeholder`, the offsets going on by those, as vLLM's server counts them."""
    if as_ids:
        decode = id_placeholder
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, row in zip(token_ids, rows):
        step = {tid: (lp, decoded) for tid, lp, _, decoded in row}
        if not step:
            token = decode(token_id)
            token_logprobs.append(None)
            tops.append(None)
        else:
            logprob, decoded = step[token_id]
            token = decoded if decoded is not None and not as_ids else decode(token_id)
            token_logprobs.append(max(logprob, FLOOR))
            tops.append(
                {
                    (text if text is not None and not as_ids else decode(tid)): max(lp, FLOOR)
                    for i, (tid, (lp, text)) in enumerate(step.items())
                    if i <= top
                }
            )
        offsets.append(offset if not offsets else offsets[-1] + len(tokens[-1]))
        tokens.append(token)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


def next_offset(logprobs: dict, offset: int) -> int:
    """Where a stream's next chunk's text offsets start: after the tokens just reported (not after the chunk's
    text, which lags them while a stop string may be forming), as vLLM counts them."""
    if logprobs["tokens"]:
        return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
    return offset


def prompt_scores(rows: Sequence[Row]) -> list[dict[str, dict] | None]:
    """A choice's `prompt_logprobs` (vLLM's extension, in its raw shape): per prompt token, none for the first,
    then each scored token id (the prompt's own first, then the top ones by rank) to its log-probability,
    rank and decoded text, -inf as -9999 (vLLM's `clamp_prompt_logprobs`)."""
    out: list[dict[str, dict] | None] = []
    for i, row in enumerate(rows):
        if i == 0 or not row:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {"logprob": FLOOR if lp == float("-inf") else lp, "rank": rank, "decoded_token": text}
                for tid, lp, rank, text in row
            }
        )
    return out
