"""A request's output constraint (a JSON schema, any JSON object, a regex, a choice, a grammar), as vLLM's
server reads it, handed to the engine as plain data.

Why vLLM's own request model: `response_format` and vLLM's `structured_outputs` field combine by its rules
(`extract_structured_outputs`), and a client moved from vLLM's server must be held to the same grammar. The
engine builds vLLM's `StructuredOutputsParams` from the data (`engine_params`) and decodes under it with its
default backend. Placement is untouched: the prompt and its blocks are the same as without a constraint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvmesh.deployments.openai_protocol import GenerationRequest, OpenAIError, bad


def as_data(params: Any) -> dict[str, Any] | None:
    """vLLM's `StructuredOutputsParams` as the fields set on it (what crosses to the engine); None for none."""
    if params is None:
        return None
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.init and value is not None and value != f.default:
            out[f.name] = value
    return out


def engine_params(data: dict[str, Any]) -> Any:
    """The engine's side: `as_data`'s fields back into vLLM's `StructuredOutputsParams`."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**data)


def refusal(exc: Exception) -> OpenAIError:
    """vLLM's refusal of a request (its model's validation, its own validation errors) as the 400 its server
    answers: the reason in one line, the field where vLLM names one."""
    errors = getattr(exc, "errors", None)
    first = errors()[0] if callable(errors) and errors() else None
    reason = str(first.get("msg", exc)) if first else str(exc)
    param = getattr(exc, "parameter", None)
    if first and first.get("loc"):
        param = ".".join(str(p) for p in first["loc"])
    return bad(f"The request is invalid: {' '.join(reason.split())}"[:400], param)


def vllm_request(req: GenerationRequest) -> Any:
    """The request read by vLLM's own model of it (chat or completion); `OpenAIError` where that model refuses
    it, with its reason. The tenant's salt is the server's, not a field vLLM's model should see."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMClientError

    body = {k: v for k, v in req.body.items() if k != "cache_salt"}
    model = ChatCompletionRequest if req.kind == "chat" else CompletionRequest
    try:
        return model(**body)
    except (ValidationError, ValueError, VLLMClientError) as exc:
        raise refusal(exc) from None


def constrain(req: GenerationRequest) -> None:
    """Put the request's output constraint, if it asks for one, in `req.params["structured_outputs"]`."""
    if not req.constrained:
        return
    from vllm.exceptions import VLLMClientError

    try:
        data = as_data(vllm_request(req).extract_structured_outputs())
    except (ValueError, VLLMClientError) as exc:  # two kinds of constraint at once, say
        raise refusal(exc) from None
    if data:
        req.params["structured_outputs"] = data
