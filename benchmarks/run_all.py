"""`make bench`: run every benchmarks/bench_*.py module's `main()` in order, print figures and
ratios against baselines measured in the same run, and say PASS/MISS per target. One failing bench
does not hide the others; the exit status is non-zero if any bench crashed or exited non-zero (every
bench that misses a target raises SystemExit(1) after printing its report: `targets.Targets`; a main()
that returns a non-zero int counts the same, as entry.run_main exits with it). Every BENCH name must
select a bench that runs, else nothing runs and the exit status is 2."""

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
    runs = {w: _runs(w, names, wanted) for w in wanted}
    unknown = sorted(w for w in wanted if not _selects(w, names))
    if unknown:  # a misspelt name would run nothing and pass
        print(
            f"BENCH: no benchmark named {', '.join(unknown)} (benchmarks: {', '.join(sorted(shorts))})", file=sys.stderr
        )
        return 2
    idle = sorted(w for w in wanted if not runs[w])
    if idle:  # e.g. BENCH=sim names only the opt-in bench_sim_speed, which the opt-in filter then skips
        opt_in = sorted({n.removeprefix("bench_") for w in idle for n in _selects(w, names)})
        print(
            f"BENCH: {', '.join(idle)} selects no benchmark that runs: it names only the opt-in "
            f"{', '.join(opt_in)}, which runs only when named in full (BENCH={','.join(opt_in)})",
            file=sys.stderr,
        )
        return 2
    crashed, failed = [], []
    selected = set().union(*runs.values()) if wanted else {n for n in names if n not in OPT_IN}
    for name in names:
        if name not in selected:
            continue  # BENCH=scale runs bench_scale.py, bench_scale_*.py and its GROUPS; opt-in ones only when named
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            result = importlib.import_module(f"kvmesh.benchmarks.{name}").main()
            if isinstance(result, int) and result != 0:  # the status entry.run_main would exit with
                failed.append(name)
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


def _selects(w: str, names: list[str]) -> set[str]:
    """The benches BENCH name `w` names: bench_<w> (or `w` given in full), bench_<w>_*, and GROUPS[w]."""
    return {
        n
        for n in names
        if n == w
        or n.removeprefix("bench_") == w
        or n.removeprefix("bench_").startswith(w + "_")
        or n in GROUPS.get(w, ())
    }


def _runs(w: str, names: list[str], wanted: set[str]) -> set[str]:
    """Those of `_selects(w)` that run: an opt-in bench only where its own name is among `wanted`."""
    return {n for n in _selects(w, names) if n not in OPT_IN or n in wanted or n.removeprefix("bench_") in wanted}


if __name__ == "__main__":
    sys.exit(main())
