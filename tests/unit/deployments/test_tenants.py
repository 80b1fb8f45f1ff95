"""Unit tests for the tenant layer: config, key hashing, authentication, salts, client-salt rejection,
admission (limits, fairness) and per-tenant metrics. No Ray, no engines."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import REPO_ROOT

from kvmesh.deployments.admission import Admission, PromptTooLarge, RateLimited, TokenBucket
from kvmesh.deployments.tenant_metrics import TenantMetrics
from kvmesh.deployments.tenants import (
    AuthError,
    ClientSaltError,
    ConfigError,
    Limits,
    Tenant,
    TenantRegistry,
    derive_salt,
    hash_api_key,
    new_api_key,
    reject_client_salt,
    resolve_secret,
)

SECRET = b"unit-test-secret-0123456789abcdef"
KEY_A, KEY_A2, KEY_B, KEY_REVOKED = (f"kvm-test-key-{n}-0123456789" for n in ("a", "a2", "b", "rev"))


def config(**overrides):
    cfg = {
        "defaults": {"limits": {"max_prompt_tokens": 1000}},
        "admission": {"max_concurrent": 4, "queue_timeout_s": 1},
        "tenants": [
            {
                "id": "acme",
                "keys": [
                    {"sha256": hash_api_key(KEY_A)},
                    {"sha256": hash_api_key(KEY_A2)},
                    {"sha256": hash_api_key(KEY_REVOKED), "revoked": True},
                ],
                "limits": {"requests_per_s": 5},
            },
            {"id": "globex", "keys": [{"sha256": hash_api_key(KEY_B)}]},
        ],
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture
def registry():
    return TenantRegistry.from_dict(config(), secret=SECRET)


# --- authentication ---------------------------------------------------------------------------------


def test_authenticate_known_keys_map_to_their_tenant(registry):
    assert registry.authenticate(f"Bearer {KEY_A}").id == "acme"
    assert registry.authenticate(f"bearer {KEY_A2}").id == "acme"  # scheme is case-insensitive
    assert registry.authenticate(f"Bearer {KEY_B}").id == "globex"


@pytest.mark.parametrize(
    "header, code",
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("   ", "missing_api_key"),
        ("Basic dXNlcjpwYXNz", "invalid_api_key"),
        ("Bearer", "invalid_api_key"),
        ("Bearer ", "invalid_api_key"),
        (f"Bearer {KEY_A} extra", "invalid_api_key"),
        (f"Token {KEY_A}", "invalid_api_key"),
        ("Bearer abc", "invalid_api_key"),
        ("Bearer " + "x" * 300, "invalid_api_key"),
        ("Bearer kvm-\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9", "invalid_api_key"),
        ("Bearer kvm-not-a-known-key-000", "invalid_api_key"),
        (f"Bearer {KEY_REVOKED}", "revoked_api_key"),
    ],
)
def test_authenticate_rejects_with_401_and_openai_body(registry, header, code):
    with pytest.raises(AuthError) as info:
        registry.authenticate(header)
    err = info.value
    assert (err.status, err.code) == (401, code)
    body = err.body()["error"]
    assert body["type"] == "authentication_error" and body["code"] == code and body["message"]
    assert "Bearer" in err.headers()["WWW-Authenticate"]


AUTH_MESSAGES = {  # every 401 message is a constant: nothing from the request can appear in it
    "Missing API key: send it as 'Authorization: Bearer <key>'.",
    "Malformed Authorization header: expected 'Bearer <key>'.",
    "Malformed API key.",
    "Incorrect API key provided.",
    "This API key has been revoked.",
}


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=80),
        st.text(max_size=80).map(lambda t: "Bearer " + t),
        st.from_regex(r"Bearer kvm-[A-Za-z0-9_-]{8,40}", fullmatch=True),
    )
)
def test_authenticate_never_echoes_the_request(header):
    registry = TenantRegistry.from_dict(config(), secret=SECRET)
    try:
        tenant = registry.authenticate(header)
    except AuthError as err:
        assert err.message in AUTH_MESSAGES
        assert err.body()["error"]["message"] == err.message and err.body()["error"]["param"] is None
    else:
        assert header.split()[-1] in (KEY_A, KEY_A2, KEY_B) and tenant.id in ("acme", "globex")


@pytest.mark.parametrize("header", [f"Bearer  {KEY_A}", f"bearer   {KEY_A}", f"Bearer \t{KEY_A} "])
def test_a_bearer_key_after_several_spaces_is_accepted(registry, header):
    """RFC 6750: credentials = "Bearer" 1*SP b64token; more than one space is not malformed."""
    assert registry.authenticate(header).id == "acme"


def test_registry_stores_no_key_material(registry):
    text = repr(registry) + repr(registry.tenants) + repr(registry._entries)
    for key in (KEY_A, KEY_B, KEY_REVOKED):
        assert key not in text
    assert "salt" not in repr(registry.tenants["acme"])  # salts stay out of reprs/logs


def test_single_key_registry():
    reg = TenantRegistry.single_key("kvm-local-dev-key-123", secret=SECRET)
    tenant = reg.authenticate("Bearer kvm-local-dev-key-123")
    assert tenant.id == "default" and tenant.group is None
    with pytest.raises(AuthError):
        reg.authenticate("Bearer kvm-local-dev-key-124")
    with pytest.raises(ConfigError):
        TenantRegistry.single_key("short", secret=SECRET)


def test_only_a_tenant_marked_operator_is_one_and_the_single_key_tenant_is():
    cfg = config()
    cfg["tenants"][1]["operator"] = True
    reg = TenantRegistry.from_dict(cfg, secret=SECRET)
    assert reg.tenants["globex"].operator and not reg.tenants["acme"].operator
    assert TenantRegistry.single_key("kvm-local-dev-key-123", secret=SECRET).tenants["default"].operator
    cfg["tenants"][1]["operator"] = "yes"
    with pytest.raises(ConfigError, match="operator"):
        TenantRegistry.from_dict(cfg, secret=SECRET)


def test_new_api_key_is_accepted_and_unique():
    keys = {new_api_key() for _ in range(50)}
    assert len(keys) == 50
    key = keys.pop()
    reg = TenantRegistry.single_key(key, secret=SECRET)
    assert reg.authenticate(f"Bearer {key}").id == "default"


# --- salts ------------------------------------------------------------------------------------------


def test_salt_is_hmac_of_secret_and_scope(registry):
    acme = registry.tenants["acme"]
    expected = hmac.new(SECRET, b"kvmesh-cache-salt-v1\0tenant:acme", hashlib.sha256).hexdigest()
    assert acme.salt == expected
    assert acme.salt != registry.tenants["globex"].salt


def test_same_group_shares_salt_and_group_never_collides_with_tenant():
    cfg = config(
        tenants=[
            {"id": "a", "group": "docs", "keys": [{"sha256": hash_api_key(KEY_A)}]},
            {"id": "b", "group": "docs", "keys": [{"sha256": hash_api_key(KEY_B)}]},
            {"id": "docs", "keys": [{"sha256": hash_api_key(KEY_A2)}]},  # a tenant named like the group
        ]
    )
    reg = TenantRegistry.from_dict(cfg, secret=SECRET)
    assert reg.tenants["a"].salt == reg.tenants["b"].salt
    assert reg.tenants["docs"].salt != reg.tenants["a"].salt


@settings(max_examples=200)
@given(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
)
def test_salts_differ_for_different_tenants_and_secrets(t1, t2):
    s1, s2 = derive_salt(SECRET, t1), derive_salt(SECRET, t2)
    assert (s1 == s2) == (t1 == t2)
    assert derive_salt(SECRET + b"-rotated", t1) != s1  # rotation: every old salt stops matching
    assert len(s1) == 64 and int(s1, 16) >= 0


def test_resolve_secret_precedence_and_validation(tmp_path, caplog):
    f = tmp_path / "secret"
    f.write_text("file-secret-0123456789\n")
    assert (
        resolve_secret(b"explicit-secret-0123", f, env={"KVMESH_SALT_SECRET": "env-secret-0123456789"})
        == b"explicit-secret-0123"
    )
    assert resolve_secret(None, f, env={"KVMESH_SALT_SECRET": "env-secret-0123456789"}) == b"env-secret-0123456789"
    assert resolve_secret(None, None, env={"KVMESH_SALT_SECRET_FILE": str(f)}) == b"file-secret-0123456789"
    assert resolve_secret(None, f, env={}) == b"file-secret-0123456789"
    with caplog.at_level(logging.WARNING):
        generated = resolve_secret(None, None, env={})
    assert len(generated) == 32 and generated != resolve_secret(None, None, env={})
    assert "ephemeral" in caplog.text
    with pytest.raises(ConfigError, match="too short"):
        resolve_secret("short", None, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_secret(None, tmp_path / "missing", env={})


def test_a_salt_secret_in_the_environment_is_stripped_as_one_in_a_file_is(tmp_path):
    """One value salts alike whichever way it comes in; the preflight (`check_usable_secret`) strips it too."""
    value = "0123456789abcdef0123456789abcdef\n"  # an env file or a YAML block scalar keeps the newline
    f = tmp_path / "secret"
    f.write_text(value)
    via_env = resolve_secret(env={"KVMESH_SALT_SECRET": value})
    assert via_env == resolve_secret(env={"KVMESH_SALT_SECRET_FILE": str(f)}) == value.strip().encode()
    with pytest.raises(ConfigError, match="too short"):  # 10 bytes, however many blanks around them
        resolve_secret(env={"KVMESH_SALT_SECRET": " " * 10 + "abcdefghij"})


# --- config validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.update(tenants=[]), "non-empty"),
        (lambda c: c.update(extra=1), "unknown top-level"),
        (lambda c: c["tenants"][0].update(id="bad id!"), r"\.id"),
        (lambda c: c["tenants"][1].update(id="acme"), "duplicate"),
        (lambda c: c["tenants"][0].update(keys=[{"sha256": "nothex"}]), "64 hex"),
        (lambda c: c["tenants"][0].update(keys=[{"key": KEY_A}]), "sha256"),  # plain keys refused
        (lambda c: c["tenants"][1].update(keys=[{"sha256": hash_api_key(KEY_A)}]), "twice"),
        (lambda c: c["tenants"][0].update(limits={"request_per_s": 1}), "unknown key"),  # typo
        (lambda c: c["tenants"][0].update(limits={"max_concurrent": -1}), "positive"),
        (lambda c: c["tenants"][0].update(limits={"max_concurrent": 1.5}), "integer"),
        (lambda c: c["tenants"][0].update(group=""), r"\.group"),
        (lambda c: c["tenants"][0]["keys"][0].update(revoked="yes"), "revoked"),
        # matched whole: a trailing newline made "acme\n" a second tenant beside "acme"
        (lambda c: c["tenants"][1].update(id="acme\n"), r"tenants\[1\]\.id: expected"),
        (lambda c: c["tenants"][1].update(group="pub\n"), r"tenants\[1\]\.group: expected"),
        (lambda c: c["tenants"][1].update(keys=[{"sha256": hash_api_key(KEY_B) + "\n"}]), "64 hex"),
        # the ingress's own names for requests of no configured tenant (metrics rows, the open ingress)
        (lambda c: c["tenants"][1].update(id="unauthenticated"), r"tenants\[1\]\.id: 'unauthenticated' is reserved"),
        (lambda c: c["tenants"][1].update(id="anonymous"), r"tenants\[1\]\.id: 'anonymous' is reserved"),
    ],
)
def test_bad_config_is_rejected_with_a_pointer(mutate, match):
    cfg = config()
    mutate(cfg)
    with pytest.raises(ConfigError, match=match):
        TenantRegistry.from_dict(cfg, secret=SECRET)


@pytest.mark.parametrize(
    "limits, key, match",
    [
        ({"requests_per_s": 1, "burst_requests": 0.5}, "burst_requests", ">= 1"),  # no request passes
        ({"requests_per_s": 1, "burst_requests": 0}, "burst_requests", ">= 1"),
        ({"requests_per_s": 1, "burst_requests": float("nan")}, "burst_requests", "finite"),
        ({"burst_requests": 5}, "burst_requests", "needs requests_per_s"),  # a burst of no bucket
        ({"tokens_per_min": float("nan")}, "tokens_per_min", "finite"),  # NaN passed `<= 0` and lifted it
        ({"requests_per_s": float("nan")}, "requests_per_s", "finite"),
        ({"requests_per_s": float("inf")}, "requests_per_s", "finite"),
        ({"max_concurrent": float("inf")}, "max_concurrent", "positive integer"),  # was an OverflowError
        ({"max_prompt_tokens": float("nan")}, "max_prompt_tokens", "positive integer"),
        ({"tokens_per_min": 10**400}, "tokens_per_min", "finite"),  # past float's range
        # a text prompt counts as 1 token before tokenising: below 1 it got 429 "retry in 60 s" for good
        ({"tokens_per_min": 0.5}, "tokens_per_min", ">= 1"),
        # a wait of 1/1e-310 s is inf: math.ceil raised OverflowError, a 500
        ({"requests_per_s": 1e-310}, "requests_per_s", ">= 1e-06"),
        ({"requests_per_s": 1e-7}, "requests_per_s", ">= 1e-06"),
        ({"min_priority": 1.5}, "min_priority", "an integer"),
        ({"min_priority": "high"}, "min_priority", "an integer"),
        ({"min_priority": float("nan")}, "min_priority", "an integer"),
    ],
)
def test_a_limit_that_would_lift_itself_or_lock_a_tenant_out_is_a_config_error_naming_its_key(limits, key, match):
    cfg = config()
    cfg["tenants"][1]["limits"] = limits
    with pytest.raises(ConfigError, match=match) as info:
        TenantRegistry.from_dict(cfg, secret=SECRET)
    assert str(info.value).startswith(f"tenants[1].limits.{key}: ") and "\n" not in str(info.value)
    assert len(str(info.value)) < 200


def test_a_burst_inherits_its_rate_from_the_defaults_and_a_tenant_lifting_the_rate_must_lift_the_burst():
    cfg = config(defaults={"limits": {"requests_per_s": 2, "burst_requests": 4}})
    cfg["tenants"][1]["limits"] = {"burst_requests": 8}
    reg = TenantRegistry.from_dict(cfg, secret=SECRET)
    assert reg.tenants["globex"].limits == Limits(requests_per_s=2, burst_requests=8)
    cfg["tenants"][1]["limits"] = {"burst_requests": 1.5}  # a fractional bucket size above 1 admits, as before
    assert TenantRegistry.from_dict(cfg, secret=SECRET).tenants["globex"].limits.burst_requests == 1.5
    # null lifts the limit (docs/tenants.md): the burst inherited from the defaults goes with its rate
    cfg["tenants"][1]["limits"] = {"requests_per_s": None}
    lifted = TenantRegistry.from_dict(cfg, secret=SECRET).tenants["globex"].limits
    assert (lifted.requests_per_s, lifted.burst_requests) == (None, None)
    cfg["tenants"][1]["limits"] = {"requests_per_s": None, "burst_requests": 3}  # written here: no bucket for it
    with pytest.raises(ConfigError, match=r"^tenants\[1\]\.limits\.burst_requests: needs requests_per_s"):
        TenantRegistry.from_dict(cfg, secret=SECRET)


@pytest.mark.parametrize(
    "admission, match",
    [
        ({"max_concurrent": 0}, r"^admission\.max_concurrent: .*positive integer"),
        ({"max_concurrent": 2.5}, r"^admission\.max_concurrent: .*positive integer"),
        ({"max_concurrent": float("inf")}, r"^admission\.max_concurrent: .*positive integer"),
        ({"queue_timeout_s": float("nan")}, r"^admission\.queue_timeout_s: .*finite"),
        ({"queue_timeout_s": None}, r"^admission\.queue_timeout_s: .*finite"),
        ({"queue_timeout_s": -1}, r"^admission\.queue_timeout_s: .*>= 0"),
    ],
)
def test_bad_admission_settings_are_config_errors_not_failures_at_start(admission, match):
    with pytest.raises(ConfigError, match=match):
        TenantRegistry.from_dict(config(admission=admission), secret=SECRET)


def test_a_queue_timeout_of_0_loads_and_means_never_queue():
    """0 loaded before limits were checked (a full server answers at once): still does."""
    reg = TenantRegistry.from_dict(config(admission={"max_concurrent": 1, "queue_timeout_s": 0}), secret=SECRET)
    assert reg.admission_config["queue_timeout_s"] == 0


@pytest.mark.parametrize(
    "name, text",
    [
        ("t.json", '{"tenants": [{"id": "acme", "keys": [{"sha256": "%s"}], "limits": {"tokens_per_min": NaN}}]}'),
        ("t.yaml", 'tenants: [{id: acme, keys: [{sha256: "%s"}], limits: {tokens_per_min: .nan}}]'),
        ("u.yaml", 'tenants: [{id: acme, keys: [{sha256: "%s"}], limits: {max_concurrent: .inf}}]'),
        ("t.toml", '[[tenants]]\nid = "acme"\nkeys = [{sha256 = "%s"}]\nlimits = {requests_per_s = nan}\n'),
    ],
)
def test_a_tenants_file_with_nan_or_inf_limits_is_refused_as_a_dict_is(tmp_path, name, text):
    """JSON's NaN, YAML's .nan/.inf and TOML's nan all parse to floats: the file path must refuse them too."""
    (tmp_path / name).write_text(text % hash_api_key(KEY_A))
    where = re.escape(f"tenants file {tmp_path / name}: ")
    with pytest.raises(ConfigError, match=rf"^{where}tenants\[0\]\.limits\.\w+: expected a (positive|finite)"):
        TenantRegistry.from_file(tmp_path / name, secret=SECRET)


