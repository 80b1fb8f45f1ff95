"""What tenant isolation costs in hit rate: the same replay with per-tenant salts vs one shared salt.

Why: salting is not free -- text that several tenants send (a public system prompt, a common
document) is cached once per tenant instead of once. This bench measures that price on two workloads,
with the infinite-cache bound (no eviction, no placement: the cost of salting itself, nothing else):

1. Mooncake conversation trace (bundled). Every request starts with the same 512-token block (a
   common system prompt) and conversations diverge after it; each conversation (first two hash ids)
   is assigned to one of T tenants by a stable hash. Figures over the trace's second half, as the
   published 39.8% is. With an infinite cache salting costs one recomputation of the common block
   per tenant, paid in the first half; with a finite cache (one LRU of C blocks, the capacity a
   fleet's tiers hold) the T copies of common blocks also compete for space, which is the real cost.
   Cost = shared-salt hit rate - isolated hit rate.
2. A SaaS chat workload (kvmesh.cluster.workloads.synth_chat) whose tenants all prepend one public preamble
   (e.g. a common agent framework's tool descriptions) to their private system prompts; compared
   with per-tenant salts, shared salt, and sharing groups of 2 tenants (docs/tenants.md).

Targets (set before measuring, as product goals): salting costs exactly 0 where tenants share no
text (synth_chat as generated); isolation keeps >= 90% of the shared-salt hit rate on the Mooncake
conversation trace with 64 tenants and a 4M-token LRU cache.

Granularity: keys are whole 512-token trace blocks (fast; partial blocks are never cached in either
arm, so both lose the same tail).

Writes BENCH_OUT/tenants/bench_tenants.json and bench_tenants.png (BENCH_OUT default out; BENCH_JSON_DIR,
where set, names the folder instead).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

from kvmesh.benchmarks.output import out_dir, save_plot
from kvmesh.benchmarks.targets import Targets
from kvmesh.cluster.bounds import record_bounds
from kvmesh.cluster.trace import read_records
from kvmesh.cluster.workloads import SOURCE_BLOCK_TOKENS, ChatSpec, synth_chat

BLOCK = 512  # cache granularity (see module docstring)
TOKENS_PER_BLOCK = 512  # no scaling: the trace's own lengths
LRU_CAPACITIES_BLOCKS = (2000, 8000)  # 1M and 4M tokens


def _stable_bucket(value, buckets: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "big") % buckets


def assign_tenants_by_conversation(records: list[dict], tenants: int) -> list[dict]:
    """Each conversation (its first two hash ids) belongs to one of `tenants` tenants."""
    return [{**r, "tenant": f"t{_stable_bucket(tuple(r['hash_ids'][:2]), tenants)}"} for r in records]


def with_public_preamble(records: list[dict], blocks: int) -> list[dict]:
    """Prepend one preamble (the same ids for every tenant) to every prompt. The Mooncake parent
    rule still holds: the preamble's ids chain only to each other, and each system prompt's first id
    now always follows the preamble's last one."""
    base = max(i for r in records for i in r["hash_ids"]) + 1
    pre = list(range(base, base + blocks))
    return [
        {**r, "hash_ids": pre + r["hash_ids"], "input_length": r["input_length"] + blocks * SOURCE_BLOCK_TOKENS}
        for r in records
    ]


def hit_rate(records, salt_by_tenant: bool, warmup: int = 0) -> float:
    return record_bounds(records, TOKENS_PER_BLOCK, BLOCK, salt_by_tenant=salt_by_tenant, warmup=warmup)["infinite"][
        "hit_rate"
    ]


def lru_hit_rate(records, capacity_blocks: int, salt_by_tenant: bool, warmup: int = 0) -> float:
    """Token-weighted hit rate of one LRU cache of `capacity_blocks` blocks (vLLM's rules: longest
    cached prefix of full blocks, last prompt token always computed, every full block stored)."""
    cache: OrderedDict = OrderedDict()
    prompt = hit = 0
    for i, rec in enumerate(records):
        salt = rec.get("tenant") if salt_by_tenant else None
        lengths = [min(BLOCK, rec["input_length"] - j * BLOCK) for j in range(len(rec["hash_ids"]))]
        total = sum(lengths)
        keys = [(salt, h) for h, n in zip(rec["hash_ids"], lengths) if n == BLOCK]
        usable = (total - 1) // BLOCK
        n_hit = 0
        for key in keys[:usable]:
            if key not in cache:
                break
            n_hit += 1
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
        if i >= warmup:
            prompt, hit = prompt + total, hit + n_hit * BLOCK
    return hit / prompt if prompt else 0.0


def grouped(records: list[dict], size: int) -> list[dict]:
    """Tenants t0,t1 -> group g0, t2,t3 -> g1 ...: a group shares one salt (the config's `group`)."""
    return [{**r, "tenant": f"g{int(r['tenant'][1:]) // size}"} for r in records]


def mooncake_figures(tenant_counts=(1, 8, 64, 512)) -> list[dict]:
    recs = read_records("conversation")
    warmup = len(recs) // 2
    caches = [("infinite", None)] + [(f"lru_{c * BLOCK // 1_000_000}M_tokens", c) for c in LRU_CAPACITIES_BLOCKS]

    def rate(records, capacity, salt):
        if capacity is None:
            return hit_rate(records, salt, warmup)
        return lru_hit_rate(records, capacity, salt, warmup)

    shared = {name: rate(recs, cap, False) for name, cap in caches}
    rows = []
    for t in tenant_counts:
        tagged = assign_tenants_by_conversation(recs, t)
        for name, cap in caches:
            iso = rate(tagged, cap, True)
            rows.append(
                {
                    "tenants": t,
                    "cache": name,
                    "shared_salt": shared[name],
                    "isolated": iso,
                    "cost": shared[name] - iso,
                    # no hit at all with a shared salt: nothing measured to keep (None is a miss below)
                    "kept": iso / shared[name] if shared[name] else None,
                }
            )
    return rows


