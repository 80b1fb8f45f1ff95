"""Every private Ray and Ray Serve name kvmesh uses, in one module: the modules' names listed in
`PRIVATE_SYMBOLS`, `ray.init`'s private keywords in `INIT_KEYWORDS`.

Ray 2.60 has no public way to do these few things, and each is small:
- keep a node on 127.0.0.1: Ray rewrites a loopback address to the host's routable one
  (`ray._private.services.resolve_ip_for_localhost`) and pins a node's address only through `ray.init`'s
  private keyword `_node_ip_address` (deployments/local_ray.py, deployments/ray_join.py);
- keep a local cluster's files (its sockets among them) in a private folder of the run's, not in the shared
  /tmp/ray: `ray.init`'s private keyword `_temp_dir` (deployments/local_ray.py; a Ray without it refuses the
  keyword by name, "Unknown keyword argument(s)");
- give a starting node longer than Ray's fixed 30 s to register (`ray._private.services.get_node`,
  benchmarks/local_cluster.py);
- bind Serve's replica-to-replica gRPC server on loopback (`ray.serve._private.replica.add_port_to_grpc_server`,
  deployments/loopback_serve.py);
- know which transport Serve resolved for replica-to-replica calls in this process
  (`ray.serve._private.constants.RAY_SERVE_USE_GRPC_BY_DEFAULT`: its own environment variable, or its
  throughput preset; deployments/ingress.py);
- count a Serve replica's requests in flight (its actor's name prefix,
  `ray.serve._private.common.REPLICA_ID_FULL_ID_STR_PREFIX`, and `ReplicaActor.get_num_ongoing_requests`,
  deployments/drain.py);
- give each of several handle calls made for one HTTP request an internal request id of its own (Serve's
  request context, `ray.serve.context._serve_request_context`, which every handle call copies its id from, and
  `ray.serve._private.utils.generate_request_id`; deployments/ingress.py, a request's several choices).

No other kvmesh module imports a private Ray path (tests/unit/deployments/test_ray_private.py scans the
source). `problems()` checks that the installed Ray still has each name of both lists, and the Ray Serve
contract check (deployments/serve_contract.py) includes it, so a Ray that lacks one fails the deploy naming
it, rather than a patch going missing at run time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Serve names a replica's actor "SERVE_REPLICA::<app>#<deployment>#<id>"
SERVE_REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"
# the replica actor's method that Serve's own draining reads
REPLICA_IN_FLIGHT_METHOD = "get_num_ongoing_requests"
# the field of Serve's request context that a handle call takes its internal request id from
REQUEST_ID_FIELD = "_internal_request_id"
# ray.init's private keyword that pins this node's address
NODE_IP_INIT_KEYWORD = "_node_ip_address"
# ray.init's private keyword for the folder a new local cluster keeps its files in
TEMP_DIR_INIT_KEYWORD = "_temp_dir"
# the private ray.init keywords kvmesh passes, and who passes them: read from **kwargs, so not in
# PRIVATE_SYMBOLS (no attribute to resolve) but checked by `problems()` all the same
INIT_KEYWORDS = ((NODE_IP_INIT_KEYWORD, "local_ray, ray_join"), (TEMP_DIR_INIT_KEYWORD, "local_ray"))


@dataclass(frozen=True)
class PrivateSymbol:
    module: str
    name: str  # attribute path inside the module ("Class.method" for a method)
    used_by: str

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


PRIVATE_SYMBOLS = (
    PrivateSymbol("ray._private.services", "resolve_ip_for_localhost", "local_ray, ray_join: nodes on 127.0.0.1"),
    PrivateSymbol("ray._private.services", "get_node", "benchmarks.local_cluster: patient node start"),
    PrivateSymbol("ray.serve._private.replica", "add_port_to_grpc_server", "loopback_serve: gRPC on loopback"),
    PrivateSymbol("ray.serve._private.replica", f"ReplicaActor.{REPLICA_IN_FLIGHT_METHOD}", "drain"),
    PrivateSymbol("ray.serve._private.common", "REPLICA_ID_FULL_ID_STR_PREFIX", "drain: replica actor names"),
    PrivateSymbol("ray.serve._private.constants", "RAY_SERVE_USE_GRPC_BY_DEFAULT", "ingress: engine transport"),
    PrivateSymbol("ray.serve.context", "_serve_request_context", "ingress: a request id per choice"),
    PrivateSymbol("ray.serve.context", "_get_serve_request_context", "ingress: a request id per choice"),
    PrivateSymbol("ray.serve.context", "_RequestContext", "ingress: a request id per choice"),
    PrivateSymbol("ray.serve._private.utils", "generate_request_id", "ingress: a request id per choice"),
)


def _resolve(symbol: PrivateSymbol) -> Any:
    obj: Any = importlib.import_module(symbol.module)
    for part in symbol.name.split("."):
        obj = getattr(obj, part)
    return obj


def problems() -> list[str]:
    """Every private name in PRIVATE_SYMBOLS or INIT_KEYWORDS the installed Ray lacks or has changed (empty
    when all fit)."""
    out = []
    for symbol in PRIVATE_SYMBOLS:
        try:
            value = _resolve(symbol)
        except ImportError as exc:
            out.append(f"{symbol.qualified} cannot be imported ({exc}; used by {symbol.used_by})")
            continue
        except AttributeError:
            out.append(f"{symbol.qualified} is missing (used by {symbol.used_by})")
            continue
        if symbol.name == "REPLICA_ID_FULL_ID_STR_PREFIX":
            if value != SERVE_REPLICA_ACTOR_PREFIX:
                out.append(f"{symbol.qualified} is {value!r}, not {SERVE_REPLICA_ACTOR_PREFIX!r} (used by drain)")
        elif symbol.name == "RAY_SERVE_USE_GRPC_BY_DEFAULT":
            if not isinstance(value, bool):
                out.append(f"{symbol.qualified} is {value!r}, not a bool (used by {symbol.used_by})")
        elif symbol.name == "_serve_request_context":
            if not isinstance(value, contextvars.ContextVar):
                out.append(f"{symbol.qualified} is not a context variable (used by {symbol.used_by})")
        elif symbol.name == "_RequestContext":
            fields = {f.name for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else set()
            if REQUEST_ID_FIELD not in fields:
                out.append(f"{symbol.qualified} has no field {REQUEST_ID_FIELD} (used by {symbol.used_by})")
        elif not callable(value):
            out.append(f"{symbol.qualified} is not callable (used by {symbol.used_by})")
    import ray

    try:  # the keywords are read from **kwargs, so they are not in the signature: look in the source
        init_text = inspect.getsource(inspect.unwrap(ray.init))
    except (OSError, TypeError):  # no source installed: the docstring lists them too; neither: cannot tell
        init_text = ray.init.__doc__ or ""
    for keyword, used_by in INIT_KEYWORDS:
        # named as a string the source reads (`kwargs.pop("_temp_dir", ...)`) or the docstring lists
        # (``_temp_dir``): a mention in a comment or inside a longer name is not the keyword
        named = rf"[\"']{re.escape(keyword)}[\"']|``{re.escape(keyword)}``"
        if init_text and not re.search(named, init_text):
            out.append(f"ray.init has no keyword {keyword} (used by {used_by})")
    return out


def node_ip_init_kwargs(node_ip: str) -> dict[str, Any]:
    """The `ray.init` keyword arguments that pin this node's address to `node_ip`."""
    return {NODE_IP_INIT_KEYWORD: node_ip}


