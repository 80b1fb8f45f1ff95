"""With numba loaded (LMCache, or kvmesh's compiled placement score), vLLM's start-up scan of every module
attribute's `vars()` fails on llvmlite's `ffi.lib`; `patch_llvmlite_dunder_lookup` makes it pass and numba
still compiles. In a fresh interpreter: the patch is process-wide and cannot be taken back."""

import subprocess
import sys

SCRIPT = r'''
import sys
import kvmesh.policies.score_kernel  # loads numba, and with it llvmlite

def scan():
    """The part of vLLM's `_rebind_kernels` that reads every module attribute's instance dict."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        for value in list((namespace or {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")

try:
    scan()
    print("scan passed unpatched")
except AttributeError:
    print("scan failed unpatched")
from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup
assert patch_llvmlite_dunder_lookup() and patch_llvmlite_dunder_lookup()
scan()
import numba
assert numba.njit(lambda x: x + 1)(41) == 42
print("patched ok")
'''


def test_the_llvmlite_patch_lets_vllms_module_scan_pass_with_numba_loaded():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["scan", "failed", "unpatched", "patched", "ok"], out.stdout
