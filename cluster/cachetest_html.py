"""`kvmesh cachetest`'s output folder: report.json, PNG plots and one self-contained report.html (CSS, JS and
images inline, nothing fetched), from the document `cluster/cachetest_report.build_report` returns.

Sections of the page, in order: the summary (hit rate, cost and TTFT change against no caching and
against round robin where run), cold vs warm, the sweeps, the tier breakdown, miss reasons as stacked
bars, per-tenant and per-replica tables, the top drifted prompts with their diff.
"""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path

from kvmesh.cluster.miss_reasons import REASONS
from kvmesh.cluster.whole_file import atomic_write

_COLORS = {
    "cold": "#8da0cb",
    "evicted": "#e78ac3",
    "misrouted": "#fc8d62",
    "partial_chunk": "#b15928",
    "isolated": "#66c2a5",
    "partial_block": "#a6d854",
    "drift": "#ffd92f",
    "adapter": "#e5c494",
    "unknown": "#b3b3b3",
}


# What each miss reason means, and what would turn those tokens into hits: the report's legend.
REASON_TEXT = {
    "cold": "first time anywhere in the fleet: nothing to reuse yet.",
    "evicted": "computed before, but in no tier when the request came: more HBM, a host or shared tier.",
    "misrouted": "cached on another replica than the one used; /kvmesh/explain's router_reason says why "
    "(load, balance_guard, serve_fallback): the price of balance, or of a full replica.",
    "partial_chunk": "held in an LMCache tier, past the last whole chunk this prompt shares with the stored one: "
    "a smaller chunk_size.",
    "isolated": "the same tokens are cached under another tenant's salt: tenant isolation, by design.",
    "partial_block": "the tail after the last full block (vLLM caches whole blocks and always computes the last "
    "prompt token): a smaller block size, or longer shared prefixes.",
    "drift": "the same words as an earlier prompt, tokenised differently (whitespace, template, tool order): "
    "make the prompt text byte-stable.",
    "adapter": "the same tenant computed these tokens under another model or LoRA adapter.",
    "unknown": "computed before, but the endpoint does not say where it placed the request (not kvmesh).",
}


def _reason_legend(passes: dict) -> str:
    """One line per reason any pass has tokens for: what it means and what would turn them into hits."""
    seen = [r for r in REASONS if any(p["miss_tokens"].get(r) for p in passes.values())]
    items = "".join(f"<dt>{r}</dt><dd>{html.escape(REASON_TEXT[r])}</dd>" for r in seen)
    return f"<dl class='reasons'>{items}</dl>" if items else ""


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pct_or_nan(v: float | None) -> float:
    """A rate in percent for a plot; nothing drawn (NaN) where nothing was measured."""
    return float("nan") if v is None else 100 * v


def _ms_or_nan(v: float | None) -> float:
    """Seconds as milliseconds for a plot; nothing drawn (NaN) where nothing was measured (not a 0 ms bar)."""
    return float("nan") if v is None else 1000 * v


SWEEP_AXES = {"concurrency": "requests in flight", "replicas": "engine replicas"}


def sweeps(passes: dict) -> dict[str, list[tuple[int, str]]]:
    """The passes of each sweep as (x, pass name), by x: the concurrency sweep's warm passes (`warm`,
    `warm_cN`) by requests in flight, the replicas sweep's warm passes (`replicas_N`; their cold passes,
    `replicas_N_cold`, only empty the cache) by replica count. The main app's `warm` pass (`--serve`
    records every pass's replica count) is the replicas sweep's point at `--replicas` when it followed a
    `cold` pass on that app: it ran as every `replicas_N` does (a cold pass on an empty cache, then warm,
    at the first concurrency), so that count is not run twice."""
    out: dict[str, list[tuple[int, str]]] = {"concurrency": [], "replicas": []}
    for n, p in passes.items():
        if n == "warm" or n.startswith("warm_c"):
            out["concurrency"].append((int(p["concurrency"]), n))
        elif n.startswith("replicas_") and n.removeprefix("replicas_").isdigit():
            out["replicas"].append((int(n.removeprefix("replicas_")), n))
    main = passes.get("warm") or {}
    cold = passes.get("cold") or {}
    if main.get("replicas") is not None and cold.get("replicas") == main["replicas"]:  # warm after cold, one app
        if main["replicas"] not in {x for x, _ in out["replicas"]}:
            out["replicas"].append((int(main["replicas"]), "warm"))
    return {k: sorted(v) for k, v in out.items()}


