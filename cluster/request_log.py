"""An application's own request log, as `kvmesh cachetest` replays and analyses it.

One JSON object per line; only `body` (an OpenAI request body) is required:

    {"id": "r1", "body": {"messages": [...], "max_tokens": 16}, "endpoint": "/v1/chat/completions",
     "timestamp": 12.5, "tenant": "acme", "interaction": "conv-7"}

- `endpoint` is inferred from the body when absent: `messages` means chat, `prompt` means completions.
- `interaction` groups the requests of one completed interaction (a conversation, an agent task); cost
  per completed interaction divides by the number of interactions whose requests all succeeded.
- `id` defaults to `line-N`, `tenant` to none (the server's default tenant), `interaction` to the id.

Why a separate reader from `cluster/trace.py`: a Mooncake trace carries hash ids and lengths, this log
carries the real prompts, so tokenisation, templates and drift can be analysed. Every error names the
file and line (`RequestLogError`), which the CLI turns into one line and exit status 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


class RequestLogError(ValueError):
    """The log cannot be read: a message naming the file and line."""


@dataclass
class LoggedRequest:
    id: str
    body: dict
    endpoint: str
    tenant: str | None = None
    interaction: str = ""
    timestamp: float = 0.0
    line: int = 0
    extra: dict = field(default_factory=dict)  # the record's other keys, kept for reports

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT

    @property
    def model(self) -> str | None:
        m = self.body.get("model")
        return m if isinstance(m, str) else None


def infer_endpoint(body: dict) -> str | None:
    """`messages` means chat, `prompt` means completions; None when the body has neither."""
    if "messages" in body:
        return CHAT
    if "prompt" in body:
        return COMPLETIONS
    return None


def parse_line(text: str, where: str, line: int) -> LoggedRequest:
    """One log line -> a request; raises `RequestLogError` naming `where` and `line`."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestLogError(f"{where} line {line}: not JSON ({exc.msg})") from None
    except RecursionError:  # arrays or objects nested deeper than Python's parser recurses
        raise RequestLogError(f"{where} line {line}: JSON nested too deeply to read") from None
    except ValueError as exc:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        raise RequestLogError(f"{where} line {line}: a number too long to read ({str(exc).split(':')[0]})") from None
    if not isinstance(rec, dict):
        raise RequestLogError(f"{where} line {line}: expected a JSON object")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise RequestLogError(f"{where} line {line}: 'body' must be an OpenAI request object")
    inferred = infer_endpoint(body)
    endpoint = rec.get("endpoint")
    if endpoint is None:
        if inferred is None:
            raise RequestLogError(f"{where} line {line}: body has neither 'messages' nor 'prompt'")
        endpoint = inferred
    elif endpoint not in ENDPOINTS:
        raise RequestLogError(f"{where} line {line}: unknown endpoint {endpoint!r} (expected one of {ENDPOINTS})")
    elif inferred != endpoint:
        need = "messages" if endpoint == CHAT else "prompt"
        raise RequestLogError(f"{where} line {line}: endpoint {endpoint} needs a body with '{need}'")
    _check_body(body, endpoint, where, line)
    tenant = rec.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise RequestLogError(f"{where} line {line}: 'tenant' must be a string")
    ts = rec.get("timestamp", 0.0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise RequestLogError(f"{where} line {line}: 'timestamp' must be a number (seconds)")
    rid = str(rec.get("id") or f"line-{line}")
    interaction = rec.get("interaction")
    extra = {k: v for k, v in rec.items() if k not in ("id", "body", "endpoint", "tenant", "timestamp", "interaction")}
    return LoggedRequest(
        rid, body, endpoint, tenant, str(interaction) if interaction is not None else rid, float(ts), line, extra
    )


def _check_body(body: dict, endpoint: str, where: str, line: int) -> None:
    """A chat's messages are held to the ingress's own rules (`openai_protocol.chat_message`): a message the
    ingress refuses (a tool call's null content, a `tool` message, a non-text part) would otherwise be
    rendered here as a prompt kvmesh never serves."""
    if endpoint == CHAT:
        # imported here: openai_protocol imports this module (`template_message`)
        from kvmesh.deployments.openai_protocol import OpenAIError, chat_message

        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise RequestLogError(f"{where} line {line}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise RequestLogError(f"{where} line {line}: messages[{i}] needs a 'role' and a 'content'")
            try:
                chat_message(m, i)
            except OpenAIError as exc:
                raise RequestLogError(f"{where} line {line}: {exc.message.rstrip('.')}") from None
    else:
        p = body["prompt"]
        ok = (isinstance(p, str) and p) or (
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        )
        if not ok:
            raise RequestLogError(f"{where} line {line}: 'prompt' must be a non-empty string or list of token ids")


def read_request_log(path: str | os.PathLike, limit: int | None = None) -> list[LoggedRequest]:
    """Every request of a JSONL log (blank lines skipped); ids must be unique."""
    where = str(path)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise RequestLogError(f"{where}: cannot open ({exc.strerror or exc})") from None
    out: list[LoggedRequest] = []
    seen: dict[str, int] = {}
    with fh:
        for n, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestLogError(f"{where} line {n}: not UTF-8 text") from None
            if not text.strip():
                continue
            req = parse_line(text, where, n)
            if req.id in seen:
                raise RequestLogError(f"{where} line {n}: id {req.id!r} already used on line {seen[req.id]}")
            seen[req.id] = n
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise RequestLogError(f"{where}: no requests")
    return out


def prompt_text(req: LoggedRequest, tokenizer, render=None) -> str | None:
    """The prompt as the server's tokenizer sees it (chat template applied, generation prompt added);
    None for a token-id prompt. `render` (a `ChatRenderer`) renders faster than the tokenizer does."""
    if req.is_chat:
        messages = [template_message(m) for m in req.body["messages"]]
        if render is not None:
            return render(messages)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p = req.body["prompt"]
    return p if isinstance(p, str) else None


class ChatRenderer:
    """The tokenizer's chat template compiled once and rendered with its special tokens.

    Why: `apply_chat_template` builds a fresh Jinja context per call, which dominates tokenising a
    large log. The first `verify` renders are compared with `apply_chat_template`; on any difference
    (a template that needs more than messages and special tokens) every later call uses it instead."""

    def __init__(self, tokenizer, verify: int = 5):
        self.tokenizer = tokenizer
        self.verify = verify
        self.template = None
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(tokenizer.chat_template)
            self.extra = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        except Exception:
            self.template = None

    def __call__(self, messages: list[dict]) -> str:
        slow = None
        if self.template is None or self.verify > 0:
            slow = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if self.template is None:
                return slow
        try:
            fast = self.template.render(messages=messages, add_generation_prompt=True, **self.extra)
        except Exception:
            fast = None
        if slow is not None:
            self.verify -= 1
            if fast != slow:
                self.template = None
            return slow
        if fast is None:  # the bare template failed where the tokenizer's may not: use the tokenizer's from now on
            self.template = None
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return fast


def prompt_ids(req: LoggedRequest, tokenizer) -> list[int]:
    """Token ids as kvmesh's ingress computes them (a completion's text with the model's special tokens, a
    chat's template text without extra ones)."""
    text = prompt_text(req, tokenizer)
    if text is None:
        return list(req.body["prompt"])
    return list(tokenizer.encode(text, add_special_tokens=not req.is_chat))


def content_text(content) -> str:
    """A message's content as one text: its text parts joined by newlines, as vLLM's server joins them."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def template_message(message: dict) -> dict:
    """A chat message as kvmesh's ingress hands it to the chat template: `developer` as `system`, the content
    as one text, the `name` kept (templates may use it). Both the ingress and the log's reader check the
    message first (`openai_protocol.chat_message`)."""
    role = message["role"]
    out = {"role": "system" if role == "developer" else role, "content": content_text(message.get("content"))}
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out
