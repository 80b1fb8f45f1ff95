"""Tool calls read from a chat's answer by vLLM's own parser, as vLLM's server reads them.

A deployment that names a parser (`tool_call_parser`, vLLM's `--enable-auto-tool-choice --tool-call-parser`)
serves every `tool_choice`: the parser adjusts the request as on vLLM's server (the grammar that makes
"required" and a named function answer with calls, a structural tag where the parser holds calls to one, the
special tokens it reads), the engine decodes under that grammar (`structured_outputs.py`), and its text is
handed, whole or chunk by chunk, to the parser, so the answer carries what it found as `tool_calls` with
vLLM's `finish_reason`. Why vLLM's parser and not one of kvmesh's: each model family writes its calls its own
way, and a client moved from vLLM's server must get the same calls from the same text.
"""

from __future__ import annotations

from typing import Any

from kvmesh.deployments.openai_protocol import GenerationRequest
from kvmesh.deployments.structured_outputs import as_data, refusal, vllm_request

# the sampling settings a vLLM tool parser may change for its request (`adjust_request`): passed to the engine
_PARSER_SAMPLING_KEYS = ("skip_special_tokens", "spaces_between_special_tokens")


def parser_names() -> list[str]:
    """The tool-call parsers vLLM has (the names its `--tool-call-parser` takes)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


class ToolCallParsing:
    """The served model's tool-call parser (one per ingress; one `AnswerParser` per request)."""

    def __init__(self, name: str, tokenizer: Any, model_name: str | None = None):
        from vllm.parser.parser_manager import ParserManager
        from vllm.tokenizers.hf import get_cached_tokenizer

        if name not in parser_names():
            raise ValueError(f"unknown tool_call_parser {name!r}: vLLM has {', '.join(parser_names())}")
        self.name = name
        # as vLLM's server hands it to its parsers: the vocabulary and special tokens read once, not rebuilt by
        # each request's parser (a model's vocabulary of 150,000 entries takes milliseconds to build)
        tokenizer = get_cached_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        try:  # vLLM checks that the parser can read this tokenizer's text (its markers are in the vocabulary)
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=name, enable_auto_tools=True, model_name=model_name, tokenizer=tokenizer
            )
        except (TypeError, RuntimeError) as exc:
            raise ValueError(f"tool_call_parser {name!r}: {' '.join(str(exc).split())}") from None

    def for_request(self, req: GenerationRequest) -> AnswerParser:
        """The parser of one chat request with tools and a `tool_choice` other than "none", the request
        adjusted by it as on vLLM's server: the grammar and the sampling settings it asks for put in
        `req.params`. `OpenAIError` where vLLM's model refuses the request or the parser's adjustment."""
        from vllm.exceptions import VLLMClientError

        request = vllm_request(req)
        kwargs = dict(request.chat_template_kwargs or {})
        try:
            adjusted = self._parser(request, kwargs).adjust_request(request.model_copy(deep=True))
            grammar = as_data(adjusted.extract_structured_outputs())
        except (ValueError, VLLMClientError) as exc:  # vLLM's own validation errors (a 400 on its server)
            raise refusal(exc) from None
        for key in _PARSER_SAMPLING_KEYS:
            if getattr(adjusted, key) != getattr(request, key):
                req.params[key] = getattr(adjusted, key)
        if grammar:
            req.params["structured_outputs"] = grammar
        return AnswerParser(self._parser(adjusted, kwargs), adjusted)

    def _parser(self, request: Any, chat_template_kwargs: dict) -> Any:
        return self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs)


def _call(call: Any) -> dict:
    """A parsed call as an answer's `tool_calls` entry (vLLM's `ToolCall`: an id made when the parser gave none)."""
    from vllm.renderers.chat_utils import make_tool_call_id

    return {
        "id": call.id or make_tool_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class AnswerParser:
    """One answer's tool calls, read as vLLM's server reads them (its chat serving's full and streamed paths)."""

    def __init__(self, parser: Any, request: Any):
        self.parser = parser
        self.request = request
        self.streamed_calls = False
        self.first_only = request.parallel_tool_calls is False  # vLLM's `maybe_filter_parallel_tool_calls`
        self.named = request.tool_choice is not None and not isinstance(request.tool_choice, str)
        self.required = request.tool_choice == "required"

    def whole(self, text: str, token_ids: list[int]) -> tuple[str | None, list[dict]]:
        """A whole answer's content and tool calls (none found: the text as it is, no calls). With "required"
        or a named function the content is a string, empty where the calls took it all, as there."""
        parsed = self.parser.parse(text, self.request, enable_auto_tools=True, model_output_token_ids=token_ids)
        _, content, calls = parsed
        out = [_call(c) for c in calls or ()]
        if self.named or self.required:
            content = content or ""
        return content, out[:1] if self.first_only else out

    def whole_finish(self, engine_reason: str | None, calls: list[dict]) -> str | None:
        """A whole answer's `finish_reason`: `tool_calls` where "auto" found calls, or "required" stopped by
        itself; a named function's answer keeps the engine's (OpenAI's rule, as vLLM's server applies it)."""
        if (calls and not self.named and not self.required) or (self.required and engine_reason == "stop"):
            return "tool_calls"
        return engine_reason

    def stream_finish(self, engine_reason: str | None) -> str | None:
        """A stream's last `finish_reason`: `tool_calls` where calls were streamed and it stopped by itself,
        except for a named function."""
        if engine_reason == "stop" and self.streamed_calls and not self.named:
            return "tool_calls"
        return engine_reason

    def delta(self, text: str, token_ids: list[int], prompt_ids: list[int], finished: bool) -> dict | None:
        """The delta a streamed chunk carries for this piece of the answer, as vLLM's chunk has it; None when the
        parser holds it back (part of a call not complete yet) and the answer goes on."""
        message = self.parser.parse_delta(text, list(token_ids), self.request, prompt_ids, finished=finished)
        if message is None:
            return None
        if message.tool_calls:
            self.streamed_calls = True
            if self.first_only:
                message.tool_calls = [c for c in message.tool_calls if c.index == 0]
        return message.model_dump(mode="json", exclude_unset=True)
