"""`make bench`: run every benchmarks/bench_*.py module's `main()` in order, print figures and
ratios against baselines measured in the same run, and say PASS/MISS per target. One failing bench
does not hide the others; the exit status is non-zero if any bench crashed or exited non-zero (every
bench that misses a target raises SystemExit(1) after printing its report: `targets.Targets`)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import time
import traceback

from kvmesh import benchmarks

OPT_IN = {"bench_sim_speed"}  # minutes on this machine and a large trace file: BENCH=sim_speed
# benches a BENCH=<group> runs beside its bench_<group>*.py ones (their names do not say the group)
GROUPS = {"scale": {"bench_ingress_throughput", "bench_overhead"}}


def main(argv=None) -> int:
    """Run the benchmarks named (argv or $BENCH; all but the opt-in ones when none is). A SIGTERM unwinds the
    running bench, so what it started is stopped and removed; the caller's handler is back afterwards (tests
    call this in their own process)."""
    from kvmesh.deployments.process_tree import sigterm_unwinds

    with sigterm_unwinds():
        return _run(argv)


def _run(argv) -> int:
    from kvmesh.deployments.process_tree import Terminated

    wanted = set((argv if argv is not None else sys.argv[1:]) or os.environ.get("BENCH", "").split(",")) - {""}
    names = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    shorts = {n.removeprefix("bench_") for n in names}
    unknown = sorted(
        w
        for w in wanted
        if w not in names and w not in GROUPS and not any(s == w or s.startswith(w + "_") for s in shorts)
    )
    if unknown:  # a misspelt name would run nothing and pass
        print(
            f"BENCH: no benchmark named {', '.join(unknown)} (benchmarks: {', '.join(sorted(shorts))})", file=sys.stderr
        )
        return 2
    crashed, failed = [], []
    for name in names:
        short = name.removeprefix("bench_")
        if name in OPT_IN and name not in wanted and short not in wanted:
            continue  # long: only when named
        named = any(short == w or short.startswith(w + "_") or name in GROUPS.get(w, ()) for w in wanted)
        if wanted and name not in wanted and not named:
            continue  # BENCH=scale runs bench_scale.py, bench_scale_*.py and its GROUPS
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            importlib.import_module(f"kvmesh.benchmarks.{name}").main()
        except Terminated:  # the whole run was stopped, not this bench's verdict
            raise
        except SystemExit as exc:  # a bench's verdict (e.g. a MISS): keep going, remember it
            if exc.code not in (None, 0):
                failed.append(name)
        except Exception:  # keep going: report every bench
            traceback.print_exc()
            crashed.append(name)
        print(f"--- {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    if crashed:
        print(f"\ncrashed: {', '.join(crashed)}")
    if failed:
        print(f"\nexited non-zero: {', '.join(failed)}")
    return 1 if crashed or failed else 0


if __name__ == "__main__":
    sys.exit(main())