_KEYS_A = f"    keys: [{{sha256: {hash_api_key(KEY_A)}}}]\n"


@pytest.mark.parametrize(
    "text, match",
    [
        # YAML keys of mixed types (an int and a str) could not be sorted for the message: a TypeError
        (f"tenants:\n  - id: a\n{_KEYS_A}    1: x\n    foo: y\n", r"tenants\[0\]: unknown key\(s\) \[1, 'foo'\]"),
        (f"tenants:\n  - id: a\n{_KEYS_A}1: x\nfoo: y\n", r"tenants config: unknown top-level key\(s\) \[1, 'foo'\]"),
        (
            f"tenants:\n  - id: a\n{_KEYS_A}    limits: {{1: 2, foo: 3}}\n",
            r"tenants\[0\]\.limits: unknown key\(s\) \[1, 'foo'\]",
        ),
        # a secret_file that is no path was handed to Path(): a TypeError
        (f"secret_file: 123\ntenants:\n  - id: a\n{_KEYS_A}", r"secret_file: expected .*\(a string\), got 123$"),
        (f"secret_file: [a]\ntenants:\n  - id: a\n{_KEYS_A}", r"secret_file: expected .*, got \['a'\]$"),
        (f"secret_file: {{a: 1}}\ntenants:\n  - id: a\n{_KEYS_A}", r"secret_file: expected .*, got \{'a': 1\}$"),
    ],
)
@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_tenants_file_of_keys_of_the_wrong_type_is_a_one_line_error_naming_the_file_and_key(
    tmp_path, monkeypatch, text, match, secret
):
    monkeypatch.delenv("KVMESH_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE", raising=False)
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'tenants file {path}: ')}{match}") as info:
        TenantRegistry.from_file(path, secret=secret)
    assert "\n" not in str(info.value)


