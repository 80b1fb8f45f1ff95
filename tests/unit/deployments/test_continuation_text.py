"""A migrated stream's text, replayed in the ingress, against vLLM's own detokenizer: the text a client
gets from the dead replica up to any token plus `ContinuationText` from there is exactly what vLLM's
`FastIncrementalDetokenizer` gives an untouched run, on token sequences full of incomplete UTF-8 (the
tiny model's usual output); priming vLLM's detokenizer with the continuation prompt does not."""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.deployments.continuation_text import ContinuationText, rust_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    where = Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0"
    return AutoTokenizer.from_pretrained(build_tiny_model(where))


def _vllm_texts(tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """The text vLLM's detokenizer streams for each of `output`'s tokens after `prompt`."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1))
    detok = FastIncrementalDetokenizer(tokenizer, request)
    return [detok.decode_next(t) for t in output]


def _draw(tokenizer, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    return [rng.choice(vocab) for _ in range(48)], [rng.choice(vocab) for _ in range(80)]


def test_replayed_text_continues_exactly_where_the_dead_replica_stopped(tokenizer):
    naive_differs = 0
    for seed in range(6):
        prompt, output = _draw(tokenizer, seed)
        texts = _vllm_texts(tokenizer, prompt, output)
        assert "\ufffd" in "".join(texts)  # the case at hand: invalid and incomplete UTF-8 in the output
        for k in range(1, len(output)):
            want = "".join(texts[k:])
            got = ContinuationText(rust_tokenizer(tokenizer), prompt, output[:k]).text(output[k:])
            assert got == want, (seed, k)
            naive = "".join(_vllm_texts(tokenizer, prompt + output[:k], output[k:]))
            naive_differs += naive != want
    assert naive_differs  # the new replica's own text would have been wrong somewhere


def test_a_tokenizer_without_a_fast_backend_is_refused():
    with pytest.raises(TypeError, match="fast"):
        rust_tokenizer(object())


def _vllm_stream(
    tokenizer, prompt: list[int], output: list[int], stop: list[str], min_tokens: int, include: bool = False
) -> list[str]:
    """The text vLLM streams (DELTA) for each of `output`'s tokens until a stop string ends it (kept in the text
    with `include`: `include_stop_str_in_output`)."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(
        max_tokens=len(output), stop=stop, min_tokens=min_tokens, include_stop_str_in_output=include
    )
    detok = FastIncrementalDetokenizer(
        tokenizer, SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=params)
    )
    texts = []
    for i, token in enumerate(output):
        stopped = detok.update([token], False)
        texts.append(detok.get_next_output_text(stopped is not None or i == len(output) - 1, True))
        if stopped is not None:
            break
    return texts


