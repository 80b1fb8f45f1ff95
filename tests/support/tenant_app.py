"""The tenants the shared live app (tests/conftest.py `live_app`) serves, so every live test can act as
several tenants: plain ones, a sharing group, a revoked key and a tightly limited tenant.

The keys are test constants, not secrets; the file written holds only their SHA-256 digests, as a
real deployment's would.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvmesh.deployments.tenants import hash_api_key

KEYS = {
    "acme": "kvm-live-acme-key-0123456789",
    "globex": "kvm-live-globex-key-0123456789",
    "docs-a": "kvm-live-docs-a-key-0123456789",
    "docs-b": "kvm-live-docs-b-key-0123456789",
    "quota": "kvm-live-quota-key-0123456789",
}
REVOKED_KEY = "kvm-live-acme-old-key-revoked-01"
GROUP = "public-docs"
QUOTA_LIMITS = {"requests_per_s": 0.1, "max_prompt_tokens": 64, "max_concurrent": 1}


def all_keys(default_key: str) -> list[str]:
    """Every key the live app knows, valid or revoked: what must never appear in its logs."""
    return [default_key, REVOKED_KEY, *KEYS.values()]


def write_live_tenants(path: Path, default_key: str) -> Path:
    """Write the tenants file: tenant `default` (the key the other live tests use, no limits, an operator:
    they read the router's state) plus ours."""
    tenants = [
        {"id": "default", "keys": [{"sha256": hash_api_key(default_key)}], "operator": True},
        {
            "id": "acme",
            "keys": [{"sha256": hash_api_key(KEYS["acme"])}, {"sha256": hash_api_key(REVOKED_KEY), "revoked": True}],
        },
        {"id": "globex", "keys": [{"sha256": hash_api_key(KEYS["globex"])}]},
        {"id": "docs-a", "group": GROUP, "keys": [{"sha256": hash_api_key(KEYS["docs-a"])}]},
        {"id": "docs-b", "group": GROUP, "keys": [{"sha256": hash_api_key(KEYS["docs-b"])}]},
        {"id": "quota", "keys": [{"sha256": hash_api_key(KEYS["quota"])}], "limits": QUOTA_LIMITS},
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"tenants": tenants}, sort_keys=False))
    return path


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}
