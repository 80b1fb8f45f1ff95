"""Where a bench writes its files, and how it saves its plot: one place, so every bench honours
`BENCH_OUT` (default `out`) the same way and closes its figures (a long `make bench` would otherwise hold
every figure in memory)."""

from __future__ import annotations

import json
import os


def out_dir(name: str) -> str:
    """BENCH_OUT/name, created."""
    path = os.path.join(os.environ.get("BENCH_OUT", "out"), name)
    os.makedirs(path, exist_ok=True)
    return path


def write_json(path: str, data: object, indent: int = 1) -> None:
    """`data` as JSON at `path`, through a temp file renamed over it: a report rewritten after each setup of a
    long bench is never seen half-written, and the setups measured before a later failure stay on disk."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=indent)
    os.replace(tmp, path)


def save_plot(fig, path: str) -> None:
    """Lay the figure out, write it as a PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