def test_a_yaml_syntax_error_names_its_line_and_column(tmp_path):
    """The parser's first line ("while parsing a block mapping") said neither where nor what."""
    path = tmp_path / "t.yaml"
    path.write_text(f"tenants:\n  - id: a\n{_KEYS_A}   limits: {{}}\n")
    with pytest.raises(ConfigError) as info:
        TenantRegistry.from_file(path, secret=SECRET)
    message = str(info.value)
    assert message.startswith(f"cannot parse tenants file {path}: line 4 column 4: expected <block end>")
    assert "\n" not in message


def test_the_smallest_burst_the_config_accepts_admits_a_request_once_its_retry_after_passed():
    clock = FakeClock()
    adm = Admission(clock=clock)
    t = Tenant("t", None, "s" * 64, Limits.from_dict({"requests_per_s": 0.5, "burst_requests": 1}))
    adm.release(adm.try_acquire(t, 1))
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 1)
    clock.t += int(info.value.headers()["Retry-After"])
    adm.release(adm.try_acquire(t, 1))


def test_limits_inherit_defaults_field_by_field(registry):
    assert registry.tenants["acme"].limits == Limits(requests_per_s=5, max_prompt_tokens=1000)
    assert registry.tenants["globex"].limits == Limits(max_prompt_tokens=1000)
    assert registry.admission_config == {"max_concurrent": 4, "queue_timeout_s": 1}


