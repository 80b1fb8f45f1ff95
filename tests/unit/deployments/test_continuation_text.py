"""A migrated stream's text, replayed in the ingress, against vLLM's own detokenizer: the text a client
gets from the dead replica up to any token plus `ContinuationText` from there is exactly what vLLM's
`FastIncrementalDetokenizer` gives an untouched run, on token sequences full of incomplete UTF-8 (the
tiny model's usual output); priming vLLM's detokenizer with the continuation prompt does not."""

from __future__ import annotations

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


def _vllm_stream(tokenizer, prompt: list[int], output: list[int], stop: list[str], min_tokens: int) -> list[str]:
    """The text vLLM streams (DELTA) for each of `output`'s tokens until a stop string ends it."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(max_tokens=len(output), stop=stop, min_tokens=min_tokens)
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


def test_a_continuation_holds_back_and_stops_at_stop_strings_as_vllm_does(tokenizer):
    """With stop strings vLLM holds back the text a stop string could begin with and cuts the text where one
    completes: a stream moved after any token ends with exactly the untouched run's text, the held-back
    characters sent, a stop string spanning the move found, and none leaked."""
    backend = rust_tokenizer(tokenizer)
    cases = 0
    for seed in range(8):
        prompt, output = _draw(tokenizer, seed)
        whole = "".join(_vllm_texts(tokenizer, prompt, output))
        rng = random.Random(seed)
        at = rng.randrange(len(whole) // 3, 2 * len(whole) // 3)
        stop = [whole[at : at + rng.randint(2, 6)], "never-in-this-output"]
        min_tokens = rng.choice([0, 0, 30])
        texts = _vllm_stream(tokenizer, prompt, output, stop, min_tokens)
        want, ends_at = "".join(texts), len(texts)
        assert len(want) < len(whole)  # the stop string cut the text
        for k in range(1, ends_at):
            got = "".join(texts[:k])  # what the client had from the dead replica
            cont = ContinuationText(
                backend, prompt, output[:k], stop=stop, min_tokens=min_tokens, delivered_chars=len(got)
            )
            for j in range(k, len(output)):
                got += cont.text([output[j]], finished=j == len(output) - 1)
                if cont.stopped is not None:
                    break
            assert (got, j + 1, cont.stopped in stop) == (want, ends_at, True), (seed, k)
            cases += 1
    assert cases > 100
