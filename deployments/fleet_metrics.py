"""One `/metrics` page for every ingress replica.

Behind one Service (or the HAProxy front) a scrape of `/metrics` reaches one ingress replica. With
several, each scrape would return another replica's counters under the same series, and Prometheus
would read every switch as a counter reset. So the replica that answers asks every ingress replica for
its own page (Serve's `broadcast`, a control-plane call, once per scrape) and merges them: each sample
gets an `ingress` label naming the replica it came from, and the samples of one metric family stay
together under one HELP and TYPE, as the text format requires. With one replica the page is its own,
unlabelled."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(.*)$")


def labelled(line: str, label: str, value: str) -> str:
    """A sample line with `label="value"` added first among its labels; anything else unchanged."""
    m = _SAMPLE.match(line)
    if m is None:
        return line
    name, labels, rest = m.groups()
    pair = f'{label}="{value}"'
    inner = labels[1:-1] if labels else ""
    return f"{name}{{{pair}{',' if inner else ''}{inner}}} {rest}"


def _families(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(family, its HELP/TYPE lines, its sample lines) in page order. A sample belongs to the family
    whose TYPE came last before it (a histogram's _bucket/_sum/_count included); samples before any
    TYPE line form a family of their own name."""
    out: list[tuple[str, list[str], list[str]]] = []
    current: tuple[str, list[str], list[str]] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if current is None or current[0] != parts[2]:
                    current = (parts[2], [], [])
                    out.append(current)
                current[1].append(line)
            continue
        if current is None:
            m = _SAMPLE.match(line)
            current = (m.group(1) if m else line, [], [])
            out.append(current)
        current[2].append(line)
    return out


def merge(pages: dict[str, str], label: str = "ingress") -> str:
    """Every replica's page as one: samples labelled with their replica, each family once, in the order
    families first appear (replicas sorted, so the page is the same whichever replica answers)."""
    if len(pages) == 1:
        return next(iter(pages.values()))
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica in sorted(pages):
        for family, head, lines in _families(pages[replica]):
            if family not in heads:
                order.append(family)
                heads[family] = head
                samples[family] = []
            samples[family].extend(labelled(line, label, replica) for line in lines)
    out: list[str] = []
    for family in order:
        out.extend(heads[family])
        out.extend(samples[family])
    return "\n".join(out) + "\n"