def test_from_file_yaml_toml_json_agree(tmp_path):
    import yaml

    cfg = config()
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "t.json").write_text(json.dumps(cfg))
    toml = ["[defaults.limits]", "max_prompt_tokens = 1000", "[admission]", "max_concurrent = 4", "queue_timeout_s = 1"]
    for t in cfg["tenants"]:
        toml.append("[[tenants]]")
        toml.append(f'id = "{t["id"]}"')
        toml.append(
            "keys = ["
            + ", ".join(
                '{ sha256 = "' + k["sha256"] + '"' + (", revoked = true" if k.get("revoked") else "") + " }"
                for k in t["keys"]
            )
            + "]"
        )
        if "limits" in t:
            toml.append("limits = { requests_per_s = 5 }")
    (tmp_path / "t.toml").write_text("\n".join(toml) + "\n")
    regs = [TenantRegistry.from_file(tmp_path / n, secret=SECRET) for n in ("t.yaml", "t.json", "t.toml")]
    for reg in regs:
        assert reg.authenticate(f"Bearer {KEY_B}") == regs[0].authenticate(f"Bearer {KEY_B}")
        with pytest.raises(AuthError, match="revoked"):
            reg.authenticate(f"Bearer {KEY_REVOKED}")
    with pytest.raises(ConfigError, match="cannot parse"):
        (tmp_path / "bad.yaml").write_text("tenants: [unclosed")
        TenantRegistry.from_file(tmp_path / "bad.yaml", secret=SECRET)
    with pytest.raises(ConfigError, match="cannot read"):
        TenantRegistry.from_file(tmp_path / "absent.yaml", secret=SECRET)


@pytest.mark.parametrize("name", ["t.yaml", "t.json", "t.toml"])
def test_a_tenants_file_that_is_not_utf8_is_the_modules_one_line_error(tmp_path, name):
    """Callers other than `kvmesh serve` (the ingress replica) got a bare UnicodeDecodeError."""
    path = tmp_path / name
    path.write_bytes(b"tenants:\n  - id: acme \xff\n")
    with pytest.raises(ConfigError) as info:
        TenantRegistry.from_file(path, secret=SECRET)
    assert str(info.value) == f"cannot read tenants file {path}: not UTF-8 text (byte 22)"


def test_example_config_loads():

    example = REPO_ROOT / "deployments" / "tenants.example.yaml"
    reg = TenantRegistry.from_file(example, secret=SECRET)
    assert len(reg.tenants) >= 3
    groups = [t.group for t in reg.tenants.values() if t.group]
    assert len(groups) != len(set(groups))  # the example shows a sharing group with 2+ members


def test_secret_file_relative_to_config(tmp_path, monkeypatch):
    import yaml

    monkeypatch.delenv("KVMESH_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE", raising=False)
    (tmp_path / "salt").write_text("relative-file-secret-0123")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(config(secret_file="salt")))
    reg = TenantRegistry.from_file(tmp_path / "t.yaml")
    assert reg.tenants["acme"].salt == derive_salt(b"relative-file-secret-0123", "acme")


# --- following the tenants file (Kubernetes updates a mounted Secret in place) --------------------------


def _revoke(cfg: dict, key: str) -> dict:
    for tenant in cfg["tenants"]:
        for entry in tenant["keys"]:
            if entry["sha256"] == hash_api_key(key):
                entry["revoked"] = True
    return cfg


def _kubelet_secret_dir(root, files: dict[str, str], version: int) -> None:
    """A Secret volume as the kubelet writes it: files in a timestamped folder, `..data` a symlink to it that
    is swapped atomically on update, each name a symlink through `..data`."""
    import os

    folder = root / f"..v{version}"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")
    (root / "..data_tmp").symlink_to(folder.name)
    os.replace(root / "..data_tmp", root / "..data")


@pytest.mark.parametrize("how", ["rewritten", "kubelet symlink swap"])
def test_a_key_revoked_in_the_file_is_refused_after_the_reload_interval(tmp_path, how):
    """The ingress builds its registry once and nothing restarts it for a Secret update, so the registry
    itself must notice the revocation."""
    import yaml

    clock = FakeClock()
    if how == "rewritten":
        path = tmp_path / "tenants.yaml"
        path.write_text(yaml.safe_dump(config()))
    else:
        path = tmp_path / "tenants.yaml"
        _kubelet_secret_dir(tmp_path, {"tenants.yaml": yaml.safe_dump(config())}, 1)
    reg = TenantRegistry.from_file(path, secret=SECRET, reload_interval_s=5, clock=clock)
    assert reg.authenticate(f"Bearer {KEY_A}").id == "acme"
    if how == "rewritten":
        path.write_text(yaml.safe_dump(_revoke(config(), KEY_A)))
    else:
        _kubelet_secret_dir(tmp_path, {"tenants.yaml": yaml.safe_dump(_revoke(config(), KEY_A))}, 2)
    clock.t += 4.9  # looked at most once per interval
    assert reg.authenticate(f"Bearer {KEY_A}").id == "acme"
    clock.t += 0.1
    with pytest.raises(AuthError) as exc:
        reg.authenticate(f"Bearer {KEY_A}")
    assert exc.value.code == "revoked_api_key"
    assert reg.authenticate(f"Bearer {KEY_A2}").id == "acme"  # the tenant's other key still works


def test_the_ingress_registry_follows_the_file(tmp_path, monkeypatch):
    """The ingress's own call (`build_registry`, `TenantRegistry.from_file(path)`) gets a registry that
    follows the file: the defaults are read at the call."""
    import yaml

    from kvmesh.deployments import tenants
    from kvmesh.deployments.ingress import build_registry

    monkeypatch.setenv("KVMESH_SALT_SECRET", SECRET.decode())
    monkeypatch.setattr(tenants, "RELOAD_INTERVAL_S", 0.0, raising=False)
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config()))
    reg = build_registry({"tenants_file": str(path)})
    assert reg.authenticate(f"Bearer {KEY_A}").id == "acme"
    path.write_text(yaml.safe_dump(_revoke(config(), KEY_A)))
    with pytest.raises(AuthError):
        reg.authenticate(f"Bearer {KEY_A}")