def temp_dir_init_kwargs(path: str) -> dict[str, Any]:
    """The `ray.init` keyword arguments that put a new local cluster's files under `path`."""
    return {TEMP_DIR_INIT_KEYWORD: path}


@contextlib.contextmanager
def localhost_resolver(make: Callable[[Callable[[str], str]], Callable[[str], str]]) -> Iterator[None]:
    """While inside, Ray resolves "localhost"-like hosts with `make(ray's own resolver)`."""
    import ray._private.services as services

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = make(resolve)  # type: ignore[assignment]
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = resolve


def get_node_function() -> Callable[..., Any]:
    """Ray's `services.get_node(gcs_address, node_id)`, which a starting node waits on."""
    import ray._private.services as services

    return services.get_node


def set_get_node_function(fn: Callable[..., Any]) -> None:
    import ray._private.services as services

    services.get_node = fn


def replica_grpc_add_port() -> Callable[..., Any] | None:
    """Serve's replica-module `add_port_to_grpc_server`; None when the module has no such name (ImportError
    when this Ray has no such module)."""
    from ray.serve._private import replica

    return getattr(replica, "add_port_to_grpc_server", None)


def set_replica_grpc_add_port(fn: Callable[..., Any]) -> None:
    from ray.serve._private import replica

    replica.add_port_to_grpc_server = fn


def serve_uses_grpc_by_default() -> bool:
    """Whether Serve, as resolved in this process, sends replica-to-replica calls over its gRPC channel."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_USE_GRPC_BY_DEFAULT)


def context_with_own_request_id() -> contextvars.Context:
    """A copy of the current context in which Serve's handle calls carry an internal request id of their own.

    Why: a handle call takes its internal request id from the HTTP request it serves, and the router keys a
    placement by it (as Serve's own router does). Calls made at once for one HTTP request (its choices:
    `n` > 1, a batch of prompts) must each be a request of their own, or they take each other's place."""
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    def fresh() -> None:
        current = serve_context._get_serve_request_context()
        own: Any = dataclasses.replace(current, **{REQUEST_ID_FIELD: generate_request_id()})  # type: ignore[arg-type]
        var: contextvars.ContextVar[Any] = serve_context._serve_request_context
        var.set(own)

    ctx = contextvars.copy_context()
    ctx.run(fresh)
    return ctx
