"""The embedded tiny model (deployments/tiny_model.py): built locally, deterministic, idempotent."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


# ---------------------------------------------------------------------------- tiny model
def test_tiny_model_is_deterministic_and_idempotent(tmp_path):
    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import build_tiny_model

    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")

    def digest(d: Path) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digest(a) == digest(b)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a") == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    cfg = json.loads((a / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(a)
    assert cfg["vocab_size"] == len(tok) == 1024 and cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>hi<|end|><|assistant|>"
    ids = tok.encode("The cache remembers", add_special_tokens=False)
    assert tok.decode(ids) == "The cache remembers"
    assert build_tiny_model(tmp_path / "c", seed=1) != a
    assert digest(tmp_path / "c")["model.safetensors"] != digest(a)["model.safetensors"]
