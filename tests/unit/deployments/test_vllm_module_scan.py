"""vLLM's CPU platform reads `vars(x).get(...)` for every attribute of every loaded module as an engine starts;
with numba loaded (kvmesh's compiled placement score) llvmlite's `ffi.lib` breaks that, and
`vllm_module_scan_safe` hides it for the start and puts it back."""

import sys

import pytest

import kvmesh.policies.score_kernel  # noqa: F401  loads numba, and with it llvmlite
from kvmesh.deployments.engine_driver import vllm_module_scan_safe


def _scan() -> None:
    """The part of vLLM's `_rebind_kernels` that reads every module attribute's instance dict."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for value in list(namespace.values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")


def test_numba_breaks_vllms_module_scan_and_the_guard_hides_it_while_an_engine_starts():
    ffi = sys.modules["llvmlite.binding.ffi"]
    lib = ffi.lib
    with pytest.raises(AttributeError):
        _scan()
    with vllm_module_scan_safe():
        _scan()
        assert "lib" not in vars(ffi)
    assert ffi.lib is lib  # back for numba's next compilation


def test_without_llvmlite_loaded_the_guard_changes_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "llvmlite.binding.ffi")
    with vllm_module_scan_safe():
        pass
