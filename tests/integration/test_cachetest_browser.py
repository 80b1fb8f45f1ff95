"""report.html in real headless Chromium: no console errors, nothing fetched, key figures in the page, JS ran,
and a screenshot is saved (KVMESH_SCREENSHOT_DIR, else the test's temp folder)."""

import os
from pathlib import Path

import pytest
from cachetest_support import sample_report
from headless_chromium import chromium_binary, load_page

from kvmesh.cluster.cachetest_html import write_outputs

pytestmark = pytest.mark.integration


def test_report_html_loads_cleanly_in_headless_chromium(tmp_path):
    assert chromium_binary(), "chromium is missing: `make services` installs Debian's chromium package"
    report = sample_report()
    paths = write_outputs(report, tmp_path / "report")
    shot_dir = Path(os.environ.get("KVMESH_SCREENSHOT_DIR") or tmp_path)
    shot_dir.mkdir(parents=True, exist_ok=True)
    shot = shot_dir / "cachetest-report.png"
    page = load_page(paths["html"], ["hit-rate", "cost-change", "errors", "loaded"], shot)
    assert page.console_errors == []
    assert all(u.startswith(("file:", "data:")) for u in page.requests), page.requests
    s = report["summary"]
    assert page.values["hit-rate"] == f"{100 * s['hit_rate_tokens']:.1f}%"
    assert page.values["cost-change"] == f"{100 * s['cost_change_vs_no_cache']:+.1f}%"
    assert page.values["errors"] == str(s["errors"])
    assert page.values["loaded"].startswith("interactive")  # the inline script ran
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
