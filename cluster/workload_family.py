"""Randomised workload families: one seed -> one workload shape -> Mooncake records.

Why: a placement policy tuned on a handful of traces can overfit them. A family draws the shape
(how many groups and users share a system prompt, how long conversations run, shared RAG documents,
a hot-prompt flood, the arrival pattern, the fleet size) from a seed, so a policy can be tuned on one
seed set and judged on another it never saw (`benchmarks/robust_seeds.json`).

Records are in the repository's Mooncake form (`cluster/workloads.py`): `timestamp` (ms),
`input_length`, `output_length`, `hash_ids` (one id per 512-token source block, an id always follows
the same parent; the last block partial), plus `tenant` and `user`. A conversation's turn k+1 prompt is
its system prompt, its document (if it pulled one), every earlier question and answer, and a new
question. Answers may be a fraction of a block: `output_length` is the answer's tokens, and the next
turn carries the answer as whole blocks (as a partial question block is carried as a full one).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from kvmesh.cluster.workloads import SOURCE_BLOCK_TOKENS, FreshIds, scaled_block_lengths, scaled_output_length

CONTEXT_TOKENS = 4096  # prompt + answer must fit this after scaling (the live tiny model's context)
MIN_REQUESTS, MAX_REQUESTS = 20, 200
ARRIVALS = ("all", "poisson", "bursts")
SESSION_GAP_MS = 1_000  # mean gap between conversation starts (poisson)
THINK_MS = 4_000  # mean pause between a user's turns (timed patterns)
BURST_GAP_MS = 30_000  # between bursts
FLOOD_INTERVAL_MS = 20  # between flood requests (timed patterns)


@dataclass(frozen=True)
class FamilyDraw:
    """The shape drawn from one seed. Sizes in source blocks (512 tokens before scaling)."""

    seed: int
    groups: int  # system prompts, 1-6
    tenants: int  # 1..groups; group g belongs to tenant g % tenants (tenants share nothing)
    users_per_group: int  # 1-8 conversations per group
    turns: int  # 1-8 per conversation
    system_blocks: int  # 0-10 (0: conversations share nothing but a document)
    question_blocks: tuple[int, int]  # min, max blocks of a new question (last one partial)
    answer_blocks: tuple[float, float]  # min, max answer size in blocks (fractional)
    rag_docs: int  # shared documents per group; 0 = no RAG
    rag_doc_blocks: int  # blocks per document
    rag_share: float  # chance that a conversation pulls one document (placed after the system prompt)
    flood_requests: int  # single-turn requests on one hot prompt; 0 = no flood
    flood_prompt_blocks: int  # the hot prompt's blocks
    flood_unique_blocks: int  # each flood request's own blocks after it
    flood_at: float  # where the flood starts, as a fraction of the run
    arrival: str  # "all" (all at once under `concurrency`), "poisson", "bursts"
    bursts: int  # conversation bursts for "bursts" (else 0)
    concurrency: int  # 1-16 requests in flight for "all"
    tokens_per_block: int  # 32 or 64 tokens per source block when expanded
    replicas: int  # 2-8, for the simulator
    live_replicas: int  # 3-4, for live runs
    load: float  # offered prefill load (no reuse) the timed patterns are scaled to in the simulator

    @property
    def conversations(self) -> int:
        return self.groups * self.users_per_group

    @property
    def requests(self) -> int:
        return self.conversations * self.turns + self.flood_requests

    def longest_blocks(self) -> int:
        """Source blocks of the longest prompt plus its answer, an upper bound over the records."""
        answer = math.ceil(self.answer_blocks[1])
        doc = self.rag_doc_blocks if self.rag_docs else 0
        chat = self.system_blocks + doc + self.turns * self.question_blocks[1] + self.turns * answer
        flood = self.flood_prompt_blocks + self.flood_unique_blocks + 1 if self.flood_requests else 0
        return max(chat, flood)

    def records(self) -> list[dict]:
        return records(self)

    def describe(self) -> str:
        """One line naming the shape (for reports)."""
        parts = [
            f"{self.groups}g/{self.tenants}t x {self.users_per_group}u x {self.turns}turns",
            f"sys{self.system_blocks}",
            f"q{self.question_blocks[0]}-{self.question_blocks[1]}",
            f"a{self.answer_blocks[0]:.2f}-{self.answer_blocks[1]:.2f}",
        ]
        if self.rag_docs:
            parts.append(f"rag{self.rag_docs}x{self.rag_doc_blocks}@{self.rag_share:.2f}")
        if self.flood_requests:
            parts.append(f"flood{self.flood_requests}x{self.flood_prompt_blocks}+{self.flood_unique_blocks}")
        arrival = f"bursts{self.bursts}" if self.arrival == "bursts" else self.arrival
        if self.arrival == "all":
            arrival += f"@c{self.concurrency}"
        parts += [arrival, f"tpb{self.tokens_per_block}", f"N={self.replicas}", f"n={self.requests}"]
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


def draw(seed: int) -> FamilyDraw:
    """The shape for `seed`. Shapes outside the size limits (20-200 requests, every prompt plus answer
    within `CONTEXT_TOKENS` at the drawn tokens per block) are redrawn from the same generator, so the
    result is a deterministic function of the seed."""
    rng = random.Random(seed)
    for _ in range(10_000):
        d = _draw_once(seed, rng)
        if MIN_REQUESTS <= d.requests <= MAX_REQUESTS and d.longest_blocks() * d.tokens_per_block <= CONTEXT_TOKENS:
            return d
    raise RuntimeError(f"no workload shape within the limits for seed {seed}")  # not reached in practice


def _draw_once(seed: int, rng: random.Random) -> FamilyDraw:
    groups = rng.randint(1, 6)
    q_lo = rng.randint(1, 3)
    a_lo = round(rng.uniform(0.1, 1.5), 2)
    rag = rng.random() < 0.35
    flood = rng.random() < 0.3
    arrival = rng.choice(ARRIVALS)
    return FamilyDraw(
        seed=seed,
        groups=groups,
        tenants=rng.randint(1, groups),
        users_per_group=rng.randint(1, 8),
        turns=rng.randint(1, 8),
        system_blocks=rng.randint(0, 10),
        question_blocks=(q_lo, rng.randint(q_lo, q_lo + 2)),
        answer_blocks=(a_lo, round(a_lo + rng.uniform(0.0, 1.0), 2)),
        rag_docs=rng.randint(2, 6) if rag else 0,
        rag_doc_blocks=rng.randint(2, 8) if rag else 0,
        rag_share=round(rng.uniform(0.3, 1.0), 2) if rag else 0.0,
        flood_requests=rng.randint(8, 48) if flood else 0,
        flood_prompt_blocks=rng.randint(2, 10) if flood else 0,
        flood_unique_blocks=rng.randint(1, 2) if flood else 0,
        flood_at=round(rng.random(), 2) if flood else 0.0,
        arrival=arrival,
        bursts=rng.randint(2, 4) if arrival == "bursts" else 0,
        concurrency=rng.randint(1, 16),
        tokens_per_block=rng.choice((32, 64)),
        replicas=rng.randint(2, 8),
        live_replicas=rng.randint(3, 4),
        load=round(rng.uniform(0.3, 0.9), 2),
    )


def prompt_record(prompt: list[int], tail: int, output: int, tenant: str, user: str) -> dict:
    """One request in the repository's Mooncake form (timestamp set later), its last block `tail` tokens."""
    return {
        "timestamp": 0,
        "input_length": (len(prompt) - 1) * SOURCE_BLOCK_TOKENS + tail,
        "output_length": output,
        "hash_ids": prompt,
        "tenant": tenant,
        "user": user,
    }


