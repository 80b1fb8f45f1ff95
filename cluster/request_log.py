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

import functools
import json
import os
from collections import deque
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
    where: str = ""  # the file it was read from, for errors found once it is rendered

    @property
    def named(self) -> str:
        """Where the request came from, as an error names it: its file and line, else its id."""
        if self.line:
            return f"{self.where} line {self.line}" if self.where else f"line {self.line}"
        return f"request {self.id!r}"

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
        rid, body, endpoint, tenant, str(interaction) if interaction is not None else rid, float(ts), line, extra, where
    )


def _check_body(body: dict, endpoint: str, where: str, line: int) -> None:
    """A chat's messages and template arguments are held to the ingress's own rules
    (`openai_protocol.chat_message`, `openai_protocol.template_arguments`): a message the ingress refuses (a
    non-text part, a malformed tool call) would otherwise be rendered here as a prompt kvmesh never serves."""
    if endpoint == CHAT:
        # the ingress's own request rules (imported when a chat needs them)
        from kvmesh.deployments.openai_protocol import OpenAIError, chat_message, template_arguments

        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise RequestLogError(f"{where} line {line}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestLogError(f"{where} line {line}: messages[{i}] needs a 'role'")
            try:
                chat_message(m, i)
            except OpenAIError as exc:
                raise RequestLogError(f"{where} line {line}: {exc.message.rstrip('.')}") from None
        try:
            template_arguments(body)
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
        return rendered_chat(req, tokenizer, render)[1]
    p = req.body["prompt"]
    return p if isinstance(p, str) else None


def rendered_chat(req: LoggedRequest, tokenizer, render=None) -> tuple[list[dict], str]:
    """A logged chat as the ingress renders it: the conversation its template gets (`template_messages`) and the
    text, with the request's `chat_template_kwargs` and tools. `RequestLogError` naming the request when the
    ingress would refuse it (its messages or template arguments, or a template that fails on them)."""
    from kvmesh.deployments.openai_protocol import OpenAIError, chat_message, template_arguments

    try:
        checked = [chat_message(m, i) for i, m in enumerate(req.body["messages"])]
        kwargs = template_arguments(req.body)
    except OpenAIError as exc:  # a request not read by `parse_line`, which checks both
        raise RequestLogError(f"{req.named}: {exc.message.rstrip('.')}") from None
    messages = template_messages(checked, chat_template_of(tokenizer))
    try:
        if render is not None:
            return messages, render(messages, **kwargs)
        return messages, tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # the ingress answers these with a 400
        raise RequestLogError(f"{req.named}: the model's chat template refused it: {template_refusal(exc)}") from None


def template_refusal(exc: BaseException, limit: int = 400) -> str:
    """Why rendering a chat template failed, as one line: the template's own error where the exception's chain
    holds one (its `raise_exception`), else the exception's text, as vLLM's server reports it."""
    from jinja2 import TemplateError

    seen: set[int] = set()
    current: BaseException | None = exc
    reason = str(exc)
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TemplateError):
            reason = str(current)
            break
        current = current.__cause__ or current.__context__
    reason = " ".join(reason.split()) or type(exc).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


class ChatRenderer:
    """The tokenizer's chat template compiled once and rendered as `apply_chat_template` renders it.

    Why: `apply_chat_template` does more per call than the render itself, which dominates tokenising a large
    log. The template is compiled by transformers' own function (its `tojson`, `raise_exception` and
    extensions) and gets the variables `apply_chat_template` passes, so the texts are the same; the first
    `verify` renders are compared with `apply_chat_template` all the same (a tokenizer may override it), and on
    any difference every later call uses it instead."""

    def __init__(self, tokenizer, verify: int = 5):
        self.tokenizer = tokenizer
        self.verify = verify
        self.template = None
        self.special: dict = {}
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            chat_template = chat_template_of(tokenizer)
            if chat_template is not None:
                self.special = dict(tokenizer.special_tokens_map)
                self.template = _compile_jinja_template(chat_template)
        except Exception:
            self.template = None

    def _fast(self, messages: list[dict], kwargs: dict) -> str:
        """The render `apply_chat_template` makes (transformers' `render_jinja_template`): the request's tools
        and documents, the special tokens overridden by the request's variables."""
        assert self.template is not None
        variables = {k: v for k, v in kwargs.items() if k not in ("documents", "tools", "add_generation_prompt")}
        return self.template.render(
            messages=messages,
            tools=kwargs.get("tools"),
            documents=kwargs.get("documents"),
            add_generation_prompt=kwargs.get("add_generation_prompt", True),
            **{**self.special, **variables},
        )

    def _slow(self, messages: list[dict], kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})

    def __call__(self, messages: list[dict], **kwargs) -> str:
        """`messages` rendered with the generation prompt unless `add_generation_prompt` says otherwise; `kwargs`
        are the request's template arguments (`openai_protocol.template_arguments`). A template's refusal is
        raised as `apply_chat_template` raises it. A last message left open (`continue_final_message`) is cut by
        the tokenizer after rendering: that request is always rendered by the tokenizer."""
        if kwargs.get("continue_final_message"):
            return self._slow(messages, kwargs)
        if self.template is not None and self.verify <= 0:
            try:
                return self._fast(messages, kwargs)
            except Exception:
                pass  # the tokenizer's own render says whether the request or this renderer fails
            text = self._slow(messages, kwargs)
            self.template = None  # rendered where the compiled template failed: the tokenizer's from now on
            return text
        slow = self._slow(messages, kwargs)
        if self.template is not None:
            self.verify -= 1
            try:
                fast: str | None = self._fast(messages, kwargs)
            except Exception:
                fast = None
            if fast != slow:
                self.template = None
        return slow


