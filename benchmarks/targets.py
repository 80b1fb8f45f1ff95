"""PASS/MISS for a bench's targets, and its exit status: every bench prints its whole report, then
exits non-zero if any target was missed, so `make bench` (run_all) and `BENCH=<part> make bench` fail
on a miss instead of printing MISS and exiting 0."""

from __future__ import annotations

import sys


class Targets:
    """The targets one bench checked; `verdict` records each, `exit_if_missed` ends the bench."""

    def __init__(self) -> None:
        self.missed: list[str] = []

    def verdict(self, name: str, ok: bool) -> str:
        """'PASS' or 'MISS' (to print beside the figure); a miss is remembered under `name`."""
        if not ok:
            self.missed.append(name)
        return "PASS" if ok else "MISS"

    def exit_if_missed(self) -> None:
        """Call after the report is printed: SystemExit(1) naming the missed targets, if any."""
        if self.missed:
            print(f"MISS: {len(self.missed)} target(s) missed: {'; '.join(self.missed)}")
            sys.stdout.flush()
            raise SystemExit(1)
