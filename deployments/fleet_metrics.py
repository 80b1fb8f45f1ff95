"""One `/metrics` page for every ingress replica.

Behind one Service (or the HAProxy front) a scrape of `/metrics` reaches one ingress replica. With
several, each scrape would return another replica's counters under the same series, and Prometheus
would read every switch as a counter reset. So the replica that answers asks every ingress replica for
its own page (Serve's `broadcast`, a control-plane call, once per scrape) and merges them: each sample
gets an `ingress` label naming the replica it came from, and the samples of one metric family stay
together under one HELP and TYPE, as the text format requires. The label is there whenever the app runs
several ingress replicas, even on a scrape only one of them answered: a series keeps its identity.

Fleet-wide families (`FLEET_WIDE`: what the engines and the LMCache nodes report, which every ingress
replica reads alike) appear once, without the label: per ingress replica they would add up to a multiple
of the truth. Each of their series takes the highest value any page gives it (`_once`), a replica that misses
a scrape lending its last page's counters (`PageCache`); a gauge (a node's health, its L1 usage) is only ever
this scrape's: an older page's `up` must not hide a fresh `down`. With one ingress replica the page is its own,
unlabelled."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(.*)$")

# Families (their names as TYPE lines give them) whose figures are the fleet's, not one ingress replica's:
# the engine replicas' routing stats every router receives, and the LMCache nodes' tier figures.
FLEET_WIDE = frozenset(
    {
        "kvmesh_replica_engine_steps_total",
        "kvmesh_replica_lmcache_loaded_tokens_total",
        "kvmesh_replica_stats_errors_total",
        "kvmesh_tier_hit_tokens_total",
        "kvmesh_tier_lookup_tokens_total",
        "kvmesh_tier_chunks_total",
        "kvmesh_tier_bytes_total",
        "kvmesh_tier_server_healthy",
        "kvmesh_tier_shared_up",
        "kvmesh_tier_host_usage_ratio",
    }
)


# How long an ingress replica's last page counts for the fleet-wide families when it misses a scrape (slow, or
# restarting): a fleet-wide series whose freshest view was on that page would step back, which Prometheus reads
# as a counter reset (its increase() then counts the whole value again); a replica gone for good drops out after.
PAGE_KEEP_S = 60.0

# The family types whose series only grow (a histogram's buckets, sum and count too): the only ones a missing
# replica's last page may lend. A gauge's older value is no lower bound of its current one.
_LENT_TYPES = frozenset({"counter", "histogram", "summary"})


class PageCache:
    """The last page each ingress replica gave this one. A replica missing from a scrape lends its last page's
    fleet-wide counter (and histogram) families only: each of their series takes the highest value any page
    gives, so an older view never lowers it; its own series stay a gap, as an older value of theirs would step
    back. Its fleet-wide gauges are not lent: up to `keep_s` old, a node's `healthy 1` there would outvote the
    fresh pages' `0` for as long, hiding an outage. Not every step back is avoided: the replicas answering
    scrapes in turn each keep their own pages."""

    def __init__(self, keep_s: float = PAGE_KEEP_S):
        self.keep_s = keep_s
        self._pages: dict[str, tuple[float, str]] = {}

    def pages(self, fresh: dict[str, str], now: float) -> dict[str, str]:
        """`fresh` (replica id -> page, this scrape's), plus the fleet-wide counters of the last page of each
        replica missing from it that is at most `keep_s` old."""
        for replica, text in fresh.items():
            self._pages[replica] = (now, text)
        for replica in [r for r, (t, _) in self._pages.items() if now - t > self.keep_s]:
            del self._pages[replica]
        out = dict(fresh)
        for replica, (_, text) in self._pages.items():
            if replica not in out:
                out[replica] = _fleet_wide_part(text)
        return out


def _type(head: list[str]) -> str | None:
    """The type a family's TYPE line declares (None without one)."""
    for line in head:
        parts = line.split()
        if len(parts) >= 4 and parts[1] == "TYPE":
            return parts[3]
    return None


def _fleet_wide_part(text: str) -> str:
    """A page's fleet-wide families (`FLEET_WIDE`) of a type that only grows (`_LENT_TYPES`), head and samples."""
    return "".join(
        "\n".join([*head, *lines]) + "\n"
        for family, head, lines in _families(text)
        if family in FLEET_WIDE and _type(head) in _LENT_TYPES
    )


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


def _value(line: str) -> float:
    m = _SAMPLE.match(line)
    try:
        return float(m.group(3).split()[0]) if m else float("-inf")
    except (ValueError, IndexError):
        return float("-inf")


def _once(lines: list[str]) -> list[str]:
    """One sample per series of a fleet-wide family seen on several pages: its highest value. A counter's is
    the freshest view of a count that only grows; a gauge's too, among this scrape's pages (`PageCache` lends
    no gauges), since a page that could not read a node writes it as down (or not at all), so the first page's
    could show a node down beside its counters."""
    chosen: dict[str, str] = {}
    for line in lines:
        m = _SAMPLE.match(line)
        series = f"{m.group(1)}{m.group(2) or ''}" if m else line
        if series not in chosen or _value(line) > _value(chosen[series]):
            chosen[series] = line
    return list(chosen.values())


def merge(pages: dict[str, str], label: str = "ingress") -> str:
    """Every ingress replica's page as one, for an app with several (one page alone is labelled too):
    samples labelled with their replica, fleet-wide families once and unlabelled, each family once, in the
    order families first appear (replicas sorted, so the page is the same whichever replica answers)."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica in sorted(pages):
        for family, head, lines in _families(pages[replica]):
            if family not in heads:
                order.append(family)
                heads[family] = head
                samples[family] = []
            if family in FLEET_WIDE:
                samples[family].extend(lines)
            else:
                samples[family].extend(labelled(line, label, replica) for line in lines)
    out: list[str] = []
    for family in order:
        out.extend(heads[family])
        lines = samples[family]
        out.extend(_once(lines) if family in FLEET_WIDE else lines)
    return "\n".join(out) + "\n"