@pytest.mark.parametrize(
    "broken",
    ["not: [valid", "tenants: []", "unreadable"],
    ids=["unparsable", "invalid", "unreadable"],
)
def test_a_broken_tenants_file_keeps_the_last_good_config_and_logs_one_error(tmp_path, caplog, broken):
    """A bad edit must neither open access nor lock every tenant out; it is said once, not per request."""
    import yaml

    clock = FakeClock()
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config()))
    reg = TenantRegistry.from_file(path, secret=SECRET, reload_interval_s=5, clock=clock)
    if broken == "unreadable":
        path.unlink()
    else:
        path.write_text(broken)
    with caplog.at_level(logging.ERROR, logger="kvmesh.deployments.tenants"):
        for _ in range(3):
            clock.t += 5
            assert reg.authenticate(f"Bearer {KEY_A}").id == "acme"
            with pytest.raises(AuthError):
                reg.authenticate(f"Bearer {KEY_REVOKED}")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "still serving the config loaded before" in errors[0].getMessage()
    path.write_text(yaml.safe_dump(_revoke(config(), KEY_A)))  # fixed: followed again
    clock.t += 5
    with pytest.raises(AuthError):
        reg.authenticate(f"Bearer {KEY_A}")


def test_a_changed_admission_block_is_logged_and_left_for_a_restart(tmp_path, caplog):
    """The ingress builds its Admission from `admission_config` once: the registry keeps saying what that
    was, and says the change waits for a restart."""
    import yaml

    clock = FakeClock()
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config()))
    reg = TenantRegistry.from_file(path, secret=SECRET, reload_interval_s=5, clock=clock)
    path.write_text(yaml.safe_dump(_revoke(config(admission={"max_concurrent": 99}), KEY_A)))
    clock.t += 5
    with caplog.at_level(logging.WARNING, logger="kvmesh.deployments.tenants"):
        assert reg.refresh() is True
    assert reg.admission_config == {"max_concurrent": 4, "queue_timeout_s": 1}
    assert any("takes effect when the ingress restarts" in r.getMessage() for r in caplog.records)
    with pytest.raises(AuthError):  # the rest of the file took effect
        reg.authenticate(f"Bearer {KEY_A}")


def test_a_rotated_salt_secret_file_changes_the_salts_and_a_bad_one_keeps_the_old(tmp_path, monkeypatch):
    """Salt rotation on Kubernetes is a Secret update too: a new secret only makes old cache entries
    unreachable, a placeholder or short one is refused and the salts in use stay."""
    import yaml

    monkeypatch.delenv("KVMESH_SALT_SECRET", raising=False)
    secret_file = tmp_path / "salt"
    secret_file.write_text("first-salt-secret-0123456789")
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", str(secret_file))
    clock = FakeClock()
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config()))
    reg = TenantRegistry.from_file(path, reload_interval_s=5, clock=clock)
    first = reg.authenticate(f"Bearer {KEY_A}").salt
    assert first == derive_salt(b"first-salt-secret-0123456789", "acme")
    fingerprint = reg.secret_fingerprint
    secret_file.write_text("second-salt-secret-0123456789")
    clock.t += 5
    assert reg.authenticate(f"Bearer {KEY_A}").salt == derive_salt(b"second-salt-secret-0123456789", "acme")
    assert reg.secret_fingerprint != fingerprint
    for bad in ("short", "REPLACE-with-random-bytes-0123456789"):
        secret_file.write_text(bad)
        clock.t += 5
        assert reg.authenticate(f"Bearer {KEY_A}").salt == derive_salt(b"second-salt-secret-0123456789", "acme")


def test_a_generated_secret_is_kept_when_the_file_reloads(tmp_path, monkeypatch):
    """With no secret configured the process generates one; a reload must not generate another (every
    tenant's cache would go cold at every edit of the file)."""
    import yaml

    monkeypatch.delenv("KVMESH_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE", raising=False)
    clock = FakeClock()
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config()))
    reg = TenantRegistry.from_file(path, reload_interval_s=5, clock=clock)
    salt = reg.authenticate(f"Bearer {KEY_A}").salt
    path.write_text(yaml.safe_dump(_revoke(config(), KEY_B)))
    clock.t += 5
    assert reg.refresh() is True
    with pytest.raises(AuthError):
        reg.authenticate(f"Bearer {KEY_B}")
    assert reg.authenticate(f"Bearer {KEY_A}").salt == salt


# --- client salts -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body", [{"cache_salt": "x"}, {"cache_salt": None}, {"tenant_id": "acme"}, {"prompt": "hi", "kvmesh_tenant": "b"}]
)
def test_client_salt_in_body_is_rejected(body):
    with pytest.raises(ClientSaltError) as info:
        reject_client_salt(body)
    assert info.value.status == 400 and info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("header", ["X-Kvmesh-Tenant", "x-tenant-id", "X-Cache-Salt"])
def test_tenant_headers_are_rejected(header):
    with pytest.raises(ClientSaltError):
        reject_client_salt({"prompt": "hi"}, {header: "acme"})


def test_ordinary_requests_pass_client_salt_check():
    reject_client_salt({"model": "m", "prompt": "hi", "user": "u1"}, {"Authorization": "Bearer x"})
    reject_client_salt(["not", "a", "dict"])  # shape errors are the ingress's to report
    reject_client_salt(None)


# --- admission --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def tenant(tid="t", **limits):
    return Tenant(id=tid, group=None, salt="s" * 64, limits=Limits(**limits))


def test_token_bucket_refills_at_rate():
    b = TokenBucket(capacity=10, rate=2, now=0.0)
    assert b.wait_s(10, 0.0) == 0
    b.take(10)
    assert b.wait_s(1, 0.0) == pytest.approx(0.5)
    assert b.wait_s(4, 1.0) == pytest.approx(1.0)  # 2 refilled, need 2 more at 2/s
    assert b.wait_s(10, 100.0) == 0  # capped at capacity
    b.take(10)
    assert b.wait_s(1, 100.0) > 0


def test_requests_per_second_limit_gives_429_with_retry_after():
    clock = FakeClock()
    adm = Admission(clock=clock)
    t = tenant(requests_per_s=2)
    tickets = [adm.try_acquire(t, 1) for _ in range(2)]
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 1)
    assert info.value.status == 429 and info.value.retry_after_s == pytest.approx(0.5)
    assert info.value.headers() == {"Retry-After": "1"}
    assert info.value.body()["error"]["type"] == "rate_limit_error"
    clock.t += 0.5
    tickets.append(adm.try_acquire(t, 1))
    for tk in tickets:
        adm.release(tk)
    assert adm.in_flight == 0 and adm.active("t") == 0


