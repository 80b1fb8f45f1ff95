"""Auth, client-salt rejection and per-tenant limits on the live ingress (real Ray Serve + vLLM engines).

Missing, malformed, unknown and revoked keys must get 401 with an OpenAI-style body (the official
client raises AuthenticationError); a client-chosen cache salt or tenant header gets 400; limits give
429 with Retry-After or 400 for a prompt no retry can fix; rejections show in /metrics per tenant; and
no key material (valid or not) ever reaches the logs.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from tenant_app import KEYS, QUOTA_LIMITS, REVOKED_KEY, all_keys, auth

pytestmark = pytest.mark.integration

UNKNOWN_KEY = "kvm-never-issued-key-0123456789"
BAD_AUTH = [  # (case, headers, expected error code)
    ("missing", {}, "missing_api_key"),
    ("empty", {"Authorization": ""}, "missing_api_key"),
    ("bearer without key", {"Authorization": "Bearer"}, "invalid_api_key"),
    ("basic scheme", {"Authorization": "Basic a3ZtOnNlY3JldA=="}, "invalid_api_key"),
    ("two tokens", {"Authorization": f"Bearer {UNKNOWN_KEY} extra"}, "invalid_api_key"),
    ("key without scheme", {"Authorization": UNKNOWN_KEY}, "invalid_api_key"),
    ("too short", {"Authorization": "Bearer abc"}, "invalid_api_key"),
    ("unknown", auth(UNKNOWN_KEY), "invalid_api_key"),
    ("revoked", auth(REVOKED_KEY), "revoked_api_key"),
]
ENDPOINTS = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hello"}),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]}),
]


def call(app, method, path, body=None, headers=None, timeout=120.0) -> httpx.Response:
    with httpx.Client(base_url=app.url, timeout=timeout) as client:
        return client.request(method, path, json=body, headers=headers or {})


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None, err_type: str | None = None):
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) >= {"message", "type", "param", "code"}
    if code:
        assert err["code"] == code, err
    if err_type:
        assert err["type"] == err_type, err
    return err


@pytest.mark.parametrize("method, path, body", ENDPOINTS, ids=[p for _, p, _ in ENDPOINTS])
@pytest.mark.parametrize("case, headers, code", BAD_AUTH, ids=[c for c, _, _ in BAD_AUTH])
def test_bad_keys_get_401(live_app, method, path, body, case, headers, code):
    resp = call(live_app, method, path, body, headers)
    err = assert_openai_error(resp, 401, code, "authentication_error")
    assert UNKNOWN_KEY not in resp.text and REVOKED_KEY not in resp.text
    assert "Bearer" in resp.headers.get("www-authenticate", "")
    assert err["message"]


def test_every_valid_key_is_accepted_as_its_tenant(live_app):
    for tenant, key in [("default", live_app.api_key), *KEYS.items()]:
        resp = call(live_app, "GET", "/v1/models", headers=auth(key))
        assert resp.status_code == 200, (tenant, resp.text)


def test_openai_client_raises_authentication_error(live_app):
    import openai

    for key in (REVOKED_KEY, UNKNOWN_KEY):
        client = openai.OpenAI(base_url=live_app.url + "/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert info.value.status_code == 401
        assert key not in str(info.value)


@pytest.mark.parametrize(
    "body_extra, headers_extra, code",
    [
        ({"cache_salt": "attacker-chosen"}, {}, "client_cache_salt_not_allowed"),
        ({"cache_salt": ""}, {}, "client_cache_salt_not_allowed"),
        ({"tenant_id": "acme"}, {}, "client_cache_salt_not_allowed"),
        ({}, {"X-Kvmesh-Tenant": "acme"}, "client_tenant_header_not_allowed"),
        ({}, {"X-Cache-Salt": "abc"}, "client_tenant_header_not_allowed"),
    ],
)
def test_client_chosen_salt_or_tenant_is_rejected(live_app, body_extra, headers_extra, code):
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        resp = call(live_app, "POST", path, {**body, **body_extra}, {**auth(KEYS["globex"]), **headers_extra})
        assert_openai_error(resp, 400, code, "invalid_request_error")


def test_tenant_limits_give_429_with_retry_after_and_400_for_oversized_prompts(live_app):
    key = KEYS["quota"]
    long_prompt = list(range(1, QUOTA_LIMITS["max_prompt_tokens"] + 2))  # token ids: exact length
    resp = call(
        live_app, "POST", "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 1}, auth(key)
    )
    assert_openai_error(resp, 400, "tenant_prompt_limit_exceeded")
    small = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 1}
    first = call(live_app, "POST", "/v1/completions", small, auth(key))
    assert first.status_code == 200, first.text
    second = call(live_app, "POST", "/v1/completions", small, auth(key))  # 0.1 req/s, burst 1
    assert_openai_error(second, 429, "rate_limit_exceeded", "rate_limit_error")
    retry_after = int(second.headers["retry-after"])
    assert 1 <= retry_after <= 10
    # another tenant is not affected by the quota tenant's limit
    other = call(live_app, "POST", "/v1/completions", small, auth(KEYS["globex"]))
    assert other.status_code == 200, other.text


def test_rejections_are_counted_per_tenant_in_metrics(live_app):
    call(live_app, "GET", "/v1/models", headers=auth(UNKNOWN_KEY))
    call(live_app, "GET", "/v1/models", headers=auth(REVOKED_KEY))
    text = call(live_app, "GET", "/metrics").text
    assert 'kvmesh_tenant_rejections_total{tenant="unauthenticated",reason="invalid_api_key"}' in text
    assert 'kvmesh_tenant_rejections_total{tenant="unauthenticated",reason="revoked_api_key"}' in text
    assert 'kvmesh_tenant_requests_total{tenant="globex"}' in text


def _log_files() -> list[Path]:
    root = Path(os.environ["RAY_TMPDIR"])
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and (p.suffix in (".log", ".out", ".err", ".txt") or "logs" in p.parts)
    ]


def test_no_key_material_in_logs(live_app):
    """Runs after the tests above (file order) so every kind of key has been sent at least once."""
    for key in [*all_keys(live_app.api_key), UNKNOWN_KEY]:  # make sure each was sent at least once here too
        call(live_app, "GET", "/v1/models", headers=auth(key))
    call(
        live_app,
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "log probe", "max_tokens": 2},
        auth(KEYS["acme"]),
    )
    files = _log_files()
    blob = b"".join(p.read_bytes() for p in files)
    assert len(files) > 3 and b"/v1/models" in blob, "not looking at the serving logs"
    secrets = [*all_keys(live_app.api_key), UNKNOWN_KEY]
    leaked = [k for k in secrets if k.encode() in blob or k[4:20].encode() in blob]
    assert not leaked, f"key material found in logs: {[k[:8] + '...' for k in leaked]}"
    assert b"Bearer kvm-" not in blob
    secret_file = os.environ["KVMESH_SALT_SECRET_FILE"]  # start_local wrote the run's secret there
    secret = Path(secret_file).read_bytes().strip()
    assert len(secret) >= 16 and secret not in blob, "the salt secret itself appears in the logs"
