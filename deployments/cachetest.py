"""`kvmesh cachetest`'s passes against any OpenAI-compatible URL (kvmesh, a vLLM server, a peer router).

Passes, each sent by the streaming replay client (`deployments/replay.py`, turns of one interaction in
order, N requests in flight):
- `cold`: the log as logged, first contact (the server's cache is reset first where it offers a reset:
  kvmesh's `POST /kvmesh/reset_prefix_cache`, every engine replica, `--serve` included; vLLM's
  `POST /reset_prefix_cache`; `meta.cold_reset` says which).
- `warm`: the same requests again.
- `partial`: each prompt's tail changed, at a block boundary (`partial_boundary`: the kept prefix is whole
  blocks) and mid-block (`partial_midblock`: half a block more is kept, which no cache can serve), sent
  as token ids to /v1/completions so the change lands exactly where intended.
- `warm_cN`: the concurrency sweep (warm, N in flight).
After warm: the isolation probe (another tenant sends a logged prompt verbatim: no cached token beyond
what that tenant computed itself expected; no verdict when its request fails or the answer has no
cached-token count) and the correctness check (warm greedy outputs == cold's: every request is sent
greedy, whatever sampling the log asked for). The sweep's points run before the partial passes.

Against kvmesh the router's record of each request (`/kvmesh/explain/{id}`) and the server's counters
(`/kvmesh/state`: evictions, tier hits, spills) are read; elsewhere those figures are `unknown`/None.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.cluster.block_cache import leading_held
from kvmesh.cluster.cachetest_analysis import Prepared, Sent
from kvmesh.cluster.cachetest_report import PassRun, Rates, build_report
from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass
from kvmesh.cluster.request_log import COMPLETIONS, LoggedRequest
from kvmesh.deployments.replay import ReplayConfig, ReplayError, RequestResult, replay

PASSES = ("cold", "warm", "partial")


class CachetestError(Exception):
    """The test cannot run (bad configuration, unreachable endpoint, a tenant without a key)."""


@dataclass
class CachetestConfig:
    url: str
    api_key: str | None = None
    tenant_keys: dict[str, str] = field(default_factory=dict)
    passes: Sequence[str] = PASSES
    concurrency: Sequence[int] = (4,)  # the first runs the passes; more values add warm_cN sweep passes
    rates: Rates = field(default_factory=Rates)
    block_size: int = 32
    timeout_s: float = 120.0
    bound_replicas: Sequence[int] = (1, 2, 4)

    def check(self, reqs: Sequence[LoggedRequest]) -> None:
        self.check_passes()
        self.check_tenants((r.line, r.tenant) for r in reqs)

    def check_passes(self) -> None:
        if not self.passes:
            raise CachetestError(f"--passes: name at least one pass ({', '.join(PASSES)})")
        bad = [p for p in self.passes if p not in PASSES]
        if bad:
            raise CachetestError(f"--passes: unknown pass {bad[0]!r} (choose from {', '.join(PASSES)})")

    def check_tenants(self, tenants: Iterable[tuple[int, str | None]]) -> None:
        """Every tenant named ((line, tenant) per request) has a key. Takes the pairs, not the requests: a
        trace's are checked before its prompts are built."""
        if self.tenant_keys and not self.api_key:
            for line, tenant in tenants:
                if tenant is not None and tenant not in self.tenant_keys:
                    raise CachetestError(
                        f"log line {line}: tenant {tenant!r} has no key (add --tenant-key {tenant}=KEY)"
                    )


def _http(cfg: CachetestConfig):
    import httpx

    headers = {}
    key = cfg.api_key or next(iter(cfg.tenant_keys.values()), None)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.Client(base_url=cfg.url.rstrip("/"), headers=headers, timeout=30.0)