def test_tokens_per_minute_limit():
    clock = FakeClock()
    adm = Admission(clock=clock)
    t = tenant(tokens_per_min=600)  # 10 tokens/s
    adm.release(adm.try_acquire(t, 500))
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 200)
    assert info.value.retry_after_s == pytest.approx(10.0)
    assert info.value.headers()["Retry-After"] == "10"
    clock.t += 10
    adm.release(adm.try_acquire(t, 200))
    with pytest.raises(PromptTooLarge):  # can never fit the per-minute budget
        adm.try_acquire(t, 601)


def test_a_429_names_the_bucket_whose_wait_is_its_retry_after():
    """Both buckets short: the message names the one that sets Retry-After, not the requests bucket whenever
    it is short at all."""
    clock = FakeClock()
    adm = Admission(clock=clock)
    t = tenant(requests_per_s=1, tokens_per_min=6000)  # 100 tokens a second
    adm.release(adm.try_acquire(t, 6000))  # the whole minute's tokens and the 1-request burst
    clock.t += 0.5
    with pytest.raises(RateLimited) as info:  # requests: 0.5 s more; tokens: 10 s
        adm.try_acquire(t, 1000)
    assert info.value.headers()["Retry-After"] == "10"
    assert "prompt tokens per minute" in info.value.message and "requests per second" not in info.value.message
    with pytest.raises(RateLimited) as info:  # requests: 0.5 s; tokens for 1: 0.01 s
        adm.try_acquire(t, 1)
    assert info.value.retry_after_s == pytest.approx(0.5) and "requests per second" in info.value.message


def test_max_prompt_tokens_is_400_not_429():
    adm = Admission()
    with pytest.raises(PromptTooLarge) as info:
        adm.try_acquire(tenant(max_prompt_tokens=100), 101)
    assert info.value.status == 400 and "100" in info.value.message
    adm.release(adm.try_acquire(tenant(max_prompt_tokens=100), 100))


def test_max_concurrent_per_tenant_and_release_is_idempotent():
    adm = Admission()
    t, other = tenant("t", max_concurrent=2), tenant("o", max_concurrent=2)
    a, b = adm.try_acquire(t, 1), adm.try_acquire(t, 1)
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 1)
    assert info.value.code == "concurrency_limit_exceeded"
    adm.release(adm.try_acquire(other, 1))  # another tenant is unaffected
    adm.release(a)
    adm.release(a)  # double release must not free a second slot
    c = adm.try_acquire(t, 1)
    with pytest.raises(RateLimited):
        adm.try_acquire(t, 1)
    for tk in (b, c):
        adm.release(tk)
    assert adm.in_flight == 0


def test_rejected_request_does_not_consume_budget():
    clock = FakeClock()
    adm = Admission(max_concurrent=1, clock=clock)
    t = tenant(requests_per_s=1, burst_requests=2)
    first = adm.try_acquire(t, 1)
    with pytest.raises(RateLimited, match="capacity"):
        adm.try_acquire(t, 1)  # server full: refunded
    adm.release(first)
    adm.release(adm.try_acquire(t, 1))  # the refunded token is still there
    with pytest.raises(RateLimited, match="requests per second"):
        adm.try_acquire(t, 1)


def _refusal(check) -> tuple[int, dict, dict]:
    with pytest.raises((RateLimited, PromptTooLarge)) as info:
        check()
    return info.value.status, info.value.body(), info.value.headers()


def test_precheck_refuses_what_acquire_would_refuse_now_alike_and_charges_nothing():
    """The ingress's check before tokenising: the same refusal as `acquire` for the same count, and a check
    that passes or refuses takes nothing from the buckets and counts nothing in flight."""
    clock = FakeClock()
    adm = Admission(clock=clock)
    t = tenant(requests_per_s=1, burst_requests=2, tokens_per_min=600, max_prompt_tokens=400, max_concurrent=3)
    for _ in range(10):
        adm.precheck(t, 300)
        adm.precheck(t, 1, exact=False)
    assert adm.active("t") == 0 and adm.in_flight == 0
    held = [adm.try_acquire(t, 300), adm.try_acquire(t, 250)]  # all the checks above took nothing
    clock.t += 0.5  # half a request and 5 tokens back: 55 tokens
    for n, exact in [(1, False), (10, False), (10, True)]:  # the requests bucket is empty
        assert _refusal(lambda: adm.precheck(t, n, exact)) == _refusal(lambda: adm.try_acquire(t, 10))
    assert _refusal(lambda: adm.precheck(t, 401)) == _refusal(lambda: adm.try_acquire(t, 401))
    assert _refusal(lambda: adm.precheck(t, 401))[0] == 400  # the prompt-size check comes first, as in acquire
    clock.t += 0.5  # a request back; 60 tokens
    adm.precheck(t, 60)
    assert _refusal(lambda: adm.precheck(t, 61)) == _refusal(lambda: adm.try_acquire(t, 61))
    held.append(adm.try_acquire(t, 55))
    clock.t += 1.0  # a request and 10 tokens back (15); 3 in flight: the tenant's cap
    status, body, headers = _refusal(lambda: adm.precheck(t, 1, exact=False))
    assert body["error"]["code"] == "concurrency_limit_exceeded"
    assert (status, body, headers) == _refusal(lambda: adm.try_acquire(t, 1))
    for tk in held:
        adm.release(tk)
    adm.release(adm.try_acquire(t, 15))  # what the refused checks left: one request, 15 tokens
    assert _refusal(lambda: adm.try_acquire(t, 1))[0] == 429
    assert adm.in_flight == 0 and adm.active("t") == 0


def test_precheck_of_an_uncounted_prompt_refuses_below_one_token_and_never_for_a_full_server():
    """Text is counted only once tokenised; before, it has at least 1 token. Its size cap waits for the count
    (the 400 states it), and a full server is a wait in the fair queue, never a refusal here."""
    clock = FakeClock()
    adm = Admission(max_concurrent=1, clock=clock)
    t = tenant(tokens_per_min=60, max_prompt_tokens=40)  # a token a second
    adm.precheck(t, 41, exact=False)  # at least 41: the 400 waits for the count
    adm.release(adm.try_acquire(t, 40))
    adm.release(adm.try_acquire(t, 19))
    adm.precheck(t, 1, exact=False)  # 1 token left: the prompt may fit, so it is tokenised
    with pytest.raises(RateLimited):
        adm.try_acquire(t, 2)
    adm.release(adm.try_acquire(t, 1))
    clock.t += 0.25
    status, body, headers = _refusal(lambda: adm.precheck(t, 1, exact=False))  # 0.25 left: certain to fail
    assert status == 429 and "prompt tokens per minute" in body["error"]["message"]
    assert headers == {"Retry-After": "1"}
    clock.t += 60
    held = adm.try_acquire(t, 1)  # the server's one slot
    adm.precheck(t, 1, exact=False)  # acquire would wait for the slot, not refuse
    adm.release(held)
    assert adm.in_flight == 0 and adm.active("t") == 0


