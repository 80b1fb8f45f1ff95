"""Work-arounds for third-party bugs met when vLLM runs in-process next to LMCache or numba.

llvmlite's `ffi.lib` wrapper answers *any* attribute lookup, `__dict__` included, with a C-function
wrapper. vLLM 0.32's CPU worker scans every loaded module's objects with `vars(obj).get(...)` at
start-up (`vllm/triton_utils/dispatcher.py`), so once numba → llvmlite is loaded (by LMCache, or by
kvmesh's compiled placement score, `policies/score_kernel.py`, in a process that also places requests),
an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) dies with
"AttributeError: '_lib_fn_wrapper' object has no attribute 'get'". Multiprocess engines are safe only
because their worker starts before the connector imports LMCache. Making the wrapper refuse dunder
names restores normal Python semantics without changing anything llvmlite itself calls. The engine
driver applies it before every engine it starts (`deployments/engine_driver.py`).
"""

from __future__ import annotations

_PATCHED = False


def patch_llvmlite_dunder_lookup() -> bool:
    """Idempotent; returns True when the patch is (now) in place, False when llvmlite is absent."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        from llvmlite.binding import ffi
    except Exception:
        return False
    original = ffi._lib_wrapper.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    ffi._lib_wrapper.__getattr__ = __getattr__
    _PATCHED = True
    return True