def saas_figures(tenants: int = 16, preamble_blocks: int = 4) -> dict:
    spec = ChatSpec(tenants=tenants, groups=2, users=4, turns=4, system_blocks=4, seed=1)
    plain = synth_chat(spec)
    saas = with_public_preamble(plain, preamble_blocks)
    return {
        "tenants": tenants,
        "preamble_blocks": preamble_blocks,
        "requests": len(saas),
        "no_common_text": {"shared_salt": hit_rate(plain, False), "isolated": hit_rate(plain, True)},
        "public_preamble": {
            "shared_salt": hit_rate(saas, False),
            "isolated": hit_rate(saas, True),
            "groups_of_2": hit_rate(grouped(saas, 2), True),
        },
    }


def plot(rows: list[dict], saas: dict, path: str) -> None:
    """Left: the share of the shared-salt hit rate that per-tenant salts keep on the Mooncake trace, by tenant
    count, one line per cache, with the 90% target; a count with nothing to keep (None) is left out. Right: the
    SaaS workload's hit rate per salting, without and with the public preamble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    counts = sorted({r["tenants"] for r in rows})  # evenly spaced: 1, 8, 64, 512
    for i, cache in enumerate(dict.fromkeys(r["cache"] for r in rows)):
        sub = [r for r in rows if r["cache"] == cache and r["kept"] is not None]
        ax.plot([counts.index(r["tenants"]) for r in sub], [r["kept"] for r in sub], "o-", color=f"C{i}", label=cache)
    ax.axhline(0.90, color="k", ls="--", lw=1, label="target (64 tenants, 4M-token LRU)")
    ax.set_xticks(range(len(counts)), [str(c) for c in counts])
    ax.set_xlabel("tenants (conversations spread over them)")
    ax.set_ylabel("isolated / shared-salt hit rate")
    ax.set_title("Mooncake conversation trace, second half")
    ax.legend(fontsize=7)
    ax = axes[1]
    arms = ("shared_salt", "isolated", "groups_of_2")
    workloads = ("no_common_text", "public_preamble")
    for j, arm in enumerate(arms):
        xs = [i + (j - 1) * 0.27 for i, w in enumerate(workloads) if arm in saas[w]]
        ys = [saas[w][arm] for w in workloads if arm in saas[w]]
        ax.bar(xs, ys, 0.27, color=f"C{j}", label=arm.replace("_", " "))
    ax.set_xticks(range(len(workloads)), ["no common text", f"public {saas['preamble_blocks']}-block preamble"])
    ax.set_ylabel("token hit rate (infinite cache)")
    ax.set_title(f"SaaS chat, {saas['tenants']} tenants")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    save_plot(fig, path)


def main() -> dict:
    rows = mooncake_figures()
    print("Mooncake conversation trace, second half, token-weighted hit rate (conversation -> tenant):")
    print(f"  {'tenants':>8} {'cache':>16} {'shared salt':>12} {'isolated':>10} {'cost (pp)':>10} {'kept':>7}")
    for r in rows:
        print(
            f"  {r['tenants']:>8} {r['cache']:>16} {r['shared_salt']:>12.4f} {r['isolated']:>10.4f} "
            f"{100 * r['cost']:>10.2f} {'n/a' if r['kept'] is None else format(r['kept'], '.3f'):>7}"
        )
    saas = saas_figures()
    nc, pp = saas["no_common_text"], saas["public_preamble"]
    print(f"SaaS chat ({saas['tenants']} tenants, {saas['requests']} requests), infinite cache:")
    print(
        f"  no common text:       shared salt {nc['shared_salt']:.4f}  isolated {nc['isolated']:.4f}  "
        f"cost {100 * (nc['shared_salt'] - nc['isolated']):.2f} pp"
    )
    print(
        f"  public {saas['preamble_blocks']}-block preamble: shared salt {pp['shared_salt']:.4f}  "
        f"isolated {pp['isolated']:.4f}  groups of 2 {pp['groups_of_2']:.4f}  "
        f"cost {100 * (pp['shared_salt'] - pp['isolated']):.2f} pp"
    )
    t64 = next(r for r in rows if r["tenants"] == 64 and r["cache"] == "lru_4M_tokens")
    checks = [
        ("salting costs 0 where tenants share no text", nc["shared_salt"] > 0 and nc["shared_salt"] == nc["isolated"]),
        (
            f"isolation keeps >= 90% of shared-salt hit rate (Mooncake, 64 tenants, 4M-token LRU): {t64['kept']}",
            t64["kept"] is not None and t64["kept"] >= 0.90,
        ),
        ("isolation never beats sharing (sanity)", all(r["isolated"] <= r["shared_salt"] + 1e-12 for r in rows)),
    ]
    targets = Targets()
    for name, ok in checks:
        print(f"  {targets.verdict(name, ok)}: {name}")
    result = {"mooncake": rows, "saas": saas}
    folder = Path(os.environ.get("BENCH_JSON_DIR") or out_dir("tenants"))  # BENCH_JSON_DIR: the old override
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_tenants.json").write_text(json.dumps(result, indent=1))
    plot(rows, saas, str(folder / "bench_tenants.png"))
    print(f"wrote {folder}/bench_tenants.json and bench_tenants.png")
    targets.exit_if_missed()
    return result


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)