def _save(fig, path: Path) -> None:
    """A PNG written whole or not at all."""
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=90)


def plot_all(report: dict, out: Path) -> dict[str, Path]:
    """Write the PNGs; name -> path."""
    plt = _plt()
    passes = report["passes"]
    names = list(passes)
    paths: dict[str, Path] = {}

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].bar(names, [_pct_or_nan(passes[n]["hit_rate_tokens"]) for n in names], color="#4c72b0")
    axes[0].set_ylabel("hit rate, % of prompt tokens")
    axes[1].bar(names, [_ms_or_nan(passes[n]["ttft_p50_s"]) for n in names], color="#55a868", label="p50")
    axes[1].plot(names, [_ms_or_nan(passes[n]["ttft_p90_s"]) for n in names], "ko", label="p90")
    axes[1].set_ylabel("TTFT, ms")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    paths["passes"] = out / "passes.png"
    _save(fig, paths["passes"])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 3.2))
    bottom = [0.0] * len(names)
    for reason in REASONS:
        vals = [float(passes[n]["miss_tokens"].get(reason, 0)) for n in names]
        if any(vals):
            ax.bar(names, vals, bottom=bottom, color=_COLORS[reason], label=reason)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("uncached prompt tokens")
    if any(bottom):  # no missed token anywhere (or nothing answered): no legend to show
        ax.legend(fontsize=8, ncol=4)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    paths["miss_reasons"] = out / "miss_reasons.png"
    _save(fig, paths["miss_reasons"])
    plt.close(fig)

    for kind, sweep in sweeps(passes).items():
        if len(sweep) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        xs = [x for x, _ in sweep]
        ax.plot(xs, [_ms_or_nan(passes[n]["ttft_p50_s"]) for _, n in sweep], "o-", label="TTFT p50, ms")
        ax2 = ax.twinx()
        ax2.plot(xs, [_pct_or_nan(passes[n]["hit_rate_tokens"]) for _, n in sweep], "s--", color="#c44e52")
        ax2.set_ylabel("hit rate, %")
        ax.set_xlabel(SWEEP_AXES[kind])
        ax.set_ylabel("TTFT p50, ms")
        fig.tight_layout()
        paths[f"sweep_{kind}"] = out / f"sweep_{kind}.png"
        _save(fig, paths[f"sweep_{kind}"])
        plt.close(fig)
    return paths


