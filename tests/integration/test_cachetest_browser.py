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


_SORT_PROBE = """<pre id='sort-probe'></pre><script>
var out = [];
document.querySelectorAll('table.sortable').forEach(function (t, k) {
  var rows = function () { return Array.prototype.slice.call(t.tBodies[0].rows); };
  if (rows().length < 2) { return; }
  var col = t.rows[0].cells.length - 1;  // the last column: a number in every table of the report
  t.rows[0].cells[col].click();          // the first click sorts descending
  var vals = rows().map(function (r) { return r.cells[col].textContent; });
  var nums = vals.map(function (v) { return parseFloat(v.replace(/[^0-9.+-]/g, '')); });
  var sorted = nums.every(function (x, j) { return j === 0 || isNaN(x) || isNaN(nums[j - 1]) || nums[j - 1] >= x; });
  out.push('table' + k + ':' + (sorted ? 'sorted' : 'unsorted ' + vals.join('|')));
});
document.getElementById('sort-probe').textContent = out.join(' ');
</script>"""


def test_every_table_of_the_report_sorts_by_the_clicked_column(tmp_path):
    """A click on a header sorts its own table by that column, in every table (not the first alone)."""
    assert chromium_binary(), "chromium is missing: `make services` installs Debian's chromium package"
    paths = write_outputs(sample_report(), tmp_path / "report")
    probe = tmp_path / "report" / "probe.html"
    probe.write_text(paths["html"].read_text().replace("</body>", _SORT_PROBE + "</body>"))
    page = load_page(probe, ["sort-probe"], tmp_path / "probe.png")
    assert page.console_errors == []
    tables = (page.values["sort-probe"] or "").split()
    assert len(tables) >= 3, tables  # the sample report has several sortable tables with rows to sort
    assert all(t.endswith(":sorted") for t in tables), tables