def adds_special_tokens(is_chat: bool, given: bool | None) -> bool:
    """Whether the ingress adds the tokenizer's special tokens to a request's text: as its `add_special_tokens`
    (`given`) says, else a completion's yes and a chat's no (its template writes them)."""
    return not is_chat if given is None else bool(given)


def logged_adds_special_tokens(req: LoggedRequest) -> bool:
    """`adds_special_tokens` for a logged request."""
    return adds_special_tokens(req.is_chat, req.body.get("add_special_tokens"))


def prompt_ids(req: LoggedRequest, tokenizer) -> list[int]:
    """Token ids as kvmesh's ingress computes them (a completion's text with the model's special tokens, a
    chat's template text without extra ones, unless the request says otherwise)."""
    text = prompt_text(req, tokenizer)
    if text is None:
        return list(req.body["prompt"])
    return list(tokenizer.encode(text, add_special_tokens=logged_adds_special_tokens(req)))


def message_texts(content) -> list[str]:
    """A message's content as the template gets it (`template_messages`), as the texts it renders in order: a
    string, or each text part's text."""
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content or () if isinstance(p, dict) and isinstance(p.get("text"), str)]


def content_text(content) -> str:
    """A message's content as one text: its non-empty text parts joined by newlines, no content as "". What
    vLLM's server hands a chat template that takes content as a string (`content_format` "string"): it drops
    the parts whose text is empty before joining."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(t for p in content if isinstance(p, dict) and (t := p.get("text", "")))
    return str(content)


def chat_template_of(tokenizer) -> str | None:
    """The chat template `apply_chat_template` renders with (a tokenizer's default one of several named
    templates); None when it has none."""
    get = getattr(tokenizer, "get_chat_template", None)
    if get is not None:
        try:
            return get()
        except Exception:  # no template, or named ones without a default: apply_chat_template refuses too
            return None
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


class _NotAName(Exception):
    """A loop or assignment target the content-format rule cannot follow (a tuple): the template is "string"."""


def _reads(node, var: str, key: str | None = None) -> bool:
    """`node` reads variable `var` (with `key`: its item or attribute `key`), through filters, tests and
    slices (`messages[1:] | selectattr(...)` reads `messages`)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, nodes.Filter):
            if node.node is None:
                return False
            node = node.node
        elif isinstance(node, nodes.Test):
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is not None:
        if isinstance(node, nodes.Getitem):
            named = isinstance(node.arg, nodes.Const) and node.arg.value == key
        elif isinstance(node, nodes.Getattr):
            named = node.attr == key
        else:
            return False
        node = node.node  # the variable itself, not through filters: `(m | first)['content']` is not `m`'s
        return named and isinstance(node, nodes.Name) and node.ctx == "load" and node.name == var
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == var


def _target(node) -> str:
    from jinja2 import nodes

    if not isinstance(node, nodes.Name):
        raise _NotAName
    return node.name


def _loops_over_content(root) -> bool:
    """The template iterates over a message's content: `{% for part in message['content'] %}`, with the
    messages reached through `{% set %}` aliases, and content passed to a macro under another name."""
    from jinja2 import nodes

    aliases, queue = ["messages"], deque(["messages"])
    while queue:
        var = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, var):
                name = _target(assign.target)
                if name not in aliases:
                    aliases.append(name)
                    queue.append(name)
    message_vars = [
        _target(loop.target) for loop in root.find_all(nodes.For) if any(_reads(loop.iter, var) for var in aliases)
    ]
    in_macro: set[int] = set()
    content_params: dict[int, set[str]] = {}  # a loop inside a macro -> the macro's parameters given content
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_reads(arg, v, "content") for v in message_vars):
                    given.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(_reads(kw.value, v, "content") for v in message_vars):
                    given.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if given:
                content_params[id(loop)] = given
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if not (
            any(_reads(it, v, "content") for v in message_vars)
            or (isinstance(it, nodes.Name) and it.name in content_params.get(id(loop), ()))
            or (id(loop) not in in_macro and isinstance(it, nodes.Name) and it.name == "content")
        ):
            continue
        _target(loop.target)  # the first such loop decides
        return True
    return False


