"""OpenAI request validation and response shapes for the ingress (no Ray, no vLLM: unit-testable).

Why hand-written and not pydantic models: every client error must become an OpenAI-style JSON body
with the offending `param` and a 4xx status -- never a 422 with FastAPI's own shape, never a 500 --
and the checks are few. Every field of vLLM's own request models is either served, or refused unless it
holds vLLM's default (`_UNSUPPORTED`, `_VLLM_EXTRAS`); fields vLLM does not know are ignored as vLLM ignores
them (clients send extras such as `user`), except the ones that would let a client choose its cache salt
(rejected by `kvmesh.deployments.tenants`).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvmesh.cluster.request_log import content_text
from kvmesh.deployments.tenants import openai_error

# a completion's output length when the request leaves max_tokens out or null (OpenAI's and vLLM's request
# default). A chat without one gets the model's generation_config max_new_tokens, else the rest of the context
# (the ingress's `_check_length`, as vLLM's get_max_tokens)
DEFAULT_MAX_TOKENS = 16
# parameters this server does not implement -> values that mean "off" (accepted silently). Any other value
# is a 400: ignored, it would change the output the client asked for (free text for a JSON schema, no
# logprobs where it wants them, a stop string cut from the text it wants kept).
_UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),  # a chat's are served (`chat_tools`); a completion has none
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
# The rest of vLLM 0.32's request fields (its ChatCompletionRequest / CompletionRequest) that this server does
# not serve -> vLLM's default values (accepted: they change nothing). Any other value is a 400, as above:
# vLLM would act on it. Fields vLLM does not know itself are ignored, as vLLM ignores them.
_VLLM_EXTRAS: dict[str, tuple] = {
    "ec_transfer_params": (),
    "kv_transfer_params": (),
    "length_penalty": (1.0, 1),
    "mm_payload": ("tensors",),
    "repetition_detection": (),
    "return_mm_kwargs": (False,),
    "return_token_offsets": (False,),
    "routed_experts_prompt_start": (0,),
    "spaces_between_special_tokens": (True,),
    "thinking_token_budget": (),
    "use_beam_search": (False,),
    "vllm_xargs": (),
    "watermarking": (False,),
}
_VLLM_EXTRAS_BY_KIND: dict[str, dict[str, tuple]] = {
    "completion": {"prompt_embeds": ()},
    "chat": {
        "chat_template": (),  # vLLM's own server refuses it too, unless started with a flag
        "include_reasoning": (True,),
        "media_io_kwargs": (),
        "mm_processor_kwargs": (),
        "return_prompt_text": (False,),
    },
}
# what the parser reads itself, accepted whatever vLLM does with it: `user` (OpenAI's end-user id, which
# vLLM ignores too), a chat's `tools`, `tool_choice` and `parallel_tool_calls` (`chat_tools`), and vLLM's
# `request_id`, `session_id` (they name the request or its session for vLLM's logs, ids and scheduling, and
# shape no output: kvmesh keeps its own ids) and `stream_interval` (how tokens are grouped into stream chunks)
_SERVED = frozenset(
    {
        "model", "prompt", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
        "repetition_penalty", "min_tokens", "stop_token_ids", "stop", "ignore_eos", "skip_special_tokens",
        "include_stop_str_in_output",  # the stop string kept in the text (continuation_text.py on a move too)
        "logit_bias", "logprobs", "top_logprobs",  # `_logprobs`; their shapes in the answer: logprobs.py
        "echo",  # a completion's prompt, a chat's last assistant message, before the answer (`parse_*`)
        "prompt_logprobs",  # vLLM's: the prompt tokens' log-probabilities, in its raw shape (`prompt_scores`)
        "user", "tools", "tool_choice", "parallel_tool_calls", "request_id", "session_id", "stream_interval",
        "chat_template_kwargs",  # `template_kwargs`
        "response_format", "structured_outputs",  # `_constraint`; the grammar itself: structured_outputs.py
        "cache_salt",  # refused by tenants.reject_client_salt
        "return_token_ids",  # vLLM's: the prompt's and each piece's token ids beside the text (`full_response`)
        "truncate_prompt_tokens", "truncation_side",  # vLLM's: the prompt cut to its last (or first) tokens
        "allowed_token_ids", "bad_words",  # vLLM's: the only tokens sampled; words never generated
        "add_special_tokens",  # vLLM's: the tokenizer's special tokens added to the prompt (`_tokenize`)
        # a chat's template settings, as vLLM's server passes them to the template (`parse_chat`)
        "add_generation_prompt", "continue_final_message", "documents", "reasoning_effort",
        "return_tokens_as_token_ids",  # vLLM's: log-probabilities' tokens as "token_id:N" (`logprobs.py`)
        "logprob_token_ids",  # vLLM's: the log-probabilities of listed tokens instead of the top ones
        "priority",  # vLLM's: the request's place under priority scheduling (lower first), within its key's floor
    }
)  # fmt: skip


# per request kind: every field refused unless it holds one of its harmless values (merged once, not per request)
_REFUSED: dict[str, dict[str, tuple]] = {
    kind: _UNSUPPORTED | _VLLM_EXTRAS | extras for kind, extras in _VLLM_EXTRAS_BY_KIND.items()
}
for _served in ("tools", "tool_choice"):  # a chat's are read by `chat_tools`
    del _REFUSED["chat"][_served]


def known_fields(kind: str) -> frozenset[str]:
    """Every request field this parser serves, refuses or accepts on purpose (vLLM's own must all be here)."""
    return _SERVED | set(_REFUSED[kind])


class OpenAIError(Exception):
    """A client error: status + OpenAI error body."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.err_type = err_type

    def body(self) -> dict:
        return openai_error(self.status, self.message, self.code, err_type=self.err_type, param=self.param)

    def headers(self) -> dict[str, str]:
        return {}


def shown(text: str, limit: int = 120) -> str:
    """A client's value quoted for an error message: control characters and lone surrogates escaped (JSON
    cannot encode a lone surrogate, and the answer would be a 500), a very long value cut."""
    quoted = repr(text)
    return quoted if len(quoted) <= limit else quoted[: limit - 20] + f"... ({len(text):,} characters)"


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code, param)


@dataclass
class GenerationRequest:
    """A validated request, common to completions and chat."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # the field the output length came in: a chat's max_completion_tokens wins over its max_tokens
    max_tokens_param: str = "max_tokens"
    messages: list[dict] | None = None  # checked (`chat_message`); `template_messages` puts them as a template takes
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more chat template variables, `tools` among them
    tool_choice: str | dict = "none"  # a chat's: "none", "auto", "required" or a named function (`chat_tools`)
    parallel_tool_calls: bool | None = None  # false: an answer keeps its first tool call only, as vLLM's
    constrained: bool = False  # asks for structured output (a grammar: `structured_outputs.constrain`)
    top_logprobs: int | None = None  # log-probabilities asked for: alternatives per token (`logprobs.py`)
    logprobs_listed: bool = False  # the alternatives are the tokens `logprob_token_ids` lists: all shown
    priority: int | None = None  # vLLM's `priority` as asked (the tenant's floor applies: `Ingress._priority`)
    echo: bool = False  # a completion's prompt goes before its answer (with its log-probabilities, when asked)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine's one token is not shown)
    # a chat's echo: the text its answer's content begins with (its last message's, if the assistant's; else
    # ""), None without echo (`parse_chat`)
    chat_echo: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # the request as sent (vLLM's model of it reads it)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # running usage in every chunk (vLLM's stream_options.continuous_usage_stats)
    # vLLM's `return_token_ids`: the prompt's token ids and the answer's beside its text; an echoed completion's
    # prompt then goes back as ids only, its text left out, as vLLM's server answers
    return_token_ids: bool = False
    # the tokenizer's special tokens added to the prompt's text: None, the kind's default (a completion's yes,
    # a chat's no: its template writes them)
    add_special_tokens: bool | None = None
    # vLLM's `return_tokens_as_token_ids`: the log-probabilities' tokens shown as "token_id:N"
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt's tokens kept (-1: as many as the context allows), from the end ("left", vLLM's default
    # for a generating model: the last ones kept) or the start ("right"); None: the whole prompt
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        """The request field an error about its prompt names."""
        return "prompt" if self.kind == "completion" else "messages"


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"The request body is not valid JSON: {exc}".splitlines()[0], code="invalid_json") from None
    except RecursionError:  # Python's parser gives up on deep nesting: a 2 KB body of brackets
        raise bad("The request body is nested too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.", code="invalid_json")
    return body


