"""kvmesh's placement: the replica with the lowest predicted time to first token, inside a balance guard.

Predicted TTFT on replica r (all terms from `kvmesh.policies.cost_model.CostModel`, the simulator's model):

    wait_r    = pending_prefill_tokens_r * prefill_s_per_token + queued_r * prefill_base_s
                (+ a slot wait when queued + running already fill max_batch)
    prefill_r = prefill_base_s + (n - shared_r) * prefill_s_per_token
                + (shared_r - host_r) * shared_load_s_per_token + (host_r - hbm_r) * host_load_s_per_token
                + (n^2 - shared_r^2) / 2 * attention_s_per_token_pair

where hbm_r <= host_r <= shared_r are the request's cached prompt tokens per tier on r (from the
prefix index). Tier credits fall out of the formula: a token in host DRAM costs 1/20 of recomputing
it, in the shared tier 1/4, so a replica on the node holding a spilled prefix beats a cold one.

Why the guard: minimising each request's own TTFT is greedy. When queues are empty (low load) every
replica predicts the same wait, and affinity alone would keep growing the replicas that happen to
own popular prefixes; a hot system prompt would pull every new conversation onto one replica. The
guard tracks the prefill work this policy has sent to each replica (tokens it predicted would be
computed, halved whenever the fleet total passes `window_tokens_per_replica * N`, so it follows the
recent mix and a new replica starts at the mean). The work a replica has above
`(1 + balance_slack) * mean` is charged like prompt tokens to recompute, at
`guard_weight` (30, the same as `recompute_weight`): a conversation leaves its history's replica only
when that replica is further over the bound than the history it would recompute elsewhere, so a few
long conversations cannot trade hit rate for balance they do not buy (live, 4 workers, Mooncake
slice: a hard guard moved 4 conversations, 0.97 of the bound; soft, 0.99 at max/mean 1.14).
`guard_weight=None` is the hard guard: every replica within the bound (plus one request's tokens)
ranks first. Ties (for example all replicas hold only the shared system prompt) go to the replica with
the least recent work, which is what spreads a shared prompt over the fleet; replicas tied on that too
(nothing sent there yet) are drawn by the prompt's hash, so routers that start together do not all
send their first requests to the first replica.

Why an overshoot charge beside the guard: the guard charges only work already sent, so a replica just
within its bound takes a whole request at no charge and may end far past it (simulated with the shared
tier, eval draw 2034: a conversation's last turn took its replica from 1.10 to 1.29 x the mean while a
third replica had half the mean). The part of the request's own prefill that would carry a replica past
`overshoot_cap` (1.25) x the mean is charged at `overshoot_weight` (3) per token, a tenth of the guard's
weight: enough to move a request whose history another replica can load (a shared tier) or that is
small beside the overshoot, too little to move conversations that would recompute their history. The
cap is the fleet's imbalance target; 3 was chosen on the tune draws (1, 3, 10, 30 at caps 1.1-1.3) as
the weight that met the target on 48/50 while keeping p50 TTFT at or below round robin's on the most
draws.

Why a second, short window (hot-prefix spread): the guard's memory is long (the simulator's hit rate
needs it), so it balances totals since start-up. At low load, after a change of workload, it keeps
"paying back" old imbalance: live, a flood of requests sharing one system prompt that followed other
work went 48/0 to the replica with less past work. So the policy also keeps the same work decayed per
request (`half_life_requests` per replica) and, only for a request whose longest cached prefix ends at
a fork (a block `hot_fanout` distinct continuations have followed: a shared prompt, not one
conversation's own history), adds `spread_weight * excess * prefill_s_per_token` to the score, where
excess = recent work above `(1 + balance_slack) * mean`. With spread_weight = recompute_weight + 1 a
hot prefix is replicated onto another replica once the excess exceeds the tokens recomputing it there
costs; multi-turn users never see the term, so they stay where their history is. For such a request the
part of the shared prefix a replica lacks also weighs `hot_recompute_weight` (10) instead of
`recompute_weight` (30): it is paid once per replica and then serves every later request from the
fork, so a flood spreads over the whole fleet instead of stopping at the replicas that already hold
it (0 would replicate hot prefixes too eagerly for a capacity-bound fleet: simulated Mooncake
synthetic trace, 4 x 4000 blocks, 0.515 vs 0.542 hit rate). The discount holds only while fewer
replicas hold the fork than its traffic fills: its share of recent requests (decayed like the short
window) x the fleet x (1 + balance_slack). A flood (all the traffic) is copied everywhere; one of seven
groups' system prompts is not copied past the replica or two its conversations fill, since copying
every group's prompt everywhere makes each replica compute all of them (simulated, 256 replicas, 4 and
16 routers 100 ms apart, Mooncake synthetic trace, 5 seeds: 0.975 -> 0.982 and 0.963 -> 0.969 of one
router's hit rate).

Why a stale view is placed at random (several routers): ingress replicas share their placements with
a lag, so they rank on the same view, one lag old. Ranked deterministically, every router's new prefix
of that lag goes to the one replica the view ranks first (16 routers, 100 ms: half the single router's
hit rate). Given how many free placements (not bound to a history) it has not heard of yet
(`FleetView.unseen_placements`), the policy draws the replica from the mix under which those
placements, placed by the same rule, leave every replica it may pick equally good (`_unseen_pick`). A
request with a prefix one replica holds still goes there. With nothing unseen (one router, or no lag)
placement is the deterministic best.

Why a request may wait for a prefix being computed elsewhere (`hold_worth`, with a shared tier): LMCache
stores a prefix in the shared tier when its prefill ends. Requests sharing a new prompt that arrive before
then (a group's members, a flood) and are placed on other replicas for balance compute it again, each on
its own replica; placed on the replica computing it, they pile up there. Held until the store and then
sent to their replica, they load it instead: the wait is at most the rest of that one prefill. The hold
is weighed while ranking, on every replica the caller says could load the prefix once it is stored
(`FleetView.inflight_blocks`): each is scored as it is and as held, whichever is lower. Simulated with the
shared tier on the robustness draws, kvmesh meets the target on 100 of 100 eval draws and 46 of 50 tune
draws, against 76 and 41 without holding, at the same p50 TTFT; the price is in the tail (p90 TTFT over
1.1 x round robin's on 32 eval draws against 21; docs/policies.md).

The same object runs in the live router (deployments/) and in the simulator (cluster/simulator.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from itertools import chain, islice

import numpy as np

from kvmesh.policies.base import FleetView, Policy, ReplicaView, RequestInfo, two_longest
from kvmesh.policies.cost_model import DEFAULT_COST_MODEL, MAX_WEIGHT, CostModel, check_flag, check_param
from kvmesh.policies.score_kernel import SCORE_ROUNDING, lowest, replica_scores, warm_up

_NONE = object()
_NO_ARRAY = np.zeros(0)  # for a term that is off: the kernel never reads it


def _credit_key(request: RequestInfo, replica_id: str) -> tuple:
    return (request.request_id or id(request), replica_id)


class KvmeshPolicy(Policy):
    name = "kvmesh"
    uses_index = True

    def __init__(
        self,
        seed: int = 0,
        cost: CostModel | dict | None = None,
        balance_slack: float = 0.10,
        window_tokens_per_replica: int = 20_000_000,
        mean_output_tokens: int = 256,
        recompute_weight: float = 30.0,
        spread_weight: float = 31.0,
        half_life_requests: float = 8.0,
        hot_fanout: int = 8,
        hot_recompute_weight: float = 10.0,
        guard_weight: float | None = 30.0,
        overshoot_cap: float = 1.25,
        overshoot_weight: float = 3.0,
        hold_for_tier: bool = True,
        **params,
    ):
        super().__init__(
            seed,
            balance_slack=balance_slack,
            window_tokens_per_replica=window_tokens_per_replica,
            mean_output_tokens=mean_output_tokens,
            recompute_weight=recompute_weight,
            spread_weight=spread_weight,
            half_life_requests=half_life_requests,
            hot_fanout=hot_fanout,
            hot_recompute_weight=hot_recompute_weight,
            guard_weight=guard_weight,
            overshoot_cap=overshoot_cap,
            overshoot_weight=overshoot_weight,
            hold_for_tier=hold_for_tier,
            **params,
        )
        check_param("kvmesh", "balance_slack", balance_slack)
        check_param("kvmesh", "window_tokens_per_replica", window_tokens_per_replica, above=True)
        check_param("kvmesh", "mean_output_tokens", mean_output_tokens)
        check_param("kvmesh", "half_life_requests", half_life_requests, above=True)
        check_param("kvmesh", "hot_fanout", hot_fanout, 2, whole=True)
        check_param("kvmesh", "overshoot_cap", overshoot_cap, 1)
        weights = {
            "recompute_weight": recompute_weight,
            "spread_weight": spread_weight,
            "hot_recompute_weight": hot_recompute_weight,
            "overshoot_weight": overshoot_weight,
            "guard_weight": guard_weight,
        }
        for name, weight in weights.items():
            if weight is not None or name != "guard_weight":  # guard_weight None: the hard guard
                check_param("kvmesh", name, weight, high=MAX_WEIGHT)
        check_flag("kvmesh", "hold_for_tier", hold_for_tier)
        if cost is not None and not isinstance(cost, (CostModel, Mapping)):
            raise ValueError(
                f"kvmesh: cost must be a mapping of cost model constants ({', '.join(CostModel.__match_args__)}), "
                f"got {type(cost).__name__}"
            )
        self.hot_fanout = hot_fanout
        self.hot_recompute_weight = hot_recompute_weight
        self.guard_weight = guard_weight
        self.overshoot_cap = overshoot_cap
        self.overshoot_weight = overshoot_weight
        self.hold_for_tier = hold_for_tier
        warm_up()  # the score's compiled kernels, before the first request rather than during it
        # block hash -> its continuations seen so far: one (bare), several (a set), or True once
        # hot_fanout distinct ones were seen (a fork: a shared prompt many requests branch from)
        self._fanout: OrderedDict = OrderedDict()
        self.fanout_memory = 1_000_000
        self._ends = 0
        self.spread_weight = spread_weight
        self.half_life_requests = half_life_requests
        if cost is None or isinstance(cost, CostModel):
            self.cost = cost or DEFAULT_COST_MODEL
        else:
            self.cost = CostModel.from_dict(cost)
        self.balance_slack = balance_slack
        self.window_tokens_per_replica = window_tokens_per_replica
        self.mean_output_tokens = mean_output_tokens
        self.recompute_weight = recompute_weight
        # recent predicted prefill work per replica, one array slot per live replica; a removed replica's
        # slot is reused by the next one added, so autoscaling churn never grows the arrays
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._w: np.ndarray = np.zeros(0)
        self._total = 0.0
        self._s: np.ndarray = np.zeros(0)  # the same work, decayed per request (half-life in requests per replica)
        # `_w` and `_s` are views of the slots in use on buffers grown by doubling (`_grow`)
        self._w_buf: np.ndarray = self._w
        self._s_buf: np.ndarray = self._s
        self._s_total = 0.0
        # a cache, not state: the slots of the last candidate list whose replicas are all known
        self._ids_key: tuple = ()
        self._ids_idx: np.ndarray | None = np.zeros(0, dtype=np.int64)  # None: every slot, in order
        # (request id, replica) -> (the request where it has no id, else None; work): what `on_unrouted` takes
        # back. Keyed by id, not by the object: a withdrawal may come after thousands of other commits (the
        # live router keeps up to 10,000 requests unsettled), and objects would hold every prompt's hashes.
        self._credited: OrderedDict[tuple, tuple] = OrderedDict()
        # recent requests per fork (decayed per routed request), each stored divided by _fork_k
        self._fork_count: dict = {}
        self._fork_k = 1.0
        self._fork_total = 0.0
        self._fork_prune_at = 4096
        self._withdrawn_ids: OrderedDict[str, None] = OrderedDict()  # requests withdrawn once: aged already

    # ------------------------------------------------------------------ scoring
    # the scores of the last `place` or `best` call, per replica of its fleet (lower ranks first): for decision
    # traces, which show how close the choice was
    last_scores: np.ndarray | None = None

    def on_replica_added(self, replica_id: str) -> None:
        """A new replica starts at the fleet's current mean work, so the guard neither floods it nor
        holds it back."""
        if replica_id in self._slot:
            return
        live = len(self._slot)
        mean = self._total / live if live else 0.0
        s_mean = self._s_total / live if live else 0.0
        if self._free:
            slot = self._free.pop()
            self._w[slot], self._s[slot] = mean, s_mean
        else:
            slot = len(self._w)
            self._grow(slot + 1)
            self._w[slot], self._s[slot] = mean, s_mean
        self._slot[replica_id] = slot
        self._total += mean
        self._s_total += s_mean
        self._ids_key = ()

    def _grow(self, n: int) -> None:
        """Make room for `n` slots: the buffers double when full, so a fleet added a replica at a time costs
        linear time (one copy per slot added, as `np.append` was, is quadratic: 100,000 replicas took 8 s).
        A copied policy (`copy.deepcopy`: the simulator's fresh policies) holds arrays of its own, no longer
        views of the buffers: they are copied into new ones."""
        if n > len(self._w_buf) or self._w.base is not self._w_buf or self._s.base is not self._s_buf:
            used = len(self._w)
            cap = max(8, 2 * len(self._w), n)
            w_buf, s_buf = np.zeros(cap), np.zeros(cap)
            w_buf[:used], s_buf[:used] = self._w, self._s
            self._w_buf, self._s_buf = w_buf, s_buf
        self._w, self._s = self._w_buf[:n], self._s_buf[:n]

    def _work(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, float, float, int]:
        """(work, short-window work) per candidate, and the fleet's totals and size, with candidates
        not yet added counted at the mean as `on_replica_added` would. Pure (the slot list is cached)."""
        key = tuple(ids)
        if key == self._ids_key:
            idx = self._ids_idx
            if idx is None:  # candidates are the slots in order: the arrays themselves, read only
                return self._w, self._s, self._total, self._s_total, len(self._slot)
            return self._w[idx], self._s[idx], self._total, self._s_total, len(self._slot)
        slots = [self._slot.get(r) for r in key]
        live = len(self._slot)
        mean = self._total / live if live else 0.0
        s_mean = self._s_total / live if live else 0.0
        new = sum(1 for k in slots if k is None)
        if not new:
            idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
            self._ids_key, self._ids_idx = key, None if slots == list(range(len(self._w))) else idx
            return self._w[idx], self._s[idx], self._total, self._s_total, live
        w = np.array([self._w[k] if k is not None else mean for k in slots])
        sw = np.array([self._s[k] if k is not None else s_mean for k in slots])
        return w, sw, self._total + new * mean, self._s_total + new * s_mean, live + new

    def _predict(self, request: RequestInfo, hbm_b, host_b, shared_b, queued, running, pending, ready_s=0.0):
        """Arrays (predicted TTFT in s, prompt tokens that would be computed, the wait before its
        prefill starts) per replica; `ready_s`, when given, is the earliest the prefill may start (a
        request held for a prefix being stored). Pure."""
        _, uncached, wait, ttft = self._evaluate(request, hbm_b, host_b, shared_b, queued, running, pending, ready_s)
        return ttft, uncached, wait

    def _evaluate(
        self,
        request: RequestInfo,
        hbm_b,
        host_b,
        shared_b,
        queued,
        running,
        pending,
        ready_s=0.0,
        hot: int = 0,
        hot_discount: float = -1.0,
        recent=None,
        recent_bound: float = 0.0,
        d: float = 1.0,
        work=None,
        bound: float = 0.0,
        cap: float = 0.0,
    ):
        """`replica_scores` for these replicas: (score, uncached, wait, ttft) arrays. Without `work` the
        guard's and overshoot's terms are off; without `recent` the short window's; `hot` 0: no fork.
        A tier passed as the same array object as the one above it (a fleet without host or shared tier)
        adds no term, as a tier equal to it adds 0."""
        c = self.cost
        guard = work is not None and self.guard_weight is not None
        spread = recent is not None
        return replica_scores(
            shared_b,
            host_b,
            hbm_b,
            host_b is not shared_b,
            hbm_b is not host_b,
            queued,
            running,
            pending,
            int(request.num_tokens),
            int(request.block_size),
            float(c.prefill_s_per_token),
            float(c.prefill_base_s),
            float(c.shared_load_s_per_token),
            float(c.host_load_s_per_token),
            float(c.attention_s_per_token_pair),
            int(c.max_batch),
            float(self.mean_output_tokens * c.decode_s_per_token / c.max_batch),
            float(ready_s),
            float(self.recompute_weight),
            int(hot),
            float(hot_discount),
            spread,
            float(self.spread_weight),
            recent if spread else _NO_ARRAY,
            float(recent_bound),
            float(d),
            guard,
            float(self.guard_weight or 0.0),
            float(bound),
            work if work is not None else _NO_ARRAY,
            float(self.overshoot_weight),
            float(cap),
            SCORE_ROUNDING,
        )

    def _uncached(self, request: RequestInfo, shared_blocks: int) -> int:
        """Prompt tokens that would be computed on a replica holding `shared_blocks` (`_predict`'s
        second value, for one replica, without arrays)."""
        most = max(0, (request.num_tokens - 1) // request.block_size)
        return request.num_tokens - min(shared_blocks, most) * request.block_size

    def _keys(
        self, request: RequestInfo, ids, hbm_b, host_b, shared_b, queued, running, pending, inflight=None, ready_s=0.0
    ):
        """Sort keys per replica: (the balance guard's bound, score, recent work); replicas whose work is
        over the bound rank after those within it (the bound is infinite for the soft guard). The fourth
        value is what `_unseen_pick` needs to count placements the view lacks: (the wait per replica, the
        guard's bound, short-window work or None when the spread term is off, its bound, the short
        window's decay).

        With `inflight` (`FleetView.inflight_blocks`), a replica that could load a longer prefix once a
        prefill in flight elsewhere is stored (`ready_s` from now) is scored the better of two ways: now,
        with what it holds, or held until then with that prefix loaded, where `hold_worth` finds the wait
        worth it. Why: scored only as it is now, every replica but the one computing a new prompt looks
        like it must compute the prompt again, so a group's members arriving together pile onto that one
        (and the replicas that took one of them) while the rest of the fleet idles."""
        keys = self._keys_now(request, ids, hbm_b, host_b, shared_b, queued, running, pending)
        if inflight is None or not self.hold_for_tier:
            return keys
        gain = inflight > shared_b
        if not gain.any():
            return keys
        limit, score, work, extra = keys
        later = np.maximum(shared_b, inflight)
        _, score_h, _, extra_h = self._keys_now(request, ids, hbm_b, host_b, later, queued, running, pending, ready_s)
        most = max(0, (request.num_tokens - 1) // request.block_size)
        missing = (np.minimum(later, most) - np.minimum(shared_b, most)) * request.block_size
        extra_wait = np.maximum(ready_s - extra[0], 0.0)
        use = gain & self._worth_holding(missing, extra_wait) & (score_h < score)
        if not use.any():
            return keys
        wait = np.where(use, extra_h[0], extra[0])
        return limit, np.where(use, score_h, score), work, (wait, *extra[1:])

    def _keys_now(self, request: RequestInfo, ids, hbm_b, host_b, shared_b, queued, running, pending, ready_s=0.0):
        """`_keys` for the replicas as given (`ready_s`: `_predict`'s). The score per replica is
        `policies.score_kernel.replica_scores`, the formula in this module's docstring, in one pass."""
        work, recent, total, recent_total, live = self._work(ids)
        d = self._age(live)  # the short window as on_routed will see it: aged by this request
        hot = self._hot_blocks(request, shared_b)
        spread = None
        recent_bound = 0.0
        discount = -1.0  # the hot prefix's one-time recompute weighs as much as any other
        if hot:
            # the shared prompt is paid once per replica and then serves the whole flood: its one-time
            # recompute weighs hot_recompute_weight, so load, recent work and the rest of the prompt decide
            if self._fork_needs_copy(request.block_hashes[hot - 1], int(np.count_nonzero(shared_b >= hot)), live):
                discount = max(self.recompute_weight - self.hot_recompute_weight, 0.0)
            if self.spread_weight:
                recent_bound = (1.0 + self.balance_slack) * (recent_total / live)
                spread = recent
        bound = limit = (1.0 + self.balance_slack) * (total / live)
        cap = self.overshoot_cap * (total / live)
        score, _, wait, _ = self._evaluate(
            request,
            hbm_b,
            host_b,
            shared_b,
            queued,
            running,
            pending,
            ready_s,
            hot,
            discount,
            spread,
            recent_bound,
            d,
            work,
            bound,
            cap,
        )
        # the soft guard charges every token over the bound (in the score); the hard one ranks replicas
        # over the bound (plus one request's worth) after every replica within it
        limit = np.inf if self.guard_weight is not None else limit + request.num_tokens
        return limit, score, work, (wait, bound, spread, recent_bound, d)

    def _unseen_pick(self, request: RequestInfo, fleet: FleetView, limit, score, work, extra) -> int | None:
        """The replica for `request` when other routers have made placements this view lacks
        (`fleet.unseen_placements`, each `fleet.unseen_tokens` of prefill work on average); None when
        there are none (the deterministic best stands).

        Why: routers that share placements late share the same stale view, and ranking is deterministic,
        so within one lag every router sends its new prefixes to the same best replica, one request per
        router (simulated, 16 routers at 100 ms lag: half the single router's hit rate, as the burst's
        queue and the guard then push conversations off their history). A router cannot know where the
        unseen placements went, but it knows how they were chosen: by this same rule.

        The rule is a mixed one. The unseen placements are taken to be ranked like this request without its
        private prefix (the part of its cached prefix one replica alone holds: a conversation's own history;
        what two or more hold, a shared system prompt or document, stays). They go to replica m with
        probability pi_m, chosen so that with the expected unseen placements counted there (unseen * pi_m,
        each charged like a placement: its prefill, guard and short-window work), every replica they may go
        to has the same expected score and none they avoid a lower one (water filling: pi_m = (L - s_m) /
        (unseen * step_m) for s_m < L). This request takes the replica with the lowest expected score; when
        several tie (a new prefix: the replicas the water covers) it draws among them by pi. Near ties
        spread evenly over every tied replica instead of piling onto the first; a conversation whose history
        is on one replica stays there unless the expected unseen load there outweighs it. With none unseen
        it is the deterministic best. The draw is `prompt_pick` (weighted rendezvous hashing on the prompt's
        first block no replica holds): ranking the request again picks the same replica, and two routers
        given the same new content at once (one new document, two questions about it) agree on it unless
        their views differ much, so it is computed on one replica."""
        unseen = fleet.unseen_placements
        if not unseen > 0 or len(score) < 2 or not np.isfinite(score).all():
            return None
        shared_b = fleet.shared_blocks
        known, common = two_longest(shared_b)  # a prefix one replica alone holds past `common` is private
        if known > common:
            _, others, _, extra_o = self._keys(
                request,
                fleet.ids,
                np.minimum(fleet.hbm_blocks, common),
                np.minimum(fleet.host_blocks, common),
                np.minimum(shared_b, common),
                fleet.queued,
                fleet.running,
                fleet.pending_prefill_tokens,
            )
        else:
            others, extra_o = score, extra
        c = self.cost
        p = c.prefill_s_per_token
        tokens = max(float(fleet.unseen_tokens), 0.0)
        base = tokens * p + c.prefill_base_s
        if not (base > 0 and np.isfinite(base)):
            # unseen placements that cost nothing (no prefill base, and peers' prompts fully cached) add no
            # work to spread: the deterministic best stands (water filling would divide by a zero step)
            return None
        # one unseen placement's charge on each replica: its prefill (waited for by later requests there),
        # and the guard's and short window's charge for its work
        step = np.full(len(score), base)
        _, bound, spread_o, recent_bound_o, d = extra_o
        if self.guard_weight is not None:
            step += p * self.guard_weight * (np.maximum(work + tokens - bound, 0.0) - np.maximum(work - bound, 0.0))
        if spread_o is not None:
            step += (
                p
                * self.spread_weight
                * d
                * (np.maximum(spread_o + tokens - recent_bound_o, 0.0) - np.maximum(spread_o - recent_bound_o, 0.0))
            )
        # water filling: the level L at which sum over {s_m < L} of (L - s_m) / step_m = unseen
        blocked = work > limit  # the hard guard: replicas over the bound only when every replica is
        if blocked.all():
            blocked[:] = False
        keyed = np.where(blocked, np.inf, others)
        order = np.argsort(keyed, kind="stable")
        s_sorted, inv = keyed[order], 1.0 / step[order]
        level = s_sorted[0] + unseen * step[order[0]]
        a = b = 0.0
        for q in range(len(order)):
            if q and not s_sorted[q] < level:
                break
            a += inv[q]
            b += s_sorted[q] * inv[q]
            level = (unseen + b) / a
        pi = np.maximum(level - keyed, 0.0) / (unseen * step)
        expected = np.where(blocked, np.inf, score + unseen * pi * step)
        best = float(expected.min())
        if not np.isfinite(best):  # an expectation that means nothing (an overflow): the deterministic best
            return None
        near = np.flatnonzero(expected <= best + 1e-9 * max(abs(best), 1.0))
        weights = pi[near]
        if len(near) == 1 or not weights.sum() > 0:
            return int(near[0])
        # `known`, the prefix some replica holds: the draw keys on what follows
        return int(near[self.prompt_pick(request, [fleet.ids[k] for k in near], weights.tolist(), known)])

    def _fork_needs_copy(self, fork, holders: int, live: int) -> bool:
        """Does the prompt ending at `fork` need another replica? Its share of recent requests times the
        fleet is the replicas its traffic fills; once that many hold it, a further copy only spreads one
        group's conversations over the fleet (each replica then computes every group's prompt)."""
        if self._fork_total <= 0:
            return True
        share = self._fork_count.get(fork, 0.0) * self._fork_k / self._fork_total
        return holders < share * live * (1.0 + self.balance_slack)

    def _count_fork(self, fork) -> None:
        """Count one request towards `fork`, the deepest fork its prompt passes (None: none), decayed like
        the short window."""
        d = self._age(len(self._slot))
        self._fork_k *= d  # every count decays by d without touching them: a count is stored / _fork_k
        self._fork_total = self._fork_total * d + 1.0
        if fork is not None:
            self._fork_count[fork] = self._fork_count.get(fork, 0.0) + 1.0 / self._fork_k
        # renormalised whether or not this request passes a fork: left to decay through fork-less traffic,
        # _fork_k underflows and the next fork's count 1 / _fork_k is infinite for good
        if self._fork_k < 1e-12 or len(self._fork_count) > self._fork_prune_at:
            # forget forks with under 1/1000 of a recent request; pruning at twice what stays keeps it
            # amortised O(1) per request however many forks are live
            k = self._fork_k
            self._fork_count = {f: v * k for f, v in self._fork_count.items() if v * k > 1e-3}
            self._fork_k = 1.0
            self._fork_prune_at = max(4096, 2 * len(self._fork_count))

    def _age(self, live: int) -> float:
        """The short window's decay for one routed request (half-life in requests per replica)."""
        return 0.5 ** (1.0 / (self.half_life_requests * max(live, 1)))

    def _is_hot(self, request: RequestInfo, shared_b) -> bool:
        """Does the request's longest cached prefix end at a fork many requests branch from (a shared
        system prompt), rather than inside one conversation's own history?"""
        return self._hot_blocks(request, shared_b) > 0

    def _hot_blocks(self, request: RequestInfo, shared_b) -> int:
        """Blocks of the request's longest cached prefix when that prefix ends at a fork, else 0."""
        k = min(int(shared_b.max()) if len(shared_b) else 0, len(request.block_hashes))
        return k if k > 0 and self._fanout.get(request.block_hashes[k - 1], _NONE) is True else 0

    def _learn_fanout(self, hashes, request_id: str | None = None):
        """Record each block's continuation (the next block, or this request's own end) and return the
        deepest fork the prompt passes (None: none). Most blocks sit inside one conversation and only
        ever see one continuation: stored bare, not as a set. A request's end is named by its id, so the
        same request routed again (Serve ranks it again while it backs off, and the router commits each
        time) adds no new continuation: otherwise a few re-ranks would turn a conversation's last block
        into a hot fork."""
        if not hashes:
            return None
        end: tuple[str, str | int]
        if request_id is not None:
            end = ("end", request_id)
        else:
            self._ends += 1
            end = ("end", self._ends)
        fan = self._fanout
        get = fan.get
        fork = None
        for h, nxt in zip(hashes, chain(islice(hashes, 1, None), (end,))):
            seen = get(h, _NONE)
            if seen is True:
                fork = h
            elif seen == nxt:  # the common case: a block inside one conversation, seen with this continuation
                continue
            elif seen is _NONE:
                if len(fan) >= self.fanout_memory:
                    fan.popitem(last=False)  # bounded: forget the oldest block
                fan[h] = nxt
            elif isinstance(seen, set):
                seen.add(nxt)
                if len(seen) >= self.hot_fanout:
                    fan[h] = True
                    fork = h
            elif self.hot_fanout <= 2:
                fan[h] = True
                fork = h
            else:
                fan[h] = {seen, nxt}
        return fork

    def hold_worth(self, missing_tokens: int, extra_wait_s: float) -> bool:
        """Wait for an in-flight prefix when the extra wait costs less than computing it again, at the rate
        the score charges a recomputed token (`recompute_weight` x its prefill time): the same exchange of
        wait for compute as every other placement. Off with `hold_for_tier=False`."""
        return self.hold_for_tier and bool(self._worth_holding(missing_tokens, extra_wait_s))

    def _worth_holding(self, missing_tokens, extra_wait_s):
        """`hold_worth`'s exchange, elementwise over arrays (the hold option in `_keys`) or for one pair."""
        return (missing_tokens > 0) & (
            extra_wait_s < self.recompute_weight * missing_tokens * self.cost.prefill_s_per_token
        )

    def predict(self, request: RequestInfo, v: ReplicaView) -> tuple[float, int]:
        """(predicted TTFT in seconds, prompt tokens that would be computed) for `request` on `v`."""
        ttft, unc, _ = self._predict(
            request,
            *(
                np.array([x])
                for x in (v.hbm_blocks, v.host_blocks, v.shared_blocks, v.queued, v.running, v.pending_prefill_tokens)
            ),
        )
        return float(ttft[0]), int(unc[0])

    def place(self, request: RequestInfo, fleet: FleetView) -> list[int]:
        """Indices best first; with unseen peer placements, `_unseen_pick`'s replica first, then the rest
        in order."""
        if not len(fleet):
            return []
        args = (fleet.hbm_blocks, fleet.host_blocks, fleet.shared_blocks, fleet.queued, fleet.running)
        limit, score, work, extra = self._keys(
            request, fleet.ids, *args, fleet.pending_prefill_tokens, fleet.inflight_blocks, fleet.inflight_ready_s
        )
        self.last_scores = score
        order = np.lexsort((np.arange(len(score)), work, score, work > limit)).tolist()
        first = self._first_in_order(request, fleet, order[0], limit, score, work)
        if first != order[0]:
            order.remove(first)
            order.insert(0, first)
        pick = self._unseen_pick(request, fleet, limit, score, work, extra)
        if pick is not None and pick != order[0]:
            order.remove(pick)
            order.insert(0, pick)
        return order

    def best(self, request: RequestInfo, fleet: FleetView) -> int | None:
        """`place(...)[0]` without sorting the whole fleet: the lowest score, then the least work, then
        `_tie_break`'s draw (what the simulator needs per request at hundreds of replicas)."""
        if not len(fleet):
            return None
        args = (fleet.hbm_blocks, fleet.host_blocks, fleet.shared_blocks, fleet.queued, fleet.running)
        limit, score, work, extra = self._keys(
            request, fleet.ids, *args, fleet.pending_prefill_tokens, fleet.inflight_blocks, fleet.inflight_ready_s
        )
        self.last_scores = score
        if fleet.unseen_placements > 0:
            pick = self._unseen_pick(request, fleet, limit, score, work, extra)
            if pick is not None:
                return pick
        first, count = lowest(score) if limit == np.inf else (-1, 0)
        if first < 0:  # hard guard, or a NaN score: the full order decides
            top = int(np.lexsort((np.arange(len(score)), work, score, work > limit))[0])
            return self._first_in_order(request, fleet, top, limit, score, work)
        if count == 1:
            return int(first)
        return self._tie_break(request, fleet, (score == score[first]).nonzero()[0], work)

    def _first_in_order(self, request: RequestInfo, fleet: FleetView, top: int, limit, score, work) -> int:
        """The replica to rank first when `top` heads the full order: `top`, or `_tie_break`'s pick among
        the replicas equal to it on every key (guard side, score, recent work)."""
        over = work > limit
        tied = np.flatnonzero((score == score[top]) & (work == work[top]) & (over == over[top]))
        return top if len(tied) < 2 else self._tie_break(request, fleet, tied, work)

    def _tie_break(self, request: RequestInfo, fleet: FleetView, ties: np.ndarray, work: np.ndarray) -> int:
        """Among equally scored replicas: the least recent work, and among those (replicas nothing was sent
        to yet) one drawn by `prompt_pick`. Why not the lowest index: routers that have not heard of each
        other's placements yet (start-up, the first lag) would all send their first requests to the same
        replica (simulated, 16 routers at 100 ms: the first 14 requests, 300k prompt tokens, on one
        replica of 256, whose queue then pushed later requests sharing those prefixes elsewhere)."""
        w = work[ties]
        least = ties[w == w.min()]
        if len(least) == 1:
            return int(least[0])
        known = int(fleet.shared_blocks.max()) if len(fleet.shared_blocks) else 0
        return int(least[self.prompt_pick(request, [fleet.ids[k] for k in least], [1.0] * len(least), known)])

    # ------------------------------------------------------------------ feedback
    def on_routed(self, request: RequestInfo, replica_id: str, view: ReplicaView | None = None) -> None:
        """Credit the replica with the prefill work predicted from `view` (the replica as ranking saw
        it); without a view (a request routed without ranking) the whole prompt counts."""
        super().on_routed(request, replica_id, view)
        u = self._uncached(request, view.shared_blocks) if view is not None else request.num_tokens
        self.on_replica_added(replica_id)
        first = self._first_routing(request.request_id)
        if first:  # one request ages the short window once, however often it is committed
            d = self._age(len(self._slot))
            self._s *= d
            self._s_total *= d
        self._credit(replica_id, u)
        if self._total > self.window_tokens_per_replica * len(self._slot):
            self._w *= 0.5
            self._total *= 0.5
        self._credited[_credit_key(request, replica_id)] = (None if request.request_id else request, u)
        if len(self._credited) > 16_384:
            self._credited.popitem(last=False)
        fork = self._learn_fanout(request.block_hashes, request.request_id)
        if first:
            self._count_fork(fork)

    def _first_routing(self, request_id: str | None) -> bool:
        """Is this the request's first commit? Serve ranks a request again while no replica can take it
        (or after one rejected it), and the router withdraws the earlier commit (`on_unrouted`) and commits
        the new one each time. Its work is taken back; the short window's aging and the fork's request
        count are not, so they count only the first commit: a request waiting through many re-ranks must
        not age the window or weigh its fork many times."""
        return request_id is None or request_id not in self._withdrawn_ids

    def on_unrouted(self, request: RequestInfo, replica_id: str) -> None:
        """Take back the work `on_routed` credited (the fanout it learned stays: the prompt was seen, and
        so do the short window's aging and the fork's count: its next commit adds neither)."""
        if request.request_id is not None:
            self._withdrawn_ids[request.request_id] = None
            if len(self._withdrawn_ids) > 65_536:  # far more than can wait for a replica at once
                self._withdrawn_ids.popitem(last=False)
        key = _credit_key(request, replica_id)
        seen = self._credited.get(key)
        if seen is not None and (seen[0] is None or seen[0] is request):
            del self._credited[key]
            if replica_id in self._slot:
                self._credit(replica_id, -seen[1])

    def _credit(self, replica_id: str, u: float) -> None:
        """Add `u` tokens of work to the replica, never below zero, and to the fleet totals by what the
        replica's entries actually changed: a withdrawal after its work decayed takes back more than is
        left, and the totals must stay the sums of the entries they stand for."""
        k = self._slot[replica_id]
        w, s = self._w[k] + u, self._s[k] + u
        self._total = max(self._total + (u if w >= 0.0 else -self._w[k]), 0.0)
        self._s_total = max(self._s_total + (u if s >= 0.0 else -self._s[k]), 0.0)
        self._w[k] = max(w, 0.0)
        self._s[k] = max(s, 0.0)

    def on_replica_removed(self, replica_id: str) -> None:
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        self._total = max(self._total - self._w[slot], 0.0)
        self._w[slot] = 0.0
        self._s_total = max(self._s_total - self._s[slot], 0.0)
        self._s[slot] = 0.0
        self._free.append(slot)
        self._ids_key = ()  # rebuild positions on the next call

    def recent_work(self, ids: Sequence[str] | None = None) -> dict[str, float]:
        """The balance guard's work per replica (of `ids`, those it knows, when given)."""
        if ids is None:
            return {rid: float(self._w[s]) for rid, s in self._slot.items()}
        return {rid: float(self._w[self._slot[rid]]) for rid in ids if rid in self._slot}
