"""`kvmesh serve` as two processes: the one the user (or a service manager) started, which only relays
signals and cleans up, and the Ray driver, in a session of its own.

Why: a service manager may SIGTERM the whole process group. Ray's processes are the driver's children
in its group, so they got the signal at the same moment as the driver: the raylet exited first, and the
driver hung ("Failed to push error to driver") or aborted. With the driver in its own session a group
signal reaches only this relay, which turns it into one orderly SIGTERM for the driver. The relay is a
child subreaper: whatever is orphaned below it (an HAProxy whose Ray worker died) is reparented to it and
ended after the driver exits, and what a driver killed outright left on disk (its secret files, its Ray,
HAProxy and replicas' folders) is removed then too. If the relay itself is SIGKILLed, the kernel sends the
driver SIGHUP (parent-death signal), and the driver stops at once and ends its own leftovers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

DRIVER_ENV = "KVMESH_SERVE_DRIVER"  # set in the driver's environment: it must not start another relay


def is_driver() -> bool:
    return os.environ.get(DRIVER_ENV) == "1"


def supervise(argv: list[str]) -> int:
    """Run `python -m kvmesh.deployments.cli <argv>` as the driver; relay signals; return its status."""
    from kvmesh.deployments.process_tree import become_subreaper, die_with_parent, end_descendants

    become_subreaper()
    driver = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.deployments.cli", *argv],
        env={**os.environ, DRIVER_ENV: "1"},
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGHUP),
    )
    signals_seen: list[int] = []

    def relay(signum, frame):
        signals_seen.append(signum)
        try:
            # the first signal asks for an orderly stop (requests in flight finish); a second one insists
            driver.send_signal(signal.SIGTERM if len(signals_seen) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, relay)
    status = driver.wait()
    left = end_descendants()
    if left:
        print(f"ended {len(left)} process(es) left behind: {', '.join(left)}", file=sys.stderr, flush=True)
    from kvmesh.deployments.app import remove_dead_runs_files

    remove_dead_runs_files()
    return status if status >= 0 else 1
