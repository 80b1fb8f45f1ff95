"""A second randomised workload family, with shapes the first one (`workload_family`) never draws.

Why: the first family was the set the policy was judged on while it was developed, so its shapes became
familiar even where its seeds did not: every conversation of a draw has the same number of turns, every
group the same number of users, every request belongs to a conversation or a flood, and the fleet has 2-8
replicas. Traffic does not look like that. This family draws from a seed:

- how popular each system prompt is (Zipf over groups, exponent 0-1.5: one prompt may carry most users);
- each conversation's own length (geometric around a drawn mean, 1-30 turns, cut where the context ends);
- a share of one-shot requests that share nothing with anything (0, 20% or 50% of the traffic);
- system prompts of different lengths within one draw, answers of 0.1-2 blocks;
- 2-16 replicas, 32 or 64 tokens per block, concurrency 1-32, and the first family's arrival patterns.

Draws keep between 4 requests per replica and `MAX_REQUESTS` requests, every prompt plus answer within
`CONTEXT_TOKENS`. Records are in the repository's Mooncake form, as `workload_family.records` makes them;
a draw offers the interface `cluster/sweep.py` runs (`seed`, `replicas`, `arrival`, `concurrency`,
`tokens_per_block`, `load`, `records()`, `describe()`, `to_dict()`).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from kvmesh.cluster.workload_family import (
    ARRIVALS,
    BURST_GAP_MS,
    CONTEXT_TOKENS,
    SESSION_GAP_MS,
    THINK_MS,
    prompt_record,
)
from kvmesh.cluster.workloads import SOURCE_BLOCK_TOKENS, FreshIds

MAX_REQUESTS = 400
MIN_REQUESTS_PER_REPLICA = 4
MAX_TURNS = 30
ONESHOT_SHARES = (0.0, 0.0, 0.2, 0.5)


@dataclass(frozen=True)
class WideDraw:
    """The shape drawn from one seed. Sizes in source blocks (512 tokens before scaling)."""

    seed: int
    groups: int  # system prompts, 1-12
    tenants: int  # 1..groups; group g belongs to tenant g % tenants (tenants share nothing)
    popularity: float  # Zipf exponent over groups: a conversation picks group g with weight 1 / (g + 1) ** it
    conversations: int  # 6-60
    # sets a conversation's turns: 1 + floor(X), X exponential with mean `mean_turns` - 1, at most MAX_TURNS (a
    # mean of about `mean_turns` - 0.5, not `mean_turns`: `expected_turns`)
    mean_turns: float
    system_blocks: tuple[int, int]  # each group's system prompt: min, max blocks
    oneshot_share: float  # share of the requests that are one-shot prompts sharing nothing
    arrival: str  # "all" (at once under `concurrency`), "poisson", "bursts"
    bursts: int  # conversation bursts for "bursts" (else 0)
    concurrency: int  # 1-32 requests in flight for "all"
    tokens_per_block: int  # 32 or 64 tokens per source block when expanded
    replicas: int  # 2-16, for the simulator
    load: float  # offered prefill load the timed patterns are scaled to in the simulator
    requests: int  # how many records `records()` makes

    def records(self) -> list[dict]:
        return records(self)

    @property
    def expected_turns(self) -> float:
        """The mean of a conversation's drawn turns, min(1 + floor(X), MAX_TURNS) with X exponential at rate
        l = 1 / (`mean_turns` - 1): P(floor(X) >= j) = exp(-l j), so the mean is the sum of exp(-l j) over
        j < MAX_TURNS. A conversation cut short to fit the context (`_fits`) has fewer."""
        if self.mean_turns <= 1.0:
            return 1.0
        q = math.exp(-1.0 / (self.mean_turns - 1.0))
        return (1.0 - q**MAX_TURNS) / (1.0 - q)

    def describe(self) -> str:
        """One line naming the shape (for reports); the turns are `expected_turns`."""
        arrival = f"bursts{self.bursts}" if self.arrival == "bursts" else self.arrival
        if self.arrival == "all":
            arrival += f"@c{self.concurrency}"
        return (
            f"{self.groups}g/{self.tenants}t zipf{self.popularity:.2f} {self.conversations}conv"
            f" ~{self.expected_turns:.1f}turns sys{self.system_blocks[0]}-{self.system_blocks[1]}"
            f" oneshot{self.oneshot_share:.0%} {arrival} tpb{self.tokens_per_block} N={self.replicas} n={self.requests}"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def draw(seed: int) -> WideDraw:
    """The shape for `seed`: redrawn from the same generator until its records fit the limits, so the result
    is a deterministic function of the seed."""
    rng = random.Random(seed)
    for _ in range(10_000):
        d = _draw_once(seed, rng)
        n = len(records(d))
        if MIN_REQUESTS_PER_REPLICA * d.replicas <= n <= MAX_REQUESTS:
            return WideDraw(**{**asdict(d), "requests": n})
    raise RuntimeError(f"no workload shape within the limits for seed {seed}")  # not reached in practice


def _draw_once(seed: int, rng: random.Random) -> WideDraw:
    groups = rng.randint(1, 12)
    sys_lo = rng.randint(0, 12)
    arrival = rng.choice(ARRIVALS)
    return WideDraw(
        seed=seed,
        groups=groups,
        tenants=rng.randint(1, groups),
        popularity=round(rng.uniform(0.0, 1.5), 2),
        conversations=rng.randint(6, 60),
        mean_turns=round(rng.uniform(1.5, 8.0), 1),
        system_blocks=(sys_lo, sys_lo + rng.randint(0, 6)),
        oneshot_share=rng.choice(ONESHOT_SHARES),
        arrival=arrival,
        bursts=rng.randint(2, 5) if arrival == "bursts" else 0,
        concurrency=rng.randint(1, 32),
        tokens_per_block=rng.choice((32, 64)),
        replicas=rng.randint(2, 16),
        load=round(rng.uniform(0.3, 0.9), 2),
        requests=0,
    )


def _fits(prompt_blocks: int, answer_tokens: int, tokens_per_block: int) -> bool:
    answer_blocks = math.ceil(answer_tokens / SOURCE_BLOCK_TOKENS)
    return (prompt_blocks + answer_blocks) * tokens_per_block <= CONTEXT_TOKENS


def _conversations(d: WideDraw, rng: random.Random, ids: FreshIds) -> list[list[dict]]:
    """Every conversation's turns in order, then the one-shot requests (each its own list)."""
    systems = [ids.take(rng.randint(*d.system_blocks)) for _ in range(d.groups)]
    weights = [1.0 / (g + 1) ** d.popularity for g in range(d.groups)]
    out = []
    for c in range(d.conversations):
        g = rng.choices(range(d.groups), weights)[0]
        tenant = f"t{g % d.tenants}"
        # 1 + floor of an exponential with mean `mean_turns` - 1: a mean of `expected_turns`, below `mean_turns`
        turns = 1 + (int(rng.expovariate(1.0 / (d.mean_turns - 1.0))) if d.mean_turns > 1.0 else 0)
        history, conv = list(systems[g]), []
        for _ in range(min(turns, MAX_TURNS)):
            prompt = history + ids.take(rng.randint(1, 3))
            answer = max(1, round(rng.uniform(0.1, 2.0) * SOURCE_BLOCK_TOKENS))
            if not _fits(len(prompt), answer, d.tokens_per_block):
                break
            tail = rng.randint(SOURCE_BLOCK_TOKENS // 8, SOURCE_BLOCK_TOKENS)
            conv.append(prompt_record(prompt, tail, answer, tenant, f"{tenant}-g{g}-c{c}"))
            history = prompt + ids.take(math.ceil(answer / SOURCE_BLOCK_TOKENS))
        if conv:
            out.append(conv)
    chat = sum(len(c) for c in out)
    share = d.oneshot_share  # below 1 (ONESHOT_SHARES)
    oneshots = round(chat * share / (1.0 - share))
    for k in range(oneshots):
        tenant = f"t{k % d.tenants}"
        prompt = ids.take(rng.randint(1, 6))
        tail = rng.randint(SOURCE_BLOCK_TOKENS // 8, SOURCE_BLOCK_TOKENS)
        out.append([prompt_record(prompt, tail, SOURCE_BLOCK_TOKENS // 2, tenant, f"one-{k}")])
    return out


def records(d: WideDraw) -> list[dict]:
    """The requests of draw `d`, deterministic in it, in send order: for "all", every conversation's turn 1
    (one-shots among them), then turn 2, ... (shuffled within a turn); for "poisson" and "bursts" the first
    family's timing (conversations starting `SESSION_GAP_MS` apart on average, or in bursts `BURST_GAP_MS`
    apart, turns `THINK_MS` x 0.5-1.5 apart), sorted by timestamp."""
    rng = random.Random(d.seed * 1_000_003 + 29)
    convs = _conversations(d, rng, FreshIds())
    rng.shuffle(convs)
    if d.arrival == "all":
        sent: list[dict] = []
        k = 0
        while True:
            wave = [c[k] for c in convs if len(c) > k]
            if not wave:
                return sent
            rng.shuffle(wave)
            sent.extend(wave)
            k += 1
    timed: list[dict] = []
    t = 0.0
    for conv in convs:
        if d.arrival == "poisson":
            t += rng.expovariate(1.0 / SESSION_GAP_MS)
            start = t
        else:
            start = rng.randrange(d.bursts) * BURST_GAP_MS + rng.uniform(0, 200)
        clock = start
        for rec in conv:
            timed.append(dict(rec, timestamp=int(clock)))
            clock += THINK_MS * rng.uniform(0.5, 1.5)
    order = sorted(range(len(timed)), key=lambda i: (timed[i]["timestamp"], i))
    return [timed[i] for i in order]
