"""Private Ray names are confined to deployments/ray_private.py, and the deploy-time contract check names
any of them the installed Ray lacks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from paths import REPO_ROOT

from kvmesh.deployments import ray_private
from kvmesh.deployments.serve_contract import ServeContractError, check_serve_contract, contract_problems

LIBRARY = ("deployments", "kvstore", "cluster", "policies", "benchmarks")
ALLOWED = REPO_ROOT / "deployments" / "ray_private.py"


def _private_ray(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "ray" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_ray_uses(source: str) -> list[str]:
    """Private Ray paths `source` imports or reads (`ray._private...`, `from ray.serve import _private`),
    and private `ray.init` keywords it passes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _private_ray(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if _private_ray(node.module) or _private_ray(f"{node.module}.{a.name}")
            ]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and _private_ray(dotted) and not _private_ray(dotted.rsplit(".", 1)[0]):
                found.append(dotted)
        elif isinstance(node, ast.Call) and _dotted(node.func) == "ray.init":
            found += [f"ray.init({k.arg}=...)" for k in node.keywords if k.arg and k.arg.startswith("_")]
    return found


def test_the_scan_finds_each_form_of_private_use():
    source = """
import ray._private.services as services
from ray.serve._private import replica
from ray import _raylet
import ray
ray._private.services.get_node
ray.init(address="local", _node_ip_address="127.0.0.1")
from ray.serve.request_router import RequestRouter
ray.util.get_node_ip_address()
ray.__version__
"""
    assert sorted(private_ray_uses(source)) == sorted(
        [
            "import ray._private.services",
            "from ray.serve._private import replica",
            "from ray import _raylet",
            "ray._private",
            "ray.init(_node_ip_address=...)",
        ]
    )


def test_no_library_module_but_ray_private_uses_a_private_ray_path():
    offenders = {}
    for folder in LIBRARY:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            if path == ALLOWED:
                continue
            uses = private_ray_uses(path.read_text())
            if uses:
                offenders[str(path.relative_to(REPO_ROOT))] = uses
    assert offenders == {}
    assert private_ray_uses(ALLOWED.read_text())  # the scan does see the one module that may


def test_every_listed_private_symbol_exists_in_the_installed_ray():
    assert ray_private.problems() == []
    assert {s.qualified for s in ray_private.PRIVATE_SYMBOLS} >= {
        "ray._private.services.resolve_ip_for_localhost",
        "ray.serve._private.replica.add_port_to_grpc_server",
    }


def test_a_missing_private_symbol_fails_the_contract_check_by_name(monkeypatch):
    import ray._private.services as services

    import kvmesh.deployments.serve_contract as contract

    monkeypatch.delattr(services, "resolve_ip_for_localhost")
    monkeypatch.setattr(contract, "_checked", False)
    assert contract_problems() == [
        "ray._private.services.resolve_ip_for_localhost is missing (used by local_ray, ray_join: nodes on 127.0.0.1)"
    ]
    with pytest.raises(ServeContractError, match=r"ray\._private\.services\.resolve_ip_for_localhost is missing"):
        check_serve_contract()


def test_a_changed_replica_actor_name_prefix_is_named(monkeypatch):
    from ray.serve._private import common

    monkeypatch.setattr(common, "REPLICA_ID_FULL_ID_STR_PREFIX", "REPLICA::")
    assert ray_private.problems() == [
        "ray.serve._private.common.REPLICA_ID_FULL_ID_STR_PREFIX is 'REPLICA::', not 'SERVE_REPLICA::' (used by drain)"
    ]


def test_the_loopback_resolver_is_restored_after_use():
    import ray._private.services as services

    before = services.resolve_ip_for_localhost
    with ray_private.localhost_resolver(lambda resolve: lambda host: "10.9.9.9"):
        assert services.resolve_ip_for_localhost("127.0.0.1") == "10.9.9.9"
    assert services.resolve_ip_for_localhost is before


def test_the_source_tree_layout_is_what_the_scan_assumes():
    assert all((REPO_ROOT / folder).is_dir() for folder in LIBRARY)
    assert Path(ray_private.__file__).resolve() == ALLOWED.resolve()


def test_a_ray_init_without_the_node_address_keyword_is_named(monkeypatch):
    import ray

    def init(address=None, **kwargs):
        kwargs.pop("_temp_dir", None)

    monkeypatch.setattr(ray, "init", init)
    assert ray_private.problems() == ["ray.init has no keyword _node_ip_address (used by local_ray, ray_join)"]


def test_a_ray_init_without_the_temp_dir_keyword_is_named(monkeypatch):
    """local_ray passes `_temp_dir` too: a Ray without it would refuse the start, so the deploy check names it."""
    import ray

    def init(address=None, **kwargs):
        kwargs.pop("_node_ip_address", None)

    monkeypatch.setattr(ray, "init", init)
    assert ray_private.problems() == ["ray.init has no keyword _temp_dir (used by local_ray)"]


def test_a_keyword_only_mentioned_in_a_comment_or_a_longer_name_is_not_taken_for_it(monkeypatch):
    import ray

    def init(address=None, **kwargs):
        kwargs.pop("_node_ip_address", None)
        # _temp_dir was read here once; now: _get_default_temp_dir() fallback

    monkeypatch.setattr(ray, "init", init)
    assert ray_private.problems() == ["ray.init has no keyword _temp_dir (used by local_ray)"]


def test_each_context_made_for_a_choice_gives_serve_handle_calls_an_internal_request_id_of_its_own():
    """Serve copies a handle call's internal request id from the request context; calls made at once for
    one HTTP request (its several choices) need one each, the rest of the context kept."""
    import contextvars

    from ray.serve import context as serve_context

    from kvmesh.deployments.ray_private import context_with_own_request_id

    def parent() -> list[tuple[str, str]]:
        serve_context._set_request_context(request_id="http-1", _internal_request_id="internal-1")
        seen = []
        for _ in range(2):
            ctx = context_with_own_request_id()
            own = ctx.run(serve_context._get_serve_request_context)
            seen.append((own.request_id, own._internal_request_id))
        here = serve_context._get_serve_request_context()
        seen.append((here.request_id, here._internal_request_id))
        return seen

    (a, b, kept) = contextvars.copy_context().run(parent)
    assert kept == ("http-1", "internal-1")  # the request's own context is left as it was
    assert a[0] == b[0] == "http-1"
    assert len({a[1], b[1], "internal-1"}) == 3 and all(a[1]) and all(b[1])