def discover(cfg: CachetestConfig) -> tuple[list[str], bool]:
    """(served model ids, whether the endpoint is kvmesh); raises CachetestError when unreachable."""
    try:
        with _http(cfg) as c:
            resp = c.get("/v1/models")
            if resp.status_code != 200:
                raise CachetestError(f"--url {cfg.url}: GET /v1/models answered HTTP {resp.status_code}")
            models = [m["id"] for m in resp.json().get("data") or []]
            state = c.get("/kvmesh/state")  # kvmesh answers 403 operator_only to a tenant that is not one
            is_kvmesh = state.status_code == 200 or _error_code(state) == "operator_only"
    except CachetestError:
        raise
    except Exception as exc:
        raise CachetestError(f"--url {cfg.url}: unreachable ({type(exc).__name__})") from None
    if not models:
        raise CachetestError(f"--url {cfg.url}: serves no model")
    return models, is_kvmesh


def _error_code(resp) -> str | None:
    try:
        return resp.json()["error"]["code"]
    except Exception:
        return None


def server_counters(cfg: CachetestConfig) -> dict:
    """kvmesh's cumulative counters that a pass diffs: index evictions, tier hits and bytes moved (none
    unless the key is an operator's: they span tenants)."""
    try:
        with _http(cfg) as c:
            resp = c.get("/kvmesh/state")
            if resp.status_code != 200:
                return {}
            state = resp.json()
    except Exception:
        return {}
    return counters_from_state(state)


STATS_SETTLE_S = 1.0  # two periods of the engines' routing stats (`routing_stats_period_s`, 0.5 s by default)


def counters_from_state(state: dict) -> dict:
    """The counters a pass diffs, from a `/kvmesh/state` document. A server without LMCache reports no tier
    figures: its tier hits are zero, so every cached token it delivered came from the engines' own cache."""
    router = state.get("router") or {}
    out = {"evictions": (router.get("index") or {}).get("evictions", 0)}
    if isinstance(router.get("instance"), str):  # which router's index counted them (cluster/cachetest_report)
        out["router_instance"] = router["instance"]
    out.update({k: v for k, v in (state.get("tiers") or {}).items() if isinstance(v, (int, float))})
    stats = (router.get("routing_stats") or {}).values()
    loaded = [s["external_hit_tokens"] for s in stats if isinstance(s.get("external_hit_tokens"), int)]
    if loaded:  # what the engines loaded through LMCache, from their routing stats (one period behind)
        out["external_hit_tokens"] = sum(loaded)
    return out


def reset_cache(cfg: CachetestConfig) -> str | None:
    """Ask the server to drop its prefix cache; the name of the reset used, or None when none exists."""
    try:
        with _http(cfg) as c:
            for path in ("/kvmesh/reset_prefix_cache", "/reset_prefix_cache"):
                if c.post(path).status_code == 200:
                    return path
    except Exception:
        return None
    return None


def fetch_explanations(
    cfg: CachetestConfig, request_ids: Sequence[str], tenant_of: dict[str, str | None] | None = None
) -> dict[str, dict]:
    """The router's record of each request (kvmesh only), fetched 16 at a time: with `--api-key` (an
    operator's key reads every record whole), else, or where that key may not read it, with the key of the
    tenant that sent it (`tenant_of`: a tenant reads its own records, `isolated` counted as `cold`)."""
    import httpx

    tenant_of = tenant_of or {}
    first = cfg.api_key or next(iter(cfg.tenant_keys.values()), None)

    def auth(key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def main() -> dict[str, dict]:
        out: dict[str, dict] = {}
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), timeout=30.0) as c:

            async def one(rid: str) -> None:
                own = cfg.tenant_keys.get(tenant_of.get(rid) or "")
                async with gate:
                    for key in dict.fromkeys((first, own)):
                        # one record that cannot be read (a timeout, an ingress restarting) leaves that
                        # request without a record (its misses on blocks computed before are `unknown`);
                        # it must not end the test and lose the passes already sent
                        try:
                            resp = await c.get(f"/kvmesh/explain/{rid}", headers=auth(key))
                            if resp.status_code == 200:
                                out[rid] = resp.json()
                                return
                        except Exception:
                            continue

            await asyncio.gather(*(one(r) for r in request_ids))
        return out

    return asyncio.run(main())


def attach_explanations(sent: Sequence[Sent], results: Sequence[RequestResult], explained: dict[str, dict]) -> None:
    """Give each sent request (in log order) the router's record of it (`explained`, by the server's request
    id; None where there is none)."""
    by_index = {r.index: r for r in results}
    for i, s in enumerate(sent):
        rid = by_index[i].request_id
        s.explain = explained.get(rid) if rid else None