def number(body: dict, name: str, lo: float, hi: float, integer: bool = False, default=None):
    """A request's numeric field within [lo, hi], `default` when left out or null; a 400 naming it otherwise."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, float) and not math.isfinite(v):  # JSON's 1e400, and Python's NaN/Infinity extension
        raise bad(f"'{name}' must be a finite number, got {v}.", name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and int(v) != v):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}.", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, got {v}.", name)
    return int(v) if integer else float(v)


def boolean(body: dict, name: str) -> bool | None:
    """A request's boolean field, None when left out or null; a 400 naming it for anything else."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean.", name, "invalid_type")
    return v


def _is_token_ids(value: Any) -> bool:
    """Whether `value` is a list of token ids (integers; JSON's true and false are not)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _same_value(v: Any, harmless: Any) -> bool:
    """`v` is the harmless value: equal and of its kind, a number of either kind counting (vLLM's models take
    0.0 for an int field), a bool only as a bool (True == 1 in Python, not in a request)."""
    if isinstance(v, bool) or isinstance(harmless, bool):
        return type(v) is type(harmless) and v == harmless
    if isinstance(v, (int, float)) and isinstance(harmless, (int, float)):
        return v == harmless
    return type(v) is type(harmless) and v == harmless


def model_named(body: dict) -> str:
    """The model a request names; "" for none (left out, null or ""), which vLLM serves with its one model."""
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):  # false, 0, [] are not "no model": vLLM's own model refuses them too
        raise bad("'model' must be a string.", "model", "invalid_type")
    return model


def _common(body: dict, kind: str) -> GenerationRequest:
    # as vLLM: a request without a model (left out, null or "") is for the one model served; the ingress
    # names it in the response
    model = model_named(body)
    stream = bool(boolean(body, "stream"))
    so = body.get("stream_options")
    include_usage = continuous = False
    if so is not None:
        # as vLLM: options other than none ({} too) with a stream that is not one mean the client expects
        # something else
        if so and not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true.", "stream_options")
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object.", "stream_options", "invalid_type")
        flags = {}
        for name in ("include_usage", "continuous_usage_stats"):
            v = so.get(name)
            if v is not None and not isinstance(v, bool):
                raise bad(f"'stream_options.{name}' must be a boolean.", f"stream_options.{name}", "invalid_type")
            flags[name] = bool(v)
        include_usage = flags["include_usage"]
        # running usage in every chunk: only with the final usage asked for (vLLM ignores it otherwise)
        continuous = include_usage and flags["continuous_usage_stats"]
    n = number(body, "n", 1, 1, integer=True, default=1)
    del n  # one choice per generation: a request for several is split before this (`fan_out.plan`)
    max_tokens_name = (
        "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    # a completion's left out or null is 16, as in vLLM's request model; a chat's the ingress sets once the prompt
    # is tokenised (`Ingress._check_length`)
    default_max = DEFAULT_MAX_TOKENS if kind == "completion" else None
    # both checked, as vLLM's request model checks both: the one not used must be valid too
    # an echoed completion may ask for no answer at all (the prompt and its log-probabilities), as on vLLM
    least = 0 if kind == "completion" and body.get("echo") is True else 1
    max_tokens = number(body, "max_tokens", least, 1 << 20, integer=True, default=default_max)
    if max_tokens_name != "max_tokens":
        max_tokens = number(body, max_tokens_name, 1, 1 << 20, integer=True, default=default_max)
    # sampling settings the client leaves out are the engine's: the model's generation_config, as vLLM's own server
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": number(body, "temperature", 0.0, 2.0),
        "top_p": number(body, "top_p", 0.0, 1.0),
        "seed": number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True),
        "presence_penalty": number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": number(body, "frequency_penalty", -2.0, 2.0),
        # vLLM's own sampling extensions, which its OpenAI server takes too
        "top_k": number(body, "top_k", -1, 1 << 20, integer=True),
        "min_p": number(body, "min_p", 0.0, 1.0),
        # vLLM's SamplingParams: any finite value above 0
        "repetition_penalty": number(body, "repetition_penalty", -math.inf, math.inf),
        "min_tokens": number(body, "min_tokens", 0, 1 << 20, integer=True),
    }
    if params["top_p"] == 0.0:
        raise bad("'top_p' must be greater than 0.", "top_p")
    penalty = params["repetition_penalty"]
    if penalty is not None and penalty <= 0.0:
        raise bad(f"'repetition_penalty' must be greater than 0, got {penalty}.", "repetition_penalty")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not _is_token_ids(stop_ids):
            raise bad("'stop_token_ids' must be a list of token ids (integers).", "stop_token_ids", "invalid_type")
        params["stop_token_ids"] = stop_ids or None
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not _is_token_ids(allowed):
            message = "'allowed_token_ids' must be a list of token ids (integers)."
            raise bad(message, "allowed_token_ids", "invalid_type")
        if not allowed:  # vLLM's SamplingParams: nothing could be sampled
            raise bad("'allowed_token_ids' must not be empty.", "allowed_token_ids")
        params["allowed_token_ids"] = allowed
    bad_words = body.get("bad_words")
    if bad_words is not None:
        if not isinstance(bad_words, list) or not all(isinstance(w, str) for w in bad_words):
            raise bad("'bad_words' must be a list of strings.", "bad_words", "invalid_type")
        if "" in bad_words:  # as vLLM's SamplingParams: a word with nothing to match
            raise bad("'bad_words' must not contain an empty string.", "bad_words")
        params["bad_words"] = bad_words or None  # the engine tokenises them (vLLM's InputProcessor)
    params["logit_bias"] = _logit_bias(body.get("logit_bias"))
    top_logprobs = _logprobs(body, kind)
    params["logprobs"] = top_logprobs
    listed = _listed_logprobs(body, kind, top_logprobs)
    if listed:  # the engine scores the listed tokens instead of the top ones, as vLLM's server asks it
        params["logprob_token_ids"], params["logprobs"] = listed, None
    params["prompt_logprobs"] = number(body, "prompt_logprobs", 0, MAX_LOGPROBS, integer=True)
    if params["prompt_logprobs"] and stream:  # vLLM's rule: a stream carries none (0 asks for nothing to show)
        raise bad("'prompt_logprobs' are not available when 'stream' is true.", "prompt_logprobs")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
            raise bad("'stop' must be a string or a list of up to 4 strings.", "stop", "invalid_type")
        params["stop"] = [s for s in stop if s] or None
    for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        params[flag] = boolean(body, flag)
    # the answer's shape and how the prompt is made, not the engine's settings
    return_token_ids = bool(boolean(body, "return_token_ids"))
    as_token_ids = bool(boolean(body, "return_tokens_as_token_ids"))
    add_special_tokens = boolean(body, "add_special_tokens")
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise bad("'truncation_side' must be 'left' or 'right'.", "truncation_side")
    for name, harmless in _REFUSED[kind].items():  # in the tables' order: the first refused field is named
        v = body.get(name)
        if v is not None and not any(_same_value(v, h) for h in harmless):
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    return GenerationRequest(
        kind=kind,
        model=model,
        max_tokens_param=max_tokens_name,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        params={k: v for k, v in params.items() if v is not None},
        constrained=_constraint(body),
        top_logprobs=top_logprobs,
        logprobs_listed=bool(listed),
        return_token_ids=return_token_ids,
        return_tokens_as_token_ids=as_token_ids,
        add_special_tokens=add_special_tokens,
        truncate_prompt_tokens=number(body, "truncate_prompt_tokens", -1, (1 << 63) - 1, integer=True),
        truncation_side=side,
        priority=number(body, "priority", -(1 << 63), (1 << 63) - 1, integer=True),
        body=body,
    )


MAX_LOGPROBS = 20  # vLLM's engine default (`max_logprobs`): more alternatives per token are refused there
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on `logprob_token_ids` (its sampler's row width)


def _listed_logprobs(body: dict, kind: str, top_logprobs: int | None) -> list[int]:
    """vLLM's `logprob_token_ids`: token ids (at most `MAX_LOGPROB_TOKEN_IDS`) whose log-probabilities each
    answer token shows, beside the sampled one's, with `logprobs` asked for as vLLM requires; an empty list is
    none, as on vLLM's server. `OpenAIError` naming the field otherwise."""
    ids = body.get("logprob_token_ids")
    if ids is None:
        return []
    if not _is_token_ids(ids):
        raise bad("'logprob_token_ids' must be a list of token ids (integers).", "logprob_token_ids", "invalid_type")
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        message = f"'logprob_token_ids' may list at most {MAX_LOGPROB_TOKEN_IDS} tokens, got {len(ids)}."
        raise bad(message, "logprob_token_ids")
    if ids and top_logprobs is None:
        asked = "'logprobs' must be set" + (" to true" if kind == "chat" else "")
        raise bad(f"When using 'logprob_token_ids', {asked}.", "logprob_token_ids")
    return ids


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the answer's log-probabilities carry; None when none are asked for. A
    chat asks with `logprobs: true` and `top_logprobs` (0-20), a completion with `logprobs` (0-20), as vLLM's
    server reads them; all of the vocabulary (-1) is not served."""
    if kind == "chat":
        wanted = boolean(body, "logprobs")
        top = number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True, default=0)
        if top and not wanted:
            raise bad("When using 'top_logprobs', 'logprobs' must be set to true.", "top_logprobs")
        return top if wanted else None
    given = body.get("logprobs")
    if given is None:
        return None
    if isinstance(given, bool) or not isinstance(given, int):
        raise bad("'logprobs' must be an integer.", "logprobs", "invalid_type")
    if not 0 <= given <= MAX_LOGPROBS:
        raise bad(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {given}.", "logprobs")
    return given


def _logit_bias(given: Any) -> dict[int, float] | None:
    """`logit_bias` as vLLM's SamplingParams takes it: token ids (as JSON's string keys, or numbers) to biases
    clamped to [-100, 100]; a key that is not a token id is a 400 naming the field. Ids past the vocabulary are
    the ingress's to refuse (it knows the model)."""
    if given is None:
        return None
    if not isinstance(given, dict):
        raise bad("'logit_bias' must be an object of token ids to biases.", "logit_bias", "invalid_type")
    out = {}
    for token, bias in given.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            message = f"'logit_bias' key {shown(str(token))} is not a token id (an integer)."
            raise bad(message, "logit_bias", "invalid_type") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise bad(f"'logit_bias' for token {token_id} must be a finite number.", "logit_bias", "invalid_type")
        out[token_id] = min(100.0, max(-100.0, float(bias)))
    return out or None


