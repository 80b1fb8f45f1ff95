"""`PrefixIndex.match` with array output, for fleets of hundreds of replicas.

Why: `PrefixIndex.match` returns a dict with one tuple per replica; at 256 replicas building it
costs more than the walk itself, and the simulator needs 1M such lookups. `match_arrays` performs
the same single pass over the request's hashes (same entries, same LRU touches, same counters) but
records only *where* each tier's alive-set shrank, then writes the per-slot prefix lengths into one
(3, n_slots) numpy array. tests/test_simulator.py checks it against `match` on random index states.
It reads PrefixIndex's internal representation; it belongs next to `match` in cluster/index.py and
should move there (owner: the index) -- kept separate here only to leave that file to its owner.
"""
from __future__ import annotations

import numpy as np

from cluster.index import PrefixIndex


def match_arrays(index: PrefixIndex, hashes, n_slots: int) -> np.ndarray:
    """Row 0/1/2 = hbm / host-or-hbm / any-tier longest cached prefix (blocks), column = replica slot."""
    index.expire()
    c = index._c
    c["lookups"] += 1
    c["lookup_blocks"] += len(hashes)
    entries = index._entries
    get = entries.get
    touch = entries.move_to_end
    widen = index._widen
    a_h = a_o = a_s = index._all
    drops = []
    i = 0
    n = len(hashes)
    while i < n and a_s:
        h = hashes[i]
        e = get(h)
        if e is None:
            break
        hb, hn, sh = e
        if hn:
            hm = widen.get(hn)
            if hm is None:
                hm = index._widen_nodes(hn)
            hbo = hb | hm
        else:
            hbo = hb
        n_h = a_h & hb
        n_o = a_o & hbo
        n_s = a_s if sh else a_s & hbo
        if n_h != a_h:
            drops.append((0, i, a_h ^ n_h))
            a_h = n_h
        if n_o != a_o:
            drops.append((1, i, a_o ^ n_o))
            a_o = n_o
        if n_s != a_s:
            drops.append((2, i, a_s ^ n_s))
            a_s = n_s
        if a_s:
            touch(h)
            i += 1
    out = np.full((3, n_slots), i, dtype=np.int64)
    best = i if a_s else 0
    if drops:
        # every dropped mask unpacked in one call: row k = slots that left tier drops[k][0] at drops[k][1]
        nbytes = (n_slots + 7) // 8
        raw = np.frombuffer(b"".join(m.to_bytes(nbytes, "little") for _, _, m in drops), dtype=np.uint8)
        bits = np.unpackbits(raw.reshape(len(drops), nbytes), axis=1, bitorder="little")[:, :n_slots].astype(bool)
        for k, (tier, pos, _) in enumerate(drops):  # a slot leaves each tier at most once
            out[tier, bits[k]] = pos
            if tier == 2 and not a_s and pos > best:
                best = pos
    if best:
        c["hits"] += 1
        c["hit_blocks"] += best
    return out