# ---------------------------------------------------------------------------------- pass building
def _record(p: Prepared, served: str, body: dict | None = None, endpoint: str | None = None) -> dict:
    r = p.req
    body = dict(body if body is not None else r.body)
    body["model"] = served
    return {
        "body": body,
        "endpoint": endpoint or r.endpoint,
        "tenant": r.tenant,
        "user": f"{r.tenant}/{r.interaction}",
        "prompt_tokens": p.tok.n,
        "timestamp": r.timestamp * 1000.0,  # the replay client's unit (ms)
    }


def partial_variants(prepared: Sequence[Prepared], block_size: int, mid_block: bool, vocab: int) -> list[Prepared]:
    """Each prompt with its tail changed after its last whole block but one (kept prefix = whole blocks),
    or half a block later (`mid_block`). Token ids shift within [10, vocab) so every changed token differs."""
    out = []
    for p in prepared:
        ids = p.tok.ids
        keep = max(block_size, ((len(ids) - 1) // block_size - 1) * block_size)
        if mid_block:
            keep += block_size // 2
        keep = min(keep, len(ids) - 1)
        lo = 10
        tail = [lo + ((t - lo + 7) % (vocab - lo)) for t in ids[keep:]]
        tok = TokenizedRequest(p.tok.index, p.tok.id, p.tok.tenant, p.tok.model, ids[:keep] + tail)
        req = LoggedRequest(
            p.req.id,
            {"prompt": tok.ids, "max_tokens": p.req.body.get("max_tokens", 16)},
            COMPLETIONS,
            p.req.tenant,
            p.req.interaction,
            p.req.timestamp,
            p.req.line,
        )
        out.append(Prepared(req, tok, [], origin=p))
    hash_requests([p.tok for p in out], block_size)
    return out


def _sent(
    items: Sequence[Prepared], results: Sequence[RequestResult], name: str, offset: float, model: str | None = None
) -> list[Sent]:
    """The sent requests of one pass, on the test's clock (`offset`), sent as `model` (None: not known)."""
    by_index = {r.index: r for r in results}
    out = []
    for i, p in enumerate(items):
        r = by_index[i]
        ready = None if r.ttft_s is None or r.error is not None else offset + r.start_s + r.ttft_s
        out.append(
            Sent(p, name, offset + r.start_s, ready, r.prompt_tokens, r.cached_tokens, r.replica, r.error, None, model)
        )
    return out


class Runner:
    """Sends the passes, one after another, on one clock; `report()` builds report.json's document."""

    def __init__(self, cfg: CachetestConfig, prepared: Sequence[Prepared], tokenizer, progress: bool = False):
        self.cfg = cfg
        self.prepared = list(prepared)
        self.tokenizer = tokenizer
        self.progress = progress
        self.models, self.is_kvmesh = discover(cfg)
        self.served = self.models[0]
        self.runs: list[PassRun] = []
        self.clock = 0.0
        self.isolation: dict | None = None
        self.reset: str | None = None
        self.current: str | None = None  # the pass being sent (what an interrupted test stopped in)

    def send(
        self, name: str, items: Sequence[Prepared], concurrency: int, records: list[dict] | None = None
    ) -> PassRun:
        self.current = name
        records = records or [_record(p, self.served) for p in items]
        rcfg = ReplayConfig(
            url=self.cfg.url,
            concurrency=concurrency,
            api_key=self.cfg.api_key,
            tenant_keys=dict(self.cfg.tenant_keys),
            model=self.served,
            timeout_s=self.cfg.timeout_s,
            progress=self.progress,
            greedy=True,  # the correctness check compares warm outputs with cold's: no sampling
        )
        before = server_counters(self.cfg) if self.is_kvmesh else {}
        try:
            rep = replay(records, rcfg)
        except ReplayError as exc:
            raise CachetestError(f"--url {self.cfg.url}: {exc}") from None
        if self.is_kvmesh:  # the engines' routing stats (their LMCache loads) come every 0.5 s by default
            time.sleep(STATS_SETTLE_S)
        after = server_counters(self.cfg) if self.is_kvmesh else {}
        answered = [r for r in rep.results if r.error is None]
        if answered and all(r.cached_tokens is None for r in answered):  # a 0% hit rate would be made up
            raise CachetestError(
                f"--url {self.cfg.url}: the server reports no cached tokens (usage.prompt_tokens_details."
                "cached_tokens); start vLLM with --enable-prompt-tokens-details"
            )
        sent = _sent(items, rep.results, name, self.clock, model=self.served)  # every request went as served
        self.clock += rep.wall_s + 1.0
        if self.is_kvmesh:
            ids = [r.request_id for r in rep.results if r.request_id]
            tenant_of = {r.request_id: records[r.index].get("tenant") for r in rep.results if r.request_id}
            attach_explanations(sent, rep.results, fetch_explanations(self.cfg, ids, tenant_of))
        run = PassRun(
            name,
            sent,
            rep.wall_s,
            concurrency,
            sum(r.output_tokens for r in rep.results if r.error is None),
            before,
            after,
            {items[r.index].req.id: r.output_text for r in rep.results if r.error is None},
        )
        self.runs.append(run)
        self.current = None
        return run

    def run_all(self) -> None:
        c0 = self.cfg.concurrency[0]
        passes = self.cfg.passes
        if "cold" in passes:
            self.reset = reset_cache(self.cfg)
            self.send("cold", self.prepared, c0)
        if "warm" in passes:
            self.send("warm", self.prepared, c0)
            self.isolation = self.isolation_probe()
        # the sweep's points come before the partial passes: those send new prompts that evict the logged
        # ones, so a point sent after them would measure the eviction, not the concurrency
        for c in self.cfg.concurrency[1:]:
            self.send(f"warm_c{c}", self.prepared, c)
        if "partial" in passes:
            vocab = len(self.tokenizer)
            self.send("partial_boundary", partial_variants(self.prepared, self.cfg.block_size, False, vocab), c0)
            self.send("partial_midblock", partial_variants(self.prepared, self.cfg.block_size, True, vocab), c0)

    def probe_choice(self) -> tuple[Prepared, str, int] | None:
        """(logged prompt, tenant to send it as, tokens that tenant may get from its own cache) for the
        isolation probe: the pair that leaves most of the prompt's blocks reusable only from the other
        tenant; None when no prompt has such a block. The prober's own history counts: tenants sharing a
        system prompt each cache it under their own salt, and a prober served it from its own cache leaks
        nothing. Its own blocks are the prompt's leading blocks it computed itself (vLLM-identical unsalted
        hashes over the log)."""
        keyed = list(self.cfg.tenant_keys)
        if len(set(keyed)) < 2:
            return None
        computed: dict[str, set[int]] = {t: set() for t in keyed}
        for p in self.prepared:
            if p.req.tenant in computed:
                computed[p.req.tenant].update(p.tok.unsalted)
        B = self.cfg.block_size
        best: tuple[int, Prepared, str, int] | None = None
        for p in self.prepared:
            if p.req.tenant not in computed:
                continue
            servable = max(0, (p.tok.n - 1) // B)  # whole blocks before the last token: what a cache can serve
            for other in keyed:
                if other == p.req.tenant:
                    continue
                own = min(leading_held(p.tok.unsalted, computed[other]), servable)
                if best is None or servable - own > best[0]:
                    best = (servable - own, p, other, own * B)
        return None if best is None or best[0] == 0 else best[1:]

    def isolation_probe(self) -> dict:
        """Another tenant sends a logged prompt verbatim: a salted cache serves it at most what that tenant
        computed itself (`probe_choice`); more is a leak."""
        if len(set(self.cfg.tenant_keys)) < 2:
            return {"run": False, "why": "needs keys of two tenants (--tenant-key)"}
        choice = self.probe_choice()
        if choice is None:  # every block a probe could leak is one the prober computed itself
            return {"run": False, "why": "no logged prompt has a whole block that only another keyed tenant sent"}
        src, other, own = choice
        rec = _record(src, self.served)
        rec.update(tenant=other, user=f"probe/{other}")
        rcfg = ReplayConfig(
            url=self.cfg.url,
            concurrency=1,
            tenant_keys=dict(self.cfg.tenant_keys),
            model=self.served,
            timeout_s=self.cfg.timeout_s,
            progress=False,
            greedy=True,
        )
        try:
            res = replay([rec], rcfg).results[0]
        except ReplayError as exc:
            res = RequestResult(0, rec["user"], other, src.tok.n, None, 0, None, 0.0, "unknown", str(exc))
        return {
            "run": True,
            "request": src.req.id,
            "from_tenant": src.req.tenant,
            "as_tenant": other,
            "prompt_tokens": res.prompt_tokens,
            "cached_tokens": res.cached_tokens,
            "own_cached_tokens": own,  # what the prober may reuse from its own requests (not a leak)
            "error": res.error,
            # nothing measured (the request failed, or the answer had no cached-token count): no verdict, not
            # a leak
            "ok": None if res.error is not None or res.cached_tokens is None else res.cached_tokens <= own,
        }

    def report(self, offline: dict, meta: dict | None = None) -> dict:
        def decode(ids: Sequence[int]) -> str:
            return self.tokenizer.decode(list(ids))

        info = {
            "url": self.cfg.url,
            "model": self.served,
            "kvmesh": self.is_kvmesh,
            "cold_reset": self.reset,
            "concurrency": list(self.cfg.concurrency),
            "generated_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
        report = build_report(
            self.runs,
            offline,
            self.cfg.rates,
            self.cfg.block_size,
            meta=dict(info, **(meta or {})),
            decode=decode,
            isolation=self.isolation,
        )
        return report


def offline_figures(prepared: Sequence[Prepared], block_size: int, replicas: Sequence[int]) -> dict:
    return offline_pass([p.tok for p in prepared], block_size, replicas)


def report_from_replays(
    records: Sequence[dict],
    replays: dict,
    tokens_per_block: int,
    block_size: int,
    rates: Rates | None = None,
    counters: dict[str, dict] | None = None,
    explained: dict[str, dict[str, dict]] | None = None,
) -> dict:
    """A cachetest report for runs already replayed (the demo): one fresh server per run (`replays`: run
    name -> `ReplayReport` of `records`, Mooncake form, token prompts as `deployments/replay.py` builds them).
    `counters`: run name -> that server's counters when the run ended (`counters_from_state`); a fresh
    server started from zero, so they are the run's own, and they split its hits by tier. `explained`: run
    name -> the router's record of each request (`fetch_explanations`, by the server's request id), which
    splits the misses on blocks computed before into misrouted, partial_chunk and evicted."""
    from kvmesh.deployments.replay import PromptBuilder

    builder = PromptBuilder(ReplayConfig(url="", tokens_per_block=tokens_per_block))
    prepared = []
    for i, rec in enumerate(records):
        rid = str(rec.get("id", f"req-{i}"))
        ids = [int(t) for t in builder.prompt(rec)]  # token prompts (no tokenizer given)
        interaction = str(rec["user"]) if rec.get("user") is not None else rid
        req = LoggedRequest(rid, {"prompt": ids}, COMPLETIONS, rec.get("tenant"), interaction)
        prepared.append(Prepared(req, TokenizedRequest(i, rid, rec.get("tenant"), None, ids)))
    hash_requests([p.tok for p in prepared], block_size)
    runs, clock = [], 0.0
    for name, rep in replays.items():
        sent = _sent(prepared, rep.results, name, clock)
        attach_explanations(sent, rep.results, (explained or {}).get(name) or {})
        clock += rep.wall_s + 1.0
        outputs = {prepared[r.index].req.id: r.output_text for r in rep.results if r.error is None}
        out_tokens = sum(r.output_tokens for r in rep.results if r.error is None)
        after = (counters or {}).get(name) or {}
        runs.append(
            PassRun(
                name,
                sent,
                rep.wall_s,
                rep.concurrency or 0,
                out_tokens,
                counters_after=after,
                outputs=outputs,
                fresh_fleet=True,
            )
        )
    offline = offline_pass([p.tok for p in prepared], block_size, (1, 2, 4))
    return build_report(runs, offline, rates or Rates(), block_size, meta={"source": "kvmesh demo"})