def test_fair_queue_alternates_between_flooding_and_quiet_tenant():
    """Global bound 1: tenant F queues 6 requests, then Q queues 2; grants alternate F/Q, so Q's
    requests are served 2nd and 4th, not after all of F's."""

    async def scenario():
        adm = Admission(max_concurrent=1, queue_timeout_s=5)
        flood, quiet = tenant("flood"), tenant("quiet")
        holder = await adm.acquire(flood, 1)
        order: list[str] = []

        async def one(t):
            tk = await adm.acquire(t, 1)
            order.append(t.id)
            await asyncio.sleep(0)
            adm.release(tk)

        tasks = [asyncio.create_task(one(flood)) for _ in range(6)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one(quiet)) for _ in range(2)]
        await asyncio.sleep(0)
        assert adm.waiting("flood") == 6 and adm.waiting("quiet") == 2
        adm.release(holder)
        await asyncio.gather(*tasks)
        return order, adm

    order, adm = asyncio.run(scenario())
    assert order[:4] == ["flood", "quiet", "flood", "quiet"], order
    assert sorted(order) == ["flood"] * 6 + ["quiet"] * 2
    assert adm.in_flight == 0 and adm.waiting() == 0


def test_flood_capped_by_per_tenant_concurrency_leaves_room_for_others():
    async def scenario():
        adm = Admission(max_concurrent=4, queue_timeout_s=5)
        flood, quiet = tenant("flood", max_concurrent=3), tenant("quiet", max_concurrent=3)
        flood_tickets, refused = [], 0
        for _ in range(50):
            try:
                flood_tickets.append(await asyncio.wait_for(adm.acquire(flood, 1), 0.1))
            except RateLimited:
                refused += 1
        q = await asyncio.wait_for(adm.acquire(quiet, 1), 0.1)  # admitted at once: a slot is left
        return len(flood_tickets), refused, q, adm

    admitted, refused, q, adm = asyncio.run(scenario())
    assert (admitted, refused) == (3, 47)
    assert q.tenant_id == "quiet" and adm.in_flight == 4


def test_queue_timeout_gives_429_and_refunds():
    async def scenario():
        adm = Admission(max_concurrent=1, queue_timeout_s=0.05)
        t = tenant("t", max_concurrent=5)
        held = await adm.acquire(t, 1)
        with pytest.raises(RateLimited) as info:
            await adm.acquire(t, 1)
        assert info.value.code == "server_busy" and info.value.headers()["Retry-After"] == "1"
        assert adm.active("t") == 1 and adm.waiting() == 0
        adm.release(held)
        adm.release(adm.try_acquire(t, 1))  # no stale waiter blocks a later request
        return adm

    adm = asyncio.run(scenario())
    assert adm.in_flight == 0


def test_a_server_busy_retry_after_follows_how_fast_slots_free_bounded_by_the_queue_timeout():
    """A fixed 1 s sent a client that had waited the whole queue_timeout_s back into the same full queue."""
    clock = FakeClock()
    adm = Admission(max_concurrent=1, queue_timeout_s=30, clock=clock)
    t = tenant("t")
    held = adm.try_acquire(t, 1)
    with pytest.raises(RateLimited) as info:  # no slot released in the last 30 s: come back in 30
        adm.try_acquire(t, 1)
    assert info.value.code == "server_busy" and info.value.headers()["Retry-After"] == "30"
    for _ in range(6):  # a slot released every 4 s: the next one is about 5 s away (6 in the last 30 s)
        clock.t += 4
        adm.release(held)
        held = adm.try_acquire(t, 1)
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 1)
    assert info.value.retry_after_s == pytest.approx(5.0)
    clock.t += 31  # those releases are older than the queue timeout now
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 1)
    assert info.value.retry_after_s == pytest.approx(30.0)
    for _ in range(3000):  # fast releases: never under 1 s
        adm.release(held)
        held = adm.try_acquire(t, 1)
        clock.t += 0.001
    with pytest.raises(RateLimited) as info:
        adm.try_acquire(t, 1)
    assert info.value.headers()["Retry-After"] == "1"
    adm.release(held)
    assert adm.in_flight == 0


def test_a_request_that_waited_out_the_queue_is_told_to_come_back_after_the_timeout_not_in_1_s():
    async def scenario():
        adm = Admission(max_concurrent=1, queue_timeout_s=1.2)
        held = await adm.acquire(tenant("a"), 1)
        with pytest.raises(RateLimited) as info:
            await adm.acquire(tenant("b"), 1)
        adm.release(held)
        return info.value

    refused = asyncio.run(scenario())
    assert refused.code == "server_busy" and refused.headers()["Retry-After"] == "2"


def test_cancelled_waiter_frees_its_place():
    async def scenario():
        adm = Admission(max_concurrent=1, queue_timeout_s=5)
        t = tenant("t")
        held = await adm.acquire(t, 1)
        waiter = asyncio.create_task(adm.acquire(t, 1))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        adm.release(held)
        assert adm.in_flight == 0 and adm.active("t") == 0
        nxt = await asyncio.wait_for(adm.acquire(t, 1), 0.1)
        adm.release(nxt)
        return adm

    assert asyncio.run(scenario()).in_flight == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), min_size=1, max_size=40), st.integers(1, 4))
def test_admission_invariants_under_random_acquire_release(ops, cap):
    """Random interleavings: in-flight never exceeds the global or per-tenant caps and returns to 0."""
    adm = Admission(max_concurrent=cap)
    tenants = {n: tenant(n, max_concurrent=2) for n in "abc"}
    held: dict[str, list] = {n: [] for n in "abc"}
    for name, acquire in ops:
        if acquire:
            try:
                held[name].append(adm.try_acquire(tenants[name], 1))
            except RateLimited:
                pass
        elif held[name]:
            adm.release(held[name].pop())
        assert adm.in_flight == sum(len(v) for v in held.values()) <= cap
        assert all(adm.active(n) == len(held[n]) <= 2 for n in "abc")
    for name in "abc":
        for tk in held[name]:
            adm.release(tk)
    assert adm.in_flight == 0


def test_admission_from_registry(registry):
    adm = Admission.from_registry(registry)
    assert adm.max_concurrent == 4 and adm.queue_timeout_s == 1
    acme = registry.tenants["acme"]
    with pytest.raises(PromptTooLarge):
        adm.try_acquire(acme, 1001)


# --- metrics ----------------------------------------------------------------------------------------


