"""A deterministic, realistic application request log (the `kvmesh cachetest` example and benchmark input).

What real traffic that a prefix cache should help looks like, in small: several tenants, each with its
own long system prompt and tool definitions; RAG requests that paste shared documents; multi-turn
conversations whose every turn repeats the whole history; and the variants that make identical-looking
text miss: a second prompt template (different separators), stray whitespace, and tools listed in
another order. The bundled `traces/app_log.jsonl` is `example_log()` with its defaults
(`python -m kvmesh.cluster.app_log OUT.jsonl` rewrites it).
"""

from __future__ import annotations

import json
import random
import sys

_TENANTS = {
    "acme-support": (
        "You are the support assistant of Acme Cloud. Answer briefly and politely. "
        "Never share one customer's data with another. Escalate billing disputes to a human."
    ),
    "globex-legal": (
        "You are a legal research assistant for Globex. Cite the document and section you rely on. "
        "If the documents do not answer the question, say so plainly."
    ),
    "initech-code": (
        "You are a coding agent for Initech. Think step by step, call tools when needed, "
        "and return a short patch summary at the end of every task."
    ),
}
_TOOLS = {
    "acme-support": ["lookup_account(id)", "open_ticket(subject, body)", "refund(order, amount)"],
    "globex-legal": ["search_cases(query)", "fetch_statute(code, section)"],
    "initech-code": ["read_file(path)", "run_tests(target)", "apply_patch(diff)", "grep(pattern)"],
}
_DOCS = [
    "Document A. The service level agreement promises 99.9 percent monthly uptime. Credits are paid "
    "as a share of the monthly fee when the uptime falls below the promise, up to thirty percent.",
    "Document B. Personal data is kept in the region the customer chose. Backups stay in the same "
    "region. Deletion requests are completed within thirty days, including backups.",
    "Document C. The router places each request on the replica that already holds its prefix, unless "
    "that replica is much busier than the others; then it balances the load instead.",
]
_QUESTIONS = [
    "How do I reset my password?",
    "What does the uptime promise cover?",
    "Can you summarise the document in two sentences?",
    "Please fix the failing test in the parser module.",
    "Where is my data stored?",
    "Is there a refund for last month?",
    "Which section covers deletion?",
    "Run the tests and tell me what broke.",
]
_ANSWERS = [
    "Sure. Here is what I found.",
    "The short answer is yes, with two conditions.",
    "I checked the documents; section two applies.",
    "Done. The patch changes three lines.",
]


def _system(tenant: str, tool_order: list[str], template: str = "default") -> str:
    tools = "; ".join(tool_order)
    if template == "alt":  # a second prompt template: same words, other separators
        return f"{_TENANTS[tenant]}\n\n## Tools\n{tools}"
    return f"{_TENANTS[tenant]} Tools: {tools}."


def example_log(
    conversations: int = 12, turns: int = 3, rag: int = 6, variants: bool = True, seed: int = 7, max_tokens: int = 8
) -> list[dict]:
    """Records in the request-log form (`cluster/request_log.py`), interleaved the way users arrive.

    `conversations` multi-turn chats spread over the tenants, `rag` single-turn questions over the shared
    documents, and with `variants` one conversation per tenant on the alternative template, one with a
    trailing space in the system prompt and one with the tools listed in another order."""
    rng = random.Random(seed)
    tenants = list(_TENANTS)
    streams: list[list[dict]] = []
    for c in range(conversations):
        tenant = tenants[c % len(tenants)]
        tools = list(_TOOLS[tenant])
        system = _system(tenant, tools)
        kind = "plain"
        if variants and c // len(tenants) == 1:
            variant = ("template", "whitespace", "tool_order")[c % 3]
            kind = variant
            if variant == "template":
                system = _system(tenant, tools, "alt")
            elif variant == "whitespace":
                system = system + " "
            else:
                system = _system(tenant, tools[1:] + tools[:1])
        messages = [{"role": "system", "content": system}]
        conv: list[dict] = []
        for t in range(turns):
            messages = messages + [{"role": "user", "content": rng.choice(_QUESTIONS)}]
            conv.append(
                {
                    "id": f"conv{c}-t{t}",
                    "tenant": tenant,
                    "interaction": f"conv{c}",
                    "variant": kind,
                    "endpoint": "/v1/chat/completions",
                    "body": {"model": "tiny", "messages": list(messages), "max_tokens": max_tokens},
                }
            )
            messages = messages + [{"role": "assistant", "content": rng.choice(_ANSWERS)}]
        streams.append(conv)
    for q in range(rag):
        tenant = tenants[q % len(tenants)]
        doc = _DOCS[q % len(_DOCS)]
        prompt = f"{_TENANTS[tenant]}\n\nContext:\n{doc}\n\nQuestion: {rng.choice(_QUESTIONS)}\nAnswer:"
        streams.append(
            [
                {
                    "id": f"rag{q}",
                    "tenant": tenant,
                    "interaction": f"rag{q}",
                    "variant": "plain",
                    "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens},
                }
            ]
        )
    out: list[dict] = []
    clock = 0.0
    while any(streams):  # round-robin over the live streams: turns of one conversation stay in order
        for s in streams:
            if s:
                rec = s.pop(0)
                rec["timestamp"] = round(clock, 3)
                clock += 0.25
                out.append(rec)
    return out


def write_log(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_log(sys.argv[1], example_log())
