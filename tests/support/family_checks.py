"""Checks every workload family's records must pass (`cluster/workload_family.py`, `cluster/workload_wide.py`)."""

from __future__ import annotations

from kvmesh.cluster.trace import check_record
from kvmesh.cluster.workload_family import CONTEXT_TOKENS, prompt_and_answer_tokens
from kvmesh.cluster.workloads import check_parent_rule


def check_family_records(d, recs: list[dict]) -> None:
    """`recs`, draw `d`'s records: as many as the draw says, each a valid Mooncake record within the live
    context, ids following one parent, no id shared across tenants (salts keep tenants apart live), and
    timestamps in order (all 0 for "all at once")."""
    assert len(recs) == d.requests
    for i, r in enumerate(recs):
        check_record(r, f"seed {d.seed} record {i}")
        assert prompt_and_answer_tokens(r, d.tokens_per_block) <= CONTEXT_TOKENS
    check_parent_rule(recs)
    tenant_of: dict = {}
    for r in recs:
        for h in r["hash_ids"]:
            assert tenant_of.setdefault(h, r["tenant"]) == r["tenant"]
    stamps = [r["timestamp"] for r in recs]
    assert stamps == sorted(stamps) and (d.arrival != "all" or set(stamps) == {0})