def _fmt(v, kind: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "ms":
        return f"{1000 * v:.1f} ms"
    if kind == "usd":
        return f"${v:.6f}"
    if kind == "rel":
        return f"{100 * v:+.1f}%"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return html.escape(f"{v:,}" if isinstance(v, int) else str(v))


def _compared(n: int | None) -> str:
    """A comparison card's population: the requests answered in both passes."""
    return "" if n is None else f"over {n:,} request{'' if n == 1 else 's'} answered in both"


def _isolation_why(iso: dict) -> str:
    """Why the isolation probe has no verdict: it did not run (no two keyed tenants, no prompt it could
    test), or it ran without one (its request failed, or the answer reported no cached-token count)."""
    if not iso.get("run") and iso.get("why"):
        return f" <span id='isolation-why'>(not run: {html.escape(str(iso['why']))})</span>"
    if not iso.get("run") or iso.get("ok") is not None:
        return ""
    why = f"the probe's request failed: {iso['error']}" if iso.get("error") else "no cached-token count in the answer"
    return f" <span id='isolation-why'>({html.escape(str(why))})</span>"


def _header_flags(meta: dict) -> str:
    """The header's notes on how far to trust the run: a partial report, and the reset before cold (none:
    the cold pass may have found the cache already warm)."""
    out = ""
    if meta.get("partial"):
        out += f" &middot; <b id='partial'>PARTIAL: {html.escape(str(meta['partial']))}</b>"
    if "cold_reset" in meta:
        reset = meta["cold_reset"] or "none (the cold pass may have started warm)"
        out += f" &middot; cache reset before cold: <span id='cold-reset'>{html.escape(str(reset))}</span>"
    return out


def _table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="sortable {cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _img(path: Path | None, alt: str) -> str:
    if path is None:
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _miss_cells(miss: dict) -> list[str]:
    return [_fmt(miss.get(r, 0)) for r in REASONS]


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
.cards{display:flex;flex-wrap:wrap;gap:1em}
.card{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;min-width:11em}
.card b{display:block;font-size:1.5em}.card small{display:block;color:#666}
.warn{background:#fff3cd;padding:.5em 1em;border-radius:6px}
table{border-collapse:collapse;margin:.5em 0;font-size:.85em}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
th{background:#f4f4f4;cursor:pointer}td:first-child,th:first-child{text-align:left}
pre{background:#f7f7f7;padding:.5em;white-space:pre-wrap;font-size:.85em}mark{background:#ffd92f}
img{max-width:100%}
dl.reasons{font-size:.9em}dl.reasons dt{font-weight:bold;float:left;clear:left;width:9em}
dl.reasons dd{margin:0 0 .3em 9.5em}
"""

_JS = """
document.querySelectorAll('table.sortable th').forEach(function (th) {
  var i = th.cellIndex;  // the column within its own table (the page has several)
  th.addEventListener('click', function () {
    var tbody = th.closest('table').querySelector('tbody');
    var rows = Array.prototype.slice.call(tbody.rows);
    var num = function (r) { return parseFloat(r.cells[i].textContent.replace(/[^0-9.+-]/g, '')); };
    var desc = th.dataset.desc !== '1'; th.dataset.desc = desc ? '1' : '0';
    rows.sort(function (a, b) {
      var x = num(a), y = num(b);
      if (isNaN(x) || isNaN(y)) { x = a.cells[i].textContent; y = b.cells[i].textContent; }
      return (x < y ? -1 : x > y ? 1 : 0) * (desc ? -1 : 1);
    });
    rows.forEach(function (r) { tbody.appendChild(r); });
  });
});
document.getElementById('loaded').textContent = 'interactive: click a column header to sort';
"""


def _diff_html(d: dict) -> str:
    return (
        f"<p><b>{html.escape(str(d['id']))}</b> ({html.escape(str(d['pass']))}, tenant "
        f"{html.escape(str(d['tenant']))}): {d['drift_tokens']} tokens drifted from "
        f"<b>{html.escape(str(d['matches']))}</b>, kind <b>{html.escape(d['kind'])}</b>; first differing token "
        f"#{d['first_differing_token']} (ids {html.escape(str(d['token_ids']))})</p>"
        f"<pre>this:    {html.escape(repr(d['text']))}\nearlier: {html.escape(repr(d['earlier_text']))}</pre>"
    )


def render_html(report: dict, plots: dict[str, Path]) -> str:
    s = report.get("summary") or {}
    passes = report["passes"]
    meta = report.get("meta", {})
    off = report.get("offline", {})
    # the warm pass re-sends the log right after cold: its figures are re-sent traffic, an upper bound
    resent = "warm pass: the log re-sent, an upper bound" if s.get("main_resent") else ""
    cards = [
        ("hit-rate", "hit rate (tokens)", _fmt(s.get("hit_rate_tokens"), "pct"), resent),
        ("hit-rate-requests", "requests with a hit", _fmt(s.get("requests_with_hit"), "pct"), resent),
        ("cost-change", "input cost vs no cache", _fmt(s.get("cost_change_vs_no_cache"), "rel"), resent),
        (
            "ttft-change",
            "TTFT p50 vs cold",
            _fmt(s.get("ttft_change_vs_cold"), "rel"),
            _compared(s.get("ttft_compared_vs_cold")),
        ),
        ("cost-per-interaction", "cost per interaction", _fmt(s.get("cost_per_interaction"), "usd"), ""),
        ("offline-bound", "infinite-cache bound", _fmt(s.get("offline_infinite_hit_rate"), "pct"), ""),
    ]
    if "cold" in passes:  # what first-contact traffic reused, beside the bound
        cards.append(("cold-hit-rate", "cold pass hit (first contact)", _fmt(s.get("cold_hit_rate_tokens"), "pct"), ""))
    if "cost_change_vs_round_robin" in s:
        cards.append(
            (
                "cost-vs-rr",
                "input cost vs round robin",
                _fmt(s["cost_change_vs_round_robin"], "rel"),
                _compared(s.get("cost_compared_vs_round_robin")),
            )
        )
        cards.append(
            (
                "ttft-vs-rr",
                "TTFT p50 vs round robin",
                _fmt(s.get("ttft_change_vs_round_robin"), "rel"),
                _compared(s.get("ttft_compared_vs_round_robin")),
            )
        )
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>kvmesh cachetest report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>kvmesh cachetest report</h1>",
        "<p>"
        + " &middot; ".join(
            html.escape(x)
            for x in (
                str(meta.get("url") or ""),
                f"model {meta['model']}" if meta.get("model") else "",
                f"block size {meta.get('block_size')}",
                str(meta.get("generated_at") or ""),
            )
            if x
        )
        + _header_flags(meta)
        + " &middot; <span id='loaded'>static</span></p>",
        "<h2 id='summary'>Summary</h2><div class='cards'>",
    ]
    for cid, title, value, note in cards:
        note = f"<small id='{cid}-compared'>{html.escape(note)}</small>" if note else ""
        parts.append(f"<div class='card'>{html.escape(title)}<b id='{cid}'>{value}</b>{note}</div>")
    parts.append("</div>")
    for warning in s.get("warnings") or ([s["warning"]] if s.get("warning") else []):
        parts.append(f"<p class='warn'>{html.escape(warning)}</p>")
    iso = report.get("isolation", {})
    parts.append(
        f"<p>Errors: <b id='errors'>{s.get('errors', 0)}</b>. Correctness (warm greedy outputs = cold): "
        f"<b id='correct'>{_fmt(s.get('correct'))}</b>. Isolation probe (another tenant's identical prompt gets no "
        f"cached token beyond what that tenant computed itself): <b id='isolation'>{_fmt(iso.get('ok'))}</b>"
        f"{_isolation_why(iso)}. "
        f"Offline: repeated-prefix share {_fmt(off.get('repeated_prefix_share'), 'pct')} of "
        f"{_fmt(off.get('prompt_tokens'))} prompt tokens.</p>"
    )
    parts.append("<h2 id='passes'>Cold vs warm, and every pass</h2>")
    parts.append(_img(plots.get("passes"), "hit rate and TTFT per pass"))
    rows = []
    for n, p in passes.items():
        rows.append(
            [
                html.escape(n),
                _fmt(p["requests"]),
                _fmt(p["errors"]),
                _fmt(p["prompt_tokens"]),
                _fmt(p.get("counted_prompt_tokens")),
                _fmt(p["cached_tokens"]),
                _fmt(p["hit_rate_tokens"], "pct"),
                _fmt(p["requests_with_hit"], "pct"),
                _fmt(p["ttft_p50_s"], "ms"),
                _fmt(p["ttft_p90_s"], "ms"),
                _fmt(p["ttft_p99_s"], "ms"),
                _fmt(p.get("throughput_tokens_s")),
                _fmt(p["input_cost"], "usd"),
                _fmt(p["cost_per_interaction"], "usd"),
                _fmt(p.get("evictions")),
            ]
        )
    parts.append(
        _table(
            [
                "pass",
                "requests",
                "errors",
                "prompt tok",
                "counted tok",  # the hit rate's denominator: answers that reported their cached tokens
                "cached tok",
                "hit (tok)",
                "req. with a hit",
                "TTFT p50",
                "p90",
                "p99",
                "tok/s",
                "input cost",
                "per interaction",
                "evictions",
            ],
            rows,
            "passes",
        )
    )
    parts.append("<h2 id='sweeps'>Sweeps</h2>")
    ran = {kind: sweep for kind, sweep in sweeps(passes).items() if len(sweep) > 1}
    for kind, sweep in ran.items():
        parts.append(_img(plots.get(f"sweep_{kind}"), f"{kind} sweep"))
        parts.append(
            _table(
                ["pass", SWEEP_AXES[kind], "hit (tok)", "TTFT p50", "TTFT p99", "tok/s"],
                [
                    [
                        html.escape(n),
                        _fmt(x),
                        _fmt(passes[n]["hit_rate_tokens"], "pct"),
                        _fmt(passes[n]["ttft_p50_s"], "ms"),
                        _fmt(passes[n]["ttft_p99_s"], "ms"),
                        _fmt(passes[n].get("throughput_tokens_s")),
                    ]
                    for x, n in sweep
                ],
            )
        )
    if not ran:
        parts.append("<p>No sweep was run (--concurrency-sweep, --replicas-sweep).</p>")
    parts.append("<h2 id='tiers'>Where the cache lived: hits by tier</h2>")
    parts.append(
        _table(
            ["pass", "hbm", "host", "shared", "unknown", "evictions", "chunks to host", "chunks to shared"],
            [
                [html.escape(n)]
                + [_fmt(p["hits_by_tier"].get(t)) for t in ("hbm", "host", "shared", "unknown")]
                + [
                    _fmt(p.get("evictions")),
                    _fmt((p.get("spills") or {}).get("to_host_chunks")),
                    _fmt((p.get("spills") or {}).get("to_shared_chunks")),
                ]
                for n, p in passes.items()
            ],
        )
    )
    parts.append("<h2 id='misses'>Why tokens missed</h2>")
    parts.append(_img(plots.get("miss_reasons"), "miss reasons per pass"))
    parts.append(
        _table(
            ["pass", *REASONS], [[html.escape(n), *_miss_cells(p["miss_tokens"])] for n, p in passes.items()], "misses"
        )
    )
    parts.append(_reason_legend(passes))
    main_name = s.get("pass") if s.get("pass") in passes else next(iter(passes))
    main = passes[main_name]
    for title, key in (("Per tenant", "per_tenant"), ("Per replica", "per_replica")):
        parts.append(f"<h2 id='{key}'>{title} ({html.escape(str(main_name))} pass)</h2>")
        parts.append(
            _table(
                [title.split()[1], "requests", "errors", "prompt tok", "cached tok", "hit (tok)", *REASONS],
                [
                    [
                        html.escape(k or "(none)"),
                        _fmt(r["requests"]),
                        _fmt(r.get("errors")),
                        _fmt(r["prompt_tokens"]),
                        _fmt(r["cached_tokens"]),
                        _fmt(r["hit_rate_tokens"], "pct"),
                        *_miss_cells(r["miss_tokens"]),
                    ]
                    for k, r in sorted(main[key].items())
                ],
            )
        )
    parts.append("<h2 id='drift'>Top drifted prompts</h2>")
    drifts = report.get("drift_examples") or []
    parts.extend(_diff_html(d) for d in drifts) if drifts else parts.append("<p>No drift found.</p>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts)


# every file a report writes (the sweep plots only with a sweep): what `remove_outputs` clears
OUTPUT_FILES = ("report.json", "report.html", "passes.png", "miss_reasons.png", *(f"sweep_{k}.png" for k in SWEEP_AXES))


def remove_outputs(out_dir: str | os.PathLike, keep: tuple[str, ...] = ()) -> None:
    """Remove an earlier run's outputs from `out_dir` (but `keep`): a run that stops before writing its own
    must not leave them looking like its result, nor a sweep plot this run did not draw."""
    for name in OUTPUT_FILES:
        if name not in keep:
            try:
                (Path(out_dir) / name).unlink()
            except FileNotFoundError:
                pass


def write_outputs(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """report.json, the PNGs and report.html in `out_dir`; name -> path. Each file is written whole or not
    at all (an interrupt leaves no half file), and an earlier run's sweep plot this report has no sweep for
    is removed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json"}
    text = json.dumps(report, separators=(",", ":"))
    plots = plot_all(report, out)
    page = render_html(report, plots)
    with atomic_write(paths["json"]) as fh:
        fh.write(text)
    paths.update(plots)
    paths["html"] = out / "report.html"
    with atomic_write(paths["html"]) as fh:
        fh.write(page)
    remove_outputs(out, keep=tuple(p.name for p in paths.values()))
    return paths
