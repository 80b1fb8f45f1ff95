"""The router class as Serve ships it to the ingress process: `RequestRouterConfig` pickles the router's
module by value, so every module-level object a router method names arrives as a copy. The objects the
router shares with the ingress (prediction ledger, miss attribution) must be reached through their
modules, which pickle by reference; a name bound at import (`from ... import ATTRIBUTION`) gave the
router a private copy the ingress never read, and `/kvmesh/explain` found no record of any request.

Run in a child process: deserialising a class by value in the process that defined it rewrites the
original class's methods (cloudpickle's class tracker), which would leak into other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

_SHIP = r"""
import json, logging, types
from ray.serve._private.utils import ensure_serialization_context
ensure_serialization_context()  # what serve.run does: locks become picklable
from ray.serve.config import RequestRouterConfig

shipped = RequestRouterConfig(request_router_class="kvmesh.deployments.router:KvmeshRouter").get_request_router_class()

from kvmesh.deployments import local_state, miss_attribution

names = {}
for attr in vars(shipped).values():
    fn = getattr(attr, "__func__", attr)
    fn = getattr(fn, "fget", fn)
    g = getattr(fn, "__globals__", None)
    if g is None:
        continue
    for name, value in g.items():
        if name.startswith("__"):
            continue
        plain = isinstance(value, (types.ModuleType, type, types.FunctionType, logging.Logger, bool, int, str))
        names[name] = "reference" if plain else type(value).__name__
        if name == "local_state":
            names["local_state.LEDGER is the process's"] = value.LEDGER is local_state.LEDGER
        if name == "miss_attribution":
            names["miss_attribution.ATTRIBUTION is the process's"] = value.ATTRIBUTION is miss_attribution.ATTRIBUTION
print(json.dumps(names))
"""


def _shipped_globals() -> dict:
    out = subprocess.run([sys.executable, "-c", _SHIP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_shipped_router_reaches_the_ingress_objects_through_their_modules():
    names = _shipped_globals()
    copies = {n: t for n, t in names.items() if t not in ("reference", True, False)}
    assert copies == {}, f"module-level objects the shipped router would hold as private copies: {copies}"
    assert names["local_state.LEDGER is the process's"] is True
    assert names["miss_attribution.ATTRIBUTION is the process's"] is True
