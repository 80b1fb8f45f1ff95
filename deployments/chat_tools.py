"""A chat request's tools, as vLLM's server reads them (no Ray, no vLLM: unit-testable).

Why here and not in vLLM's pydantic models: the ingress answers every client error with an OpenAI-style 400
naming the field, and the request log's reader checks logged requests by the same rules. What the chat
template gets is what vLLM's server hands it: each tool as its `ChatCompletionToolsParam.model_dump()` (the
fields vLLM knows, `description` and `parameters` null when left out, `strict` and `defer_loading` only when
given), an assistant's tool calls with their JSON arguments read into objects, a `tool` message's text parts
joined into one string. Whether the answer is parsed for tool calls is the ingress's (`tool_calls.py`).
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.deployments.openai_protocol import bad

TOOL_CHOICES = ("none", "auto", "required")


def _optional(value: Any, kind: type, name: str) -> None:
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad(f"'{name}' must be {'an object' if kind is dict else 'a ' + kind.__name__}.", name, "invalid_type")


def _tool(tool: Any, i: int) -> dict:
    """`tools[i]` as vLLM's model dumps it for the template."""
    name = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad(f"'{name}' must be an object.", name, "invalid_type")
    if tool.get("type", "function") != "function":
        raise bad(f"'{name}.type' must be 'function'.", f"{name}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"'{name}.function' must be an object.", f"{name}.function", "invalid_type")
    if not isinstance(fn.get("name"), str):
        raise bad(f"'{name}.function.name' must be a string.", f"{name}.function.name", "invalid_type")
    _optional(fn.get("description"), str, f"{name}.function.description")
    _optional(fn.get("parameters"), dict, f"{name}.function.parameters")
    _optional(fn.get("strict"), bool, f"{name}.function.strict")
    _optional(fn.get("defer_loading"), bool, f"{name}.function.defer_loading")
    _optional(tool.get("defer_loading"), bool, f"{name}.defer_loading")
    out_fn: dict[str, Any] = {"name": fn["name"], "description": fn.get("description")}
    out_fn["parameters"] = fn.get("parameters")
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    deferred = fn.get("defer_loading")
    if deferred is None:  # the tool's own flag, as vLLM passes it down
        deferred = tool.get("defer_loading")
    if deferred is not None:
        out_fn["defer_loading"] = deferred
    out: dict[str, Any] = {"type": "function", "function": out_fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def chat_tools(body: dict) -> tuple[list[dict] | None, str | dict]:
    """A chat request's `tools` (as the template gets them; None without any) and its `tool_choice`: "none",
    "auto", "required" or `{"type": "function", "function": {"name"}}` naming one of the tools. As vLLM's model:
    an empty list is refused, `tool_choice` defaults to "auto" with tools and "none" without, and any choice but
    "none" needs tools."""
    given = body.get("tools")
    if given is not None and not isinstance(given, list):
        raise bad("'tools' must be a list.", "tools", "invalid_type")
    if given == []:
        raise bad(
            "'tools' must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    tools = [_tool(t, i) for i, t in enumerate(given)] if given else None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        if choice != "none" and not tools:
            raise bad("When using 'tool_choice', 'tools' must be set.", "tool_choice")
        return tools, choice
    if not isinstance(choice, dict):
        raise bad(
            "'tool_choice' must be 'none', 'auto', 'required' or a named function.", "tool_choice", "invalid_value"
        )
    if not tools:
        raise bad("When using 'tool_choice', 'tools' must be set.", "tool_choice")
    fn = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad('A named \'tool_choice\' is {"type": "function", "function": {"name": ...}}.', "tool_choice.function")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise bad(f"'tool_choice' names no tool in 'tools': {fn['name']!r}.", "tool_choice.function.name")
    return tools, {"type": "function", "function": {"name": fn["name"]}}


def _arguments(value: Any) -> dict:
    """A tool call's arguments as a template gets them: a JSON object read into a dict; empty, not JSON, or
    JSON that is not an object, an empty dict (vLLM's server coerces them so that a conversation whose history
    holds one can go on)."""
    if isinstance(value, dict):
        return value
    if not value:
        return {}
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def assistant_tool_calls(calls: Any, i: int) -> list[dict]:
    """`messages[i].tool_calls` checked (each `{"id", "type": "function", "function": {"name", "arguments"}}`, a
    string id, name and arguments) and put as vLLM's server hands them to the template: its request model's key
    order (`id`, `function` with `arguments` then `name`, `type`), other keys after, arguments read
    (`_arguments`)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"'{param}' must be a list.", param, "invalid_type")
    out = []
    for k, call in enumerate(calls):
        where = f"{param}[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise bad(
                f'\'{where}\' must be {{"id", "type": "function", "function": {{"name", "arguments"}}}} '
                "with string values.",
                where,
                "invalid_type",
            )
        fn_rest = {key: v for key, v in fn.items() if key not in ("name", "arguments")}
        rest = {key: v for key, v in call.items() if key not in ("id", "function", "type")}
        function = {"arguments": _arguments(fn["arguments"]), "name": fn["name"], **fn_rest}
        out.append({"id": call["id"], "function": function, "type": "function", **rest})
    return out