def _conversations(d: FamilyDraw, rng: random.Random, ids: FreshIds) -> list[list[dict]]:
    """Every conversation's turns, in turn order (timestamps not yet set)."""
    out = []
    for g in range(d.groups):
        tenant = f"t{g % d.tenants}"
        system = ids.take(d.system_blocks)
        docs = [ids.take(d.rag_doc_blocks) for _ in range(d.rag_docs)]
        for u in range(d.users_per_group):
            user = f"{tenant}-g{g}-u{u}"
            doc = rng.choice(docs) if docs and rng.random() < d.rag_share else []
            history = system + doc
            turns = []
            for _ in range(d.turns):
                prompt = history + ids.take(rng.randint(*d.question_blocks))
                tail = rng.randint(SOURCE_BLOCK_TOKENS // 8, SOURCE_BLOCK_TOKENS)
                answer = max(1, round(rng.uniform(*d.answer_blocks) * SOURCE_BLOCK_TOKENS))
                turns.append(prompt_record(prompt, tail, answer, tenant, user))
                history = prompt + ids.take(math.ceil(answer / SOURCE_BLOCK_TOKENS))
            out.append(turns)
    return out


def _flood(d: FamilyDraw, rng: random.Random, ids: FreshIds) -> list[dict]:
    hot = ids.take(d.flood_prompt_blocks)
    return [
        prompt_record(
            hot + ids.take(d.flood_unique_blocks),
            rng.randint(SOURCE_BLOCK_TOKENS // 8, SOURCE_BLOCK_TOKENS),
            SOURCE_BLOCK_TOKENS // 2,
            "t0",
            f"t0-flood-{i}",
        )
        for i in range(d.flood_requests)
    ]


def records(d: FamilyDraw) -> list[dict]:
    """The requests of draw `d`, deterministic in it, in send order.

    "all": every timestamp is 0 and the order is the order to send in under `concurrency` (turn 1 of
    every conversation, then turn 2, ...; users shuffled within a turn; the flood as one block at
    `flood_at`). "poisson": conversations start at Poisson times, turns `THINK_MS` (x 0.5-1.5) apart,
    the flood `FLOOD_INTERVAL_MS` apart from `flood_at` of the span. "bursts": conversations start
    together in `bursts` bursts `BURST_GAP_MS` apart, the flood with one of them. Timed records are
    sorted by timestamp (a user's turns stay in order)."""
    rng = random.Random(d.seed * 1_000_003 + 17)
    ids = FreshIds()
    convs = _conversations(d, rng, ids)
    flood = _flood(d, rng, ids)
    if d.arrival == "all":
        sent = []
        for k in range(d.turns):
            wave = [c[k] for c in convs]
            rng.shuffle(wave)
            sent.extend(wave)
        at = round(d.flood_at * len(sent))
        return sent[:at] + flood + sent[at:]
    if d.arrival == "poisson":
        starts, t = [], 0.0
        for _ in convs:
            starts.append(t)
            t += rng.expovariate(1.0 / SESSION_GAP_MS)
        flood_start = d.flood_at * (t + d.turns * THINK_MS)
    else:
        burst_of = [rng.randrange(d.bursts) for _ in convs]
        starts = [b * BURST_GAP_MS + rng.uniform(0, 200) for b in burst_of]
        flood_start = rng.randrange(d.bursts) * BURST_GAP_MS + rng.uniform(0, 200)
    timed = []
    for start, conv in zip(starts, convs):
        clock = start
        for rec in conv:
            timed.append(dict(rec, timestamp=int(clock)))
            clock += THINK_MS * rng.uniform(0.5, 1.5)
    timed += [dict(rec, timestamp=int(flood_start + i * FLOOD_INTERVAL_MS)) for i, rec in enumerate(flood)]
    order = sorted(range(len(timed)), key=lambda i: (timed[i]["timestamp"], i))
    return [timed[i] for i in order]


def prompt_and_answer_tokens(rec: dict, tokens_per_block: int) -> int:
    """A record's prompt plus answer tokens once expanded at `tokens_per_block` (as the replay client does)."""
    return sum(scaled_block_lengths(rec, tokens_per_block)) + scaled_output_length(rec, tokens_per_block)