@pytest.mark.parametrize("include", [False, True], ids=["stop cut", "stop kept"])
def test_a_continuation_holds_back_and_stops_at_stop_strings_as_vllm_does(tokenizer, include):
    """With stop strings vLLM holds back the text a stop string could begin with and cuts the text where one
    completes: a stream moved after any token ends with exactly the untouched run's text, the held-back
    characters sent, a stop string spanning the move found, and none leaked. With include_stop_str_in_output
    it holds nothing back and the text ends with the stop string."""
    backend = rust_tokenizer(tokenizer)
    cases = 0
    for seed in range(8):
        prompt, output = _draw(tokenizer, seed)
        whole = "".join(_vllm_texts(tokenizer, prompt, output))
        rng = random.Random(seed)
        at = rng.randrange(len(whole) // 3, 2 * len(whole) // 3)
        stop = [whole[at : at + rng.randint(2, 6)], "never-in-this-output"]
        min_tokens = rng.choice([0, 0, 30])
        texts = _vllm_stream(tokenizer, prompt, output, stop, min_tokens, include)
        want, ends_at = "".join(texts), len(texts)
        assert len(want) < len(whole)  # the stop string cut the text
        assert want.endswith(tuple(stop)) == include
        for k in range(1, ends_at):
            got = "".join(texts[:k])  # what the client had from the dead replica
            cont = ContinuationText(
                backend,
                prompt,
                output[:k],
                stop=stop,
                min_tokens=min_tokens,
                delivered_chars=len(got),
                include_stop=include,
            )
            for j in range(k, len(output)):
                got += cont.text([output[j]], finished=j == len(output) - 1)
                if cont.stopped is not None:
                    break
            assert (got, j + 1, cont.stopped in stop) == (want, ends_at, True), (seed, k)
            cases += 1
    assert cases > 100


def _vllm_stopped_by_token(
    tokenizer, prompt: list[int], output: list[int], skip_special_tokens: bool, include: bool = False
) -> list[str]:
    """The text vLLM streams (DELTA) for `output`, whose last token is the stop token that ended the request
    (EOS or one of `stop_token_ids`): `stop_terminated`, so that token is decoded only with `include`
    (`include_stop_str_in_output`)."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(
        max_tokens=len(output), skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include
    )
    detok = FastIncrementalDetokenizer(
        tokenizer, SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=params)
    )
    texts = []
    for i, token in enumerate(output):
        last = i == len(output) - 1
        detok.update([token], last)
        texts.append(detok.get_next_output_text(last, True))
    return texts


@pytest.mark.parametrize("include", [False, True], ids=["stop cut", "stop kept"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_stop_token_that_ends_a_continuation_is_counted_but_not_decoded_as_vllm_does(
    tokenizer, skip_special_tokens, include
):
    """vLLM puts the text of the stop token that ended a request (EOS, or one of the client's `stop_token_ids`)
    in the output only with include_stop_str_in_output; replayed, a moved stream's text must do the same."""
    backend = rust_tokenizer(tokenizer)
    for seed in range(4):
        prompt, output = _draw(tokenizer, seed)
        for stop in (tokenizer.encode(".", add_special_tokens=False)[-1], tokenizer.eos_token_id):
            ended = output[:40] + [stop]
            texts = _vllm_stopped_by_token(tokenizer, prompt, ended, skip_special_tokens, include)
            for k in range(1, len(ended)):
                sent = "".join(texts[:k])
                cont = ContinuationText(
                    backend,
                    prompt,
                    ended[:k],
                    skip_special_tokens=skip_special_tokens,
                    delivered_chars=len(sent),
                    include_stop=include,
                )
                text, kept = cont.take(ended[k:], finished=True, stop_token=True)
                assert (sent + text, kept) == ("".join(texts), len(ended) - k), (seed, stop, k)


class _Replica:
    """Engine streams of a fixed answer: the first call's dies after `die_after` chunks (EngineBroken)."""

    def __init__(self, chunks: list[dict], die_after: int):
        self.chunks, self.die_after, self.opened = chunks, die_after, []

    def open(self, request: dict):
        self.opened.append(request)
        done = len(request["prompt_token_ids"]) - len(self.opened[0]["prompt_token_ids"])
        todo = []
        for chunk in self.chunks:  # the chunks after the tokens already sent
            if done > 0:
                done -= len(chunk["token_ids"])
                continue
            todo.append({**chunk, "replica": f"r{len(self.opened) - 1}"})
        return _Stream(todo, self.die_after if len(self.opened) == 1 else None)


class _Stream:
    def __init__(self, chunks: list[dict], die_after: int | None):
        self.chunks, self.die_after, self.i = chunks, die_after, 0

    async def __anext__(self) -> dict:
        from kvmesh.deployments.engine_driver import EngineBroken

        if self.i == self.die_after:
            raise EngineBroken("engine step failed", "r0")
        if self.i >= len(self.chunks):
            raise StopAsyncIteration
        self.i += 1
        return self.chunks[self.i - 1]

    def cancel(self) -> None:
        pass


def _moved_stream(request: dict, replica, text_for) -> list[dict]:
    """Every chunk a MigratingStream over `replica`'s calls gives the client (up to 2 moves), the text of each
    continuation from `text_for`."""
    from kvmesh.deployments.failure_metrics import FailureCounters
    from kvmesh.deployments.migration import MigratingStream

    async def run():
        stream = MigratingStream(
            request,
            replica.open,
            max_migrations=2,
            counters=FailureCounters(),
            replica_failed=lambda rid: None,
            first_token=lambda rid: None,
            text_for=text_for,
        )
        return [chunk async for chunk in stream]

    return asyncio.run(run())


@pytest.mark.parametrize(
    "stop, skip_special_tokens",
    [(".", True), ("</s>", False)],
    ids=["stop_token_ids", "eos_not_skipped"],
)
def test_a_stream_moved_mid_answer_leaves_out_the_text_of_the_stop_token_that_ends_it(
    tokenizer, stop, skip_special_tokens
):
    """The engine's chunk says a stop token ended the request (`stop_reason`: its id, None for EOS): the stream
    moved before it ends with the text an untouched run sends, which vLLM gives without the stop token's."""

    words = [tokenizer.encode(w, add_special_tokens=False) for w in (" fox", " jumps")]
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    stop_reason = None if stop_id == tokenizer.eos_token_id else stop_id
    end = {"text": "", "token_ids": [stop_id], "finish_reason": "stop", "stop_reason": stop_reason}
    chunks = [
        {"text": w, "token_ids": ids, "finish_reason": None, "stop_reason": None}
        for w, ids in zip((" fox", " jumps"), words)
    ]
    chunks = [{**c, "num_cached_tokens": 0, "prompt_tokens": 9} for c in [*chunks, end]]
    request = {
        "request_id": "q",
        "prompt_token_ids": tokenizer.encode("The quick brown"),
        "params": {"max_tokens": 10, "stop_token_ids": [stop_id], "skip_special_tokens": skip_special_tokens},
    }
    replica = _Replica(chunks, die_after=1)

    def text_for(req, sent, delivered):
        return ContinuationText(
            rust_tokenizer(tokenizer), req["prompt_token_ids"], sent, skip_special_tokens, delivered_chars=delivered
        )

    got = _moved_stream(request, replica, text_for)
    assert len(replica.opened) == 2  # moved after " fox"
    assert "".join(c["text"] for c in got) == " fox jumps"  # as vLLM's own text: no stop token's
    assert [t for c in got for t in c["token_ids"]] == [*words[0], *words[1], stop_id]  # counted in usage
    assert got[-1]["finish_reason"] == "stop"


class _VllmTextReplica:
    """Engine streams of a fixed greedy answer, one token per chunk, whose text and stop strings are vLLM's own
    detokenizer's for the request it is sent (primed with that request's prompt, checking its `stop`); the
    first call's dies after `die_after` chunks."""

    def __init__(self, tokenizer, prompt: list[int], answer: list[int], die_after: int):
        self.tokenizer, self.prompt, self.answer, self.die_after = tokenizer, prompt, answer, die_after
        self.opened: list[dict] = []

    def open(self, request: dict):
        from vllm import SamplingParams
        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

        self.opened.append(request)
        p = request["params"]
        done = len(request["prompt_token_ids"]) - len(self.prompt)
        todo = self.answer[done : done + p["max_tokens"]]
        params = SamplingParams(max_tokens=p["max_tokens"], stop=p.get("stop"), min_tokens=p.get("min_tokens", 0))
        detok = FastIncrementalDetokenizer(
            self.tokenizer,
            SimpleNamespace(request_id="r", prompt_token_ids=request["prompt_token_ids"], sampling_params=params),
        )
        chunks = []
        for i, token in enumerate(todo):
            stopped = detok.update([token], False)
            last = stopped is not None or i == len(todo) - 1
            text = detok.get_next_output_text(last, True)
            reason = "stop" if stopped is not None else "length" if last else None
            chunks.append({"text": text, "token_ids": [token], "finish_reason": reason, "stop_reason": stopped})
            if last:
                break
        chunks = [{**c, "num_cached_tokens": 0, "replica": f"r{len(self.opened) - 1}"} for c in chunks]
        return _Stream(chunks, self.die_after if len(self.opened) == 1 else None)


def test_a_stop_string_in_the_prompt_does_not_end_a_stream_moved_mid_character(tokenizer):
    """The dead replica sent an answer ending in the first byte of a multi-byte character; the new replica's
    detokenizer, primed with the prompt plus those ids, emits held-back text of the prompt with its first
    token. A stop string in the prompt ("User:", a chat's turn marker) must not end the request there: the
    moved stream is the untouched run's, to max_tokens."""

    prompt = tokenizer("User: what is the capital of Japan?\nAssistant:")["input_ids"]
    answer = tokenizer.encode(" The capital is 東京, a big city by the sea.", add_special_tokens=False)
    cut = next(i for i in range(1, len(answer) + 1) if "\ufffd" in tokenizer.decode(answer[:i]))
    assert cut < len(answer) - 2  # the sent ids end inside 東, with more of the answer to come
    request = {
        "request_id": "q",
        "prompt_token_ids": prompt,
        "params": {"max_tokens": len(answer), "stop": ["User:"]},
    }
    untouched = _VllmTextReplica(tokenizer, prompt, answer, die_after=None).open(request).chunks
    assert untouched[-1]["finish_reason"] == "length"  # "User:" is not in the answer
    replica = _VllmTextReplica(tokenizer, prompt, answer, die_after=cut)

    def text_for(req, sent, delivered):
        p = req["params"]
        return ContinuationText(
            rust_tokenizer(tokenizer), req["prompt_token_ids"], sent, stop=p["stop"], delivered_chars=delivered
        )

    got = _moved_stream(request, replica, text_for)
    assert len(replica.opened) == 2 and replica.opened[1]["prompt_token_ids"] == prompt + answer[:cut]
    assert [t for c in got for t in c["token_ids"]] == answer
    assert "".join(c["text"] for c in got) == "".join(c["text"] for c in untouched)
    assert got[-1]["finish_reason"] == "length"