# `response_format` types as vLLM's model takes them (the grammar of each: `structured_outputs.py`)
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _constraint(body: dict) -> bool:
    """Whether the request asks for structured output: a `response_format` other than text, or vLLM's
    `structured_outputs`; their shapes checked as far as naming the field (vLLM's model reads the rest)."""
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in _RESPONSE_FORMATS:
            message = f"'response_format.type' must be one of {', '.join(_RESPONSE_FORMATS)}."
            raise bad(message, "response_format.type" if isinstance(fmt, dict) else "response_format")
        if kind == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
            message = "'response_format.json_schema' must be an object when its type is 'json_schema'."
            raise bad(message, "response_format.json_schema", "invalid_type")
    given = body.get("structured_outputs")
    if given is not None and not isinstance(given, dict):
        raise bad("'structured_outputs' must be an object.", "structured_outputs", "invalid_type")
    return (fmt is not None and fmt.get("type") != "text") or given is not None


def truncated(ids: list[int], keep: int, side: str | None) -> list[int]:
    """A prompt's ids as `truncate_prompt_tokens` keeps them: its last `keep` (side "left", or None: vLLM sets
    a generating model's tokenizer to truncate on the left) or its first ("right")."""
    if keep >= len(ids):
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


def parse_request(body: dict, kind: str) -> GenerationRequest:
    """A completion's or a chat's request (`kind`), checked: `parse_completion` or `parse_chat`."""
    return parse_completion(body) if kind == "completion" else parse_chat(body)