def test_metrics_hit_rates_and_prometheus_text():
    m = TenantMetrics()
    m.record("a", 100, 50, 0.2)
    m.record("a", 300, 0, 0.04)
    m.record("b", 10, 10, None)
    m.record_rejection("a", "rate_limit_exceeded")
    m.record_rejection(None, "invalid_api_key")
    snap = m.snapshot()
    assert snap["a"]["hit_rate_tokens"] == pytest.approx(50 / 400)
    assert snap["a"]["hit_rate_requests"] == pytest.approx(0.25)  # mean of 0.5 and 0
    assert snap["a"]["ttft_mean_s"] == pytest.approx(0.12)
    assert snap["b"]["hit_rate_tokens"] == 1.0 and snap["b"]["ttft_mean_s"] is None
    assert snap["unauthenticated"]["rejections"] == {"invalid_api_key": 1}
    text = m.prometheus_text()
    assert 'kvmesh_tenant_cached_tokens_total{tenant="a"} 50' in text
    assert 'kvmesh_tenant_hit_rate_tokens{tenant="a"} 0.125000' in text
    assert 'kvmesh_tenant_ttft_seconds_bucket{tenant="a",le="0.05"} 1' in text
    assert 'kvmesh_tenant_ttft_seconds_bucket{tenant="a",le="+Inf"} 2' in text
    assert 'kvmesh_tenant_rejections_total{tenant="unauthenticated",reason="invalid_api_key"} 1' in text
    assert 'requests_total{tenant="unauthenticated"}' not in text
    with pytest.raises(ValueError):
        m.record("a", 10, 11)


def test_metrics_text_parses_with_prometheus_parser():
    from prometheus_client import parser  # installed with vLLM

    m = TenantMetrics()
    m.record('we"ird\\tenant', 64, 32, 0.3)
    families = {f.name: f for f in parser.text_string_to_metric_families(m.prometheus_text())}
    assert families["kvmesh_tenant_cached_tokens"].samples[0].labels["tenant"] == 'we"ird\\tenant'
    assert families["kvmesh_tenant_ttft_seconds"].type == "histogram"


@settings(max_examples=100)
@given(st.lists(st.tuples(st.integers(0, 5000), st.floats(0, 1)), min_size=1, max_size=30))
def test_metrics_token_rate_matches_definition(reqs):
    m = TenantMetrics()
    total_p = total_c = 0
    for prompt, frac in reqs:
        cached = int(prompt * frac)
        m.record("t", prompt, cached, 0.1)
        total_p, total_c = total_p + prompt, total_c + cached
    snap = m.snapshot()["t"]
    assert snap["cached_tokens"] == total_c and snap["prompt_tokens"] == total_p
    assert snap["hit_rate_tokens"] == pytest.approx(total_c / total_p if total_p else 0.0)
    assert 0.0 <= snap["hit_rate_requests"] <= 1.0


# --- k8s secret -------------------------------------------------------------------------------------


def test_k8s_tenants_secret_matches_rayservice_and_loads():
    """The example Secret is what the RayService mounts (name, key, path) and a valid tenants file."""

    import yaml

    k8s = REPO_ROOT / "k8s"
    secret = yaml.safe_load((k8s / "tenants-secret.example.yaml").read_text())
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "kvmesh-tenants"
    docs = [d for d in yaml.safe_load_all((k8s / "rayservice.yaml").read_text()) if d and d.get("kind") == "RayService"]
    text = yaml.safe_dump(docs)
    assert "secretName: kvmesh-tenants" in text and "/etc/kvmesh/tenants/tenants.yaml" in text
    raw = yaml.safe_load(secret["stringData"]["tenants.yaml"])
    reg = TenantRegistry.from_dict(raw, secret=SECRET)
    assert reg.authenticate("Bearer kvm-example-acme-key-do-not-use").id == "acme"
    with pytest.raises(AuthError, match="revoked"):
        reg.authenticate("Bearer kvm-example-acme-old-key-revoked")
    assert "kvm-example" not in "".join(
        line.split("#")[0] for line in secret["stringData"]["tenants.yaml"].splitlines()
    )


def test_secret_file_is_private_and_readable_by_resolve_secret(tmp_path):
    import os
    import stat

    from kvmesh.deployments.tenants import write_secret_file

    path = write_secret_file("a-secret-of-enough-length", tmp_path / "run")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert resolve_secret(None, None, env={"KVMESH_SALT_SECRET_FILE": str(path)}) == b"a-secret-of-enough-length"
    assert write_secret_file("a-secret-of-enough-length", tmp_path / "run") != path  # never overwrites
    with pytest.raises(ConfigError):
        write_secret_file("short", tmp_path)


def test_salt_secret_never_travels_in_ray_runtime_env(monkeypatch):
    """Ray logs runtime_env env vars verbatim (runtime_env_agent.log): only the file path may travel."""
    from kvmesh.deployments.app import runtime_env_vars

    monkeypatch.setenv("KVMESH_SALT_SECRET", "must-not-be-passed-0123456789")
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", "/run/secret/path")
    env = runtime_env_vars()
    assert "KVMESH_SALT_SECRET" not in env and "must-not-be-passed-0123456789" not in env.values()
    assert env["KVMESH_SALT_SECRET_FILE"] == "/run/secret/path"


def test_an_edit_dropping_the_configs_secret_file_keeps_the_salts_in_use(tmp_path, monkeypatch):
    """A registry salted from the config's `secret_file`: an edit that drops or mistypes the key would fall
    through to a generated secret (every tenant's salt changed, differently on each ingress replica, again at
    every edit). The edit is refused and the salts in use stay."""
    import yaml

    monkeypatch.delenv("KVMESH_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE", raising=False)
    (tmp_path / "salt").write_text("the-config-salt-secret-0123456789")
    clock = FakeClock()
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({**config(), "secret_file": "salt"}))
    reg = TenantRegistry.from_file(path, reload_interval_s=5, clock=clock)
    salt = reg.authenticate(f"Bearer {KEY_A}").salt
    assert salt == derive_salt(b"the-config-salt-secret-0123456789", "acme")
    path.write_text(yaml.safe_dump(config()))  # the key dropped
    clock.t += 5
    assert reg.refresh() is False
    assert reg.authenticate(f"Bearer {KEY_A}").salt == salt
    path.write_text(yaml.safe_dump({**_revoke(config(), KEY_B), "secret_file": "salt"}))  # a good edit still lands
    clock.t += 5
    assert reg.refresh() is True and reg.authenticate(f"Bearer {KEY_A}").salt == salt


def test_a_priority_floor_is_any_integer_and_inherited_from_the_defaults():
    """`min_priority`: negative too (vLLM's priorities are any integer, lower first); a tenant without one takes
    the defaults' and may lift it with null."""
    cfg = config()
    cfg["defaults"]["limits"]["min_priority"] = 5
    cfg["tenants"][1]["limits"] = {"min_priority": -3}
    registry = TenantRegistry.from_dict(cfg, secret=SECRET)
    assert {t.id: t.limits.min_priority for t in registry.tenants.values()} == {"acme": 5, "globex": -3}
    cfg["tenants"][0]["limits"]["min_priority"] = None
    registry = TenantRegistry.from_dict(cfg, secret=SECRET)
    assert registry.tenants["acme"].limits.min_priority is None