@functools.lru_cache(maxsize=1)
def _template_env():
    """A Jinja environment that parses and compiles chat templates as transformers' does (its trim and strip
    settings, its `{% generation %}` block and loop controls)."""
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )


@functools.lru_cache(maxsize=16)
def content_format(chat_template: str | None) -> str:
    """How a chat template takes a message's content, as vLLM's server detects it (its default
    `--chat-template-content-format auto`): "openai" (a list of `{"type": "text", "text": ...}` parts) when the
    template loops over a message's content, else "string" (the text parts joined by newlines); "string" too
    for a template that does not compile or that the rule cannot follow."""
    if chat_template is None:
        return "string"
    env = _template_env()
    try:
        env.from_string(chat_template)  # a template that does not compile is "string", as in vLLM
        return "openai" if _loops_over_content(env.parse(chat_template)) else "string"
    except Exception:  # vLLM's rule too: whatever fails to parse or to follow is "string"
        return "string"


def supports_developer(chat_template: str | None) -> bool:
    """The template knows the `developer` role (names it as a string), so it gets those messages as they are."""
    return chat_template is not None and ('"developer"' in chat_template or "'developer'" in chat_template)


def _system_first(conversation: list[dict]) -> list[dict]:
    """Every system message merged into one at position 0, their non-empty texts joined by a blank line;
    the conversation as it is when its only system message is already first. Templates such as Qwen's refuse a
    system message anywhere else."""
    texts: list[str] = []
    rest: list[dict] = []
    merge = False
    for i, m in enumerate(conversation):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        text = m.get("content", "")
        if isinstance(text, list):
            text = "\n".join(p if isinstance(p, str) else p["text"] for p in text if isinstance(p, str) or "text" in p)
        if text:
            texts.append(text)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else conversation


# the first line of a Claude Code system prompt (its `cch` value is new on every request): vLLM's server drops it
BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(parts: list[dict]) -> list[dict]:
    """A system message's text parts without Claude Code's attribution line, as vLLM's server renders them: a
    `text` part starting with it loses its first line (the whole part if that was all). Kept, its per-request
    value would end every such prompt's cached prefix at the header."""
    out = []
    for part in parts:
        text = part.get("text")
        if part.get("type") != "text" or not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append({**part, "text": rest})
    return out


def template_messages(messages: list[dict], chat_template: str | None) -> list[dict]:
    """Checked chat messages (`openai_protocol.chat_message`) as kvmesh's ingress hands them to `chat_template`,
    which is what vLLM's server hands it: each content as the template takes it (`content_format`; a tool's
    answer always as a string); the `name`, an assistant's `reasoning` (also as `reasoning_content`) and tool
    calls, a tool message's `tool_call_id` and a `task` kept; a `developer` message as it is
    for a template that knows the role, else as `system`, with every system message then merged into the first
    (`_system_first`); a system message's Claude Code attribution line dropped (`_without_billing_header`). Both
    the ingress and the log's reader render through this, so a replayed log renders the prompts the ingress
    served."""
    as_parts = content_format(chat_template) == "openai"
    out: list[dict] = []
    for m in messages:
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or ())
        if m["role"] == "system":
            parts = _without_billing_header(parts)
        if not as_parts:
            text: str | list[dict] = content_text(parts)
        elif m["role"] == "tool":  # a tool's answer is one string for any template, its parts joined
            text = "\n".join(p["text"] for p in parts)
        else:  # every kind of text part (refusal, thinking) as the text part vLLM's server makes of it
            text = [p | {"type": "text"} for p in parts]
        msg = {"role": m["role"], "content": text}
        # the keys in the order vLLM's server adds them (a template may render a message whole)
        if m.get("tool_calls"):
            msg["tool_calls"] = [dict(call) for call in m["tool_calls"]]
        if m.get("reasoning") is not None:  # an assistant's, by both names a template may read it under
            msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if m.get("task") is not None:
            msg["task"] = m["task"]
        if m["role"] == "developer":
            msg["tools"] = None  # vLLM's server gives a developer message its own `tools` (a 400 here when given)
        out.append(msg)
    if any(m["role"] == "developer" for m in out) and not supports_developer(chat_template):
        out = [
            {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
            for m in out
        ]
        out = _system_first(out)
    return out