def parse_completion(body: dict) -> GenerationRequest:
    req = _common(body, "completion")
    if "prompt" not in body:
        raise bad("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    p = body["prompt"]
    # a batch of exactly one prompt is this prompt (several are split before this: `fan_out.plan`)
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' must not be empty.", "prompt", "empty_prompt")
        req.prompt_text = p
    elif isinstance(p, list):
        if not p:
            raise bad("'prompt' must not be empty.", "prompt", "empty_prompt")
        if not _is_token_ids(p):
            raise bad(
                "'prompt' must be a string, a list of token ids (integers), or a list of either.",
                "prompt",
                "invalid_type",
            )
        req.prompt_ids = list(p)
    else:
        raise bad("'prompt' must be a string or a list of token ids.", "prompt", "invalid_type")
    if boolean(body, "echo"):  # a completion's prompt, a chat's last assistant message, before the answer
        req.echo = True
        if req.params.get("max_tokens") == 0:  # vLLM's rule: one token generated, the prompt alone answered
            req.params["max_tokens"] = 1
            req.echo_only = True
        if req.top_logprobs is not None and req.params.get("prompt_logprobs") is None:  # as vLLM derives them
            req.params["prompt_logprobs"] = req.top_logprobs
    return req


# the content parts vLLM's server renders as text -> the key their text is under
_TEXT_PARTS = {"text": "text", "refusal": "refusal", "thinking": "thinking"}
# the keys of a content part vLLM reads itself (its `_KNOWN_CONTENT_PART_FIELDS`); any other key (Anthropic's
# `cache_control`, say) stays on the text part a template that loops over parts gets, as vLLM keeps it
_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip


def _content(content: Any, i: int, role: str) -> str | list[dict]:
    """A message's content checked: a string, or a list of text parts, each put as `{"type", "text", ...}` with
    its own type and the keys a template may read (`_PART_FIELDS`). Text parts are vLLM's: `text`, `refusal` and
    `thinking` parts, and plain strings except in a system message. An assistant's null content is no content
    (an empty list of parts), as vLLM's server takes it; any other role's is refused, as there."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return []
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str) and role != "system":
                parts.append({"type": "text", "text": part})
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
            if key is None or not isinstance(part.get(key), str) or part.get("uuid") is not None:
                raise bad(
                    f"messages[{i}].content: only text parts are supported.", f"messages[{i}].content", "invalid_type"
                )
            extra = {k: v for k, v in part.items() if k not in _PART_FIELDS}
            parts.append({"type": str(kind), "text": part[key], **extra})
        return parts
    raise bad(
        f"messages[{i}].content must be a string or a list of text parts.", f"messages[{i}].content", "invalid_type"
    )


# chat_template_kwargs that are `apply_chat_template`'s own arguments, not template variables: how each is taken.
# The rest are the template's own variables, passed to it as vLLM's server passes them.
# vLLM's server overrides these with its request's own fields (and return_dict with False): any value changes
# nothing
_TEMPLATE_KWARGS_OVERRIDDEN = frozenset({"add_generation_prompt", "continue_final_message", "return_dict"})
# How the rendered text is tokenised: they act only when `tokenize` is true (vLLM renders text otherwise, and
# so does this server); then they are accepted only at values that change nothing for one prompt, as they would
# pad or cut it.
_TEMPLATE_TOKENIZER_KWARGS: dict[str, tuple] = {
    "padding": (False, True, "longest", "do_not_pad"),  # one text: "longest" pads nothing
    "truncation": (False, "do_not_truncate"),
    "max_length": (),
    "return_tensors": (),
    "tokenizer_kwargs": ({},),
}
# names `apply_chat_template` or its renderer pass themselves: given again, the call fails (vLLM answers 400)
_TEMPLATE_KWARGS_TAKEN = ("messages", "conversation", "conversations", "self")


def _documents_ok(value: Any) -> bool:
    """`documents` as transformers' renderer takes them: each item an object (an empty string or object, which
    iterate as none, included, as there)."""
    return isinstance(value, (list, dict, str)) and all(isinstance(d, dict) for d in value)


def template_kwargs(body: dict) -> dict[str, Any]:
    """A chat request's `chat_template_kwargs` (e.g. Qwen3's `{"enable_thinking": false}`) as the chat template
    gets them: a JSON object; null and "auto" values left out, as vLLM's server leaves them out;
    `apply_chat_template`'s own arguments dropped where they change nothing for a rendered text, refused where
    they would (`tools`, a template, a cut prompt) or would collide with what it passes itself (`messages`);
    `documents` checked as transformers checks them. `OpenAIError` naming the key otherwise."""
    given = body.get("chat_template_kwargs")
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise bad("'chat_template_kwargs' must be an object.", "chat_template_kwargs", "invalid_type")

    def refused(key: str) -> OpenAIError:
        name = f"chat_template_kwargs.{key}"
        return bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")

    if given.get("chat_template") is not None:  # refused before anything is left out, as by vLLM
        raise refused("chat_template")
    given = {k: v for k, v in given.items() if v is not None and not (isinstance(v, str) and v == "auto")}
    tokenize = bool(given.get("tokenize"))  # vLLM renders text unless it is given and true
    out = {}
    for key, value in given.items():
        if key in _TEMPLATE_KWARGS_TAKEN:
            name = f"chat_template_kwargs.{key}"
            raise bad(f"'{name}' names what the server passes the chat template itself.", name, "invalid_value")
        if key == "tools":  # the request's own `tools` field is how tools reach the template
            raise refused(key)
        if key == "return_assistant_tokens_mask":  # needs return_dict, which vLLM sets false: its 400 too
            if value:
                raise refused(key)
        elif key == "documents":
            if not _documents_ok(value):
                name = "chat_template_kwargs.documents"
                raise bad(f"'{name}' must be a list of objects.", name, "invalid_type")
            out[key] = value
        elif key in _TEMPLATE_TOKENIZER_KWARGS:
            if tokenize and not any(_same_value(value, h) for h in _TEMPLATE_TOKENIZER_KWARGS[key]):
                raise refused(key)
        # `tokenize` dropped: this server renders text and tokenises it apart, the ids vLLM's tokenising makes
        elif key not in _TEMPLATE_KWARGS_OVERRIDDEN and key != "tokenize":
            out[key] = value
    return out


def template_arguments(body: dict) -> dict[str, Any]:
    """Everything a chat's template gets besides its messages: `template_kwargs`, the request's `tools` (as
    vLLM's server passes them, whatever the `tool_choice`) and its template settings (`_template_settings`:
    `add_generation_prompt` always). `OpenAIError` naming the field otherwise."""
    from kvmesh.deployments.chat_tools import chat_tools  # it imports this module's errors

    out = template_kwargs(body)
    tools = chat_tools(body)[0]
    if tools:
        out["tools"] = tools
    out.update(_template_settings(body))
    return out


def parse_chat(body: dict) -> GenerationRequest:
    req = _common(body, "chat")
    if "messages" not in body:
        raise bad("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list.", "messages", "invalid_type")
    if not msgs:
        raise bad("'messages' must not be empty.", "messages", "empty_prompt")
    req.messages = [chat_message(m, i) for i, m in enumerate(msgs)]
    req.template_kwargs = template_arguments(body)
    from kvmesh.deployments.chat_tools import chat_tools  # it imports this module's errors

    req.tool_choice = chat_tools(body)[1]
    # as vLLM's server: the last message's content, where it is the assistant's (the answer's role)
    if boolean(body, "echo"):  # a completion's prompt, a chat's last assistant message, before the answer
        last = req.messages[-1]
        req.chat_echo = content_text(last["content"]) if last["role"] == "assistant" else ""
        if req.params.get("prompt_logprobs") is None:  # and, as vLLM derives them, the prompt's scores
            req.params["prompt_logprobs"] = req.top_logprobs or 0
    req.parallel_tool_calls = boolean(body, "parallel_tool_calls")
    return req


# vLLM's `reasoning_effort` values (its ChatCompletionRequest)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _template_settings(body: dict) -> dict[str, Any]:
    """A chat's own template settings, as vLLM's server passes them to the template over the request's
    `chat_template_kwargs`: `add_generation_prompt` (default true), `continue_final_message` (the last message
    left open, not with a generation prompt; given only when true, the template renderer's default otherwise),
    `documents`, and `reasoning_effort` (with `enable_thinking`, unless the request's kwargs set it, false for
    "none" and true otherwise). `OpenAIError` naming the field otherwise."""
    out: dict[str, Any] = {}
    for flag, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = boolean(body, flag)
        out[flag] = default if value is None else value
    if out["continue_final_message"] and out["add_generation_prompt"]:
        message = "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true."
        raise bad(message, "continue_final_message")
    if not out["continue_final_message"]:
        del out["continue_final_message"]
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not _documents_ok(documents):
            raise bad("'documents' must be a list of objects.", "documents", "invalid_type")
        out["documents"] = documents
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}.", "reasoning_effort")
        out["reasoning_effort"] = effort
        if "enable_thinking" not in (body.get("chat_template_kwargs") or {}):
            out["enable_thinking"] = effort != "none"
    return out


def chat_message(m: Any, i: int) -> dict:
    """`messages[i]` of a chat request checked as the ingress serves it (an object with a role of system,
    developer, user, assistant or tool, a string `name` if any, a string or text-part content or none, an
    assistant's tool calls, a tool message's string `tool_call_id`) and put as `{"role", "content", "name"?,
    "reasoning"?, "task"?, "tool_calls"?, "tool_call_id"?}`; `OpenAIError` naming the field otherwise. The chat
    template gets them through `request_log.template_messages`. The request log's reader
    (`cluster/request_log.py`) applies the same rules, so that a logged message the ingress refuses (a non-text
    part, a malformed tool call) is refused when the log is read, not rendered as text."""
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object.", f"messages[{i}]", "invalid_type")
    role = m.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        message = f"messages[{i}].role must be one of system, developer, user, assistant, tool."
        raise bad(message, f"messages[{i}].role")
    name = m.get("name")
    if name is not None and not isinstance(name, str):  # templates may use it: it is kept
        raise bad(f"messages[{i}].name must be a string.", f"messages[{i}].name", "invalid_type")
    from kvmesh.deployments.chat_tools import assistant_tool_calls  # it imports this module's errors

    # an assistant's calls (an empty list is none, as vLLM's server drops it), a tool message's answer to one
    calls = assistant_tool_calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") is not None else []
    call_id = m.get("tool_call_id") if role == "tool" else None
    if call_id is not None and not isinstance(call_id, str):
        param = f"messages[{i}].tool_call_id"
        raise bad(f"'{param}' must be a string.", param, "invalid_type")
    if role == "developer" and m.get("tools") is not None:  # vLLM's own extension; the request's `tools` serve
        param = f"messages[{i}].tools"
        raise bad(
            f"'{param}' is not supported by this server: send the tools in 'tools'.", param, "unsupported_parameter"
        )
    # no `content` key at all is no content, for any role: vLLM's request model takes such a message (its
    # custom-role form) and renders an empty turn; a null content stays an assistant's alone
    out = {"role": role, "content": _content(m["content"], i, role) if "content" in m else []}
    if name is not None:
        out["name"] = name
    # an assistant's reasoning (interleaved thinking: a template such as Qwen3's renders it back), under its
    # name or the deprecated `reasoning_content` vLLM's server still takes; another role's is not rendered
    reasoning = m.get("reasoning")
    if reasoning is None:
        reasoning = m.get("reasoning_content")
    if role == "assistant" and reasoning is not None:
        if not isinstance(reasoning, str):
            param = f"messages[{i}].reasoning"
            raise bad(f"'{param}' must be a string.", param, "invalid_type")
        out["reasoning"] = reasoning
    if isinstance(m.get("task"), str):  # a message's task, as vLLM's server passes it to the template
        out["task"] = m["task"]
    if calls:
        out["tool_calls"] = calls
    if call_id is not None:
        out["tool_call_id"] = call_id
    return out


# ---------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def running_usage(req: GenerationRequest, prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage a chunk of a stream carries with `stream_options.continuous_usage_stats`: the tokens so far, in
    vLLM's chunk shape (no prompt details; a chat chunk's `completion_tokens_details` null)."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if req.kind == "chat":
        u["completion_tokens_details"] = None
    return u


def full_response(
    req: GenerationRequest,
    rid: str,
    text: str | None,
    finish: str | None,
    u: dict,
    *,
    created: int,
    stop_reason: int | str | None = None,
    tool_calls: list[dict] | None = None,
    logprobs: dict | None = None,
    prompt_logprobs: list | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    """A non-streamed answer; `created` is the request's own stamp (seconds), taken once by the caller.
    `stop_reason` is what stopped it, as vLLM's server reports it beside `finish_reason`: the stop string that
    matched, a stop token's id, None for EOS or a length. A chat's `tool_calls` (`tool_calls.py`) go in its
    message when it made any, beside the content left (null when none was); `logprobs` are the choice's
    (`logprobs.py`), null when none were asked for; `prompt_logprobs` the prompt's (`logprobs.prompt_scores`),
    where vLLM's server puts them: a completion's in its choice, a chat's beside its choices, when computed.
    With `return_token_ids`, the answer's `token_ids` go in its choice and the `prompt_token_ids` where vLLM's
    server puts them: a completion's in its choice, a chat's beside its choices."""
    if req.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        chat_choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        answer: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [chat_choice],
            "system_fingerprint": None,  # OpenAI's field, null as on vLLM's server
            "usage": u,
        }
        if prompt_logprobs is not None:
            answer["prompt_logprobs"] = prompt_logprobs
        if req.return_token_ids:
            chat_choice["token_ids"] = token_ids
            answer["prompt_token_ids"] = prompt_token_ids
        return answer
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    if req.return_token_ids:
        choice["prompt_token_ids"] = prompt_token_ids
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": u,
    }


def stream_chunk(
    req: GenerationRequest,
    rid: str,
    text: str | None,
    finish: str | None,
    *,
    created: int,
    first: bool = False,
    u: dict | None = None,
    stop_reason: int | str | None = None,
    delta: dict | None = None,
    logprobs: dict | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    """One chunk of a streamed answer. `created` is the request's stamp, taken once: every chunk of a stream
    carries the same one, as OpenAI's and vLLM's do (read per chunk, a slow stream's changed midway). The chunk
    that finishes it carries `stop_reason` too (`full_response`), as vLLM's last chunk does. A chat's `delta`,
    where given (a tool-call parser's, `tool_calls.py`), is its choice's delta instead of `text` as content.
    With `return_token_ids` a piece's choice carries its `token_ids`, and a choice's first chunk the
    `prompt_token_ids` (as vLLM's stream: a completion's in the choice, null after the first; a chat's beside
    the choices)."""
    if req.kind == "chat":
        choices = []
        if text is not None or finish is not None or first or delta is not None:
            out: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta is not None:
                out.update(delta)
            elif text or (text is not None and logprobs is not None):  # a piece with tokens but no text yet
                out["content"] = text
            choices = [{"index": 0, "delta": out, "logprobs": logprobs, "finish_reason": finish}]
        chunk = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": choices,
        }
    else:
        choices = (
            []
            if text is None and finish is None
            else [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
        )
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices}
    if finish is not None:  # the finishing chunk always has its one choice
        choices[0]["stop_reason"] = stop_reason
    if req.return_token_ids:
        if req.kind == "chat":
            if prompt_token_ids is not None:
                chunk["prompt_token_ids"] = prompt_token_ids
        elif choices:
            choices[0]["prompt_token_ids"] = prompt_token_ids
        if choices:
            choices[0]["token_ids"] = token_ids or []
    if u is not None:
        chunk["usage"] = u
    elif req.include_usage:
        chunk["usage"] = None
    return chunk


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
