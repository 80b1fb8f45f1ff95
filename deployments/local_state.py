"""Objects the router and the ingress share inside one ingress process.

Why a module of its own: Serve ships the router class to the ingress process pickled (cloudpickle may
copy a class by value, together with the module-level objects its methods use). Code that needs the
process-wide instances therefore looks them up here at call time (`local_state.LEDGER`), through the
module, which is always imported by reference -- never through a name bound at import time.
"""

from __future__ import annotations

import weakref

from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.replica_loss import OpenCalls

LEDGER = PredictionLedger()
ROUTERS: weakref.WeakSet = weakref.WeakSet()  # KvmeshRouter instances living in this process
# the ingress's ServingMetrics in this process: a router that forgets a replica drops its per-replica rows
SERVING_METRICS: weakref.WeakSet = weakref.WeakSet()
# the ingress's engine calls in flight: a router that forgets a replica abandons those still open on it later
OPEN_CALLS = OpenCalls()
