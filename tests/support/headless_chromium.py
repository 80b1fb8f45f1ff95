"""Load a page in real headless Chromium (Debian's `chromium`) over the DevTools protocol: console errors,
uncaught exceptions, network requests, values read from the DOM, and a screenshot.

Why not Playwright: its browser download cannot be fetched here, and the DevTools protocol over one
websocket (the `websockets` package vLLM already installs) is all a page check needs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageResult:
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    values: dict[str, str | None] = field(default_factory=dict)  # element id -> textContent


def load_page(path: Path, element_ids: list[str], screenshot: Path, timeout_s: float = 60.0) -> PageResult:
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("chromium is not installed (make services installs it)")
    profile = tempfile.mkdtemp(prefix="kvmesh-chromium-")
    proc = subprocess.Popen(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1200,1600",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = _devtools_port(proc, timeout_s)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10) as resp:
            targets = json.load(resp)
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
        return asyncio.run(_drive(ws_url, path, element_ids, screenshot, timeout_s))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(proc: subprocess.Popen, timeout_s: float) -> int:
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
        lines.append(line)
        m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
        if m:
            return int(m.group(1))
    raise RuntimeError("chromium exited before its DevTools endpoint was up: " + "".join(lines[-5:]))


async def _drive(ws_url: str, path: Path, element_ids: list[str], screenshot: Path, timeout_s: float) -> PageResult:
    import websockets

    result = PageResult()
    async with websockets.connect(ws_url, max_size=64 * 1024 * 1024) as ws:
        next_id = 0
        waiting: dict[int, asyncio.Future] = {}
        loaded = asyncio.Event()

        async def reader() -> None:
            async for raw in ws:
                msg = json.loads(raw)
                if "id" in msg and msg["id"] in waiting:
                    waiting.pop(msg["id"]).set_result(msg)
                    continue
                method, params = msg.get("method"), msg.get("params", {})
                if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                    result.console_errors.append(json.dumps(params.get("args"))[:300])
                elif method == "Runtime.exceptionThrown":
                    result.console_errors.append(json.dumps(params.get("exceptionDetails"))[:300])
                elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                    result.console_errors.append(params["entry"].get("text", "")[:300])
                elif method == "Network.requestWillBeSent":
                    result.requests.append(params.get("request", {}).get("url", ""))
                elif method == "Page.loadEventFired":
                    loaded.set()

        task = asyncio.create_task(reader())

        async def call(method: str, **params) -> dict:
            nonlocal next_id
            next_id += 1
            fut = asyncio.get_running_loop().create_future()
            waiting[next_id] = fut
            await ws.send(json.dumps({"id": next_id, "method": method, "params": params}))
            msg = await asyncio.wait_for(fut, timeout_s)
            if "error" in msg:
                raise RuntimeError(f"{method}: {msg['error']}")
            return msg.get("result", {})

        for domain in ("Runtime", "Log", "Page", "Network"):
            await call(f"{domain}.enable")
        await call("Page.navigate", url=Path(path).resolve().as_uri())
        await asyncio.wait_for(loaded.wait(), timeout_s)
        await asyncio.sleep(0.3)  # late console messages
        for eid in element_ids:
            got = await call(
                "Runtime.evaluate",
                expression=f"(function(){{var e=document.getElementById({json.dumps(eid)});"
                "return e ? e.textContent : null;})()",
                returnByValue=True,
            )
            result.values[eid] = got.get("result", {}).get("value")
        shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        task.cancel()
    return result


if __name__ == "__main__":  # python tests/support/headless_chromium.py PAGE.html SHOT.png (docs screenshots)
    import sys

    got = load_page(Path(sys.argv[1]), ["hit-rate"], Path(sys.argv[2]))
    print(f"console errors: {got.console_errors}, hit rate shown: {got.values['hit-rate']}")
