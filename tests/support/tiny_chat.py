"""The tiny model's tokenizer with a chat template of a test's choosing, and the templates the chat-rendering
tests share."""

from __future__ import annotations

import tempfile
from pathlib import Path

# Gemma 3's content handling on the tiny model's role markers: it loops over a message's parts and trims them
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tiny_tokenizer(template: str | None = None):
    """The tiny model's tokenizer (the model built once per machine), with `template` as its chat template."""
    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    tok = AutoTokenizer.from_pretrained(
        build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")
    )
    if template is not None:
        tok.chat_template = template
    return tok
