"""The HAProxy binary a local run hands to Ray Serve: the real one, with its side ports on loopback and
a parent-death signal.

Why a wrapper: Serve's HAProxy config template binds the stats page and the Prometheus exporter on every
interface (`bind *:<stats>`, `bind :<metrics>`), with no setting to change that; and HAProxy is started by
a Ray worker, so when Ray kills that worker the HAProxy processes were orphaned, kept the HTTP port and
answered every request with HTTP 500. Serve runs whatever `RAY_SERVE_HAPROXY_BINARY_PATH` names, so a
local run points it at a small script that runs this module: it rewrites those two binds to 127.0.0.1 in
a copy of the config, asks the kernel for SIGTERM when its parent dies, and execs the real binary (same
pid, so Serve's process bookkeeping is unchanged). The HTTP front keeps the host the config chose; its own
answer when no replica can be reached is OpenAI-style JSON, as every other answer of the app (`json_errors`), and
it binds without SO_REUSEPORT (`no_reuseport`): a second run on the same port fails instead of sharing it. The
script passes on the pid of the process that ran it (PARENT_PID_ENV): a parent that died before the
kernel was asked is noticed then, and the launcher ends instead of leaving an orphaned HAProxy.

    python -m kvmesh.deployments.loopback_haproxy REAL_HAPROXY STATS_PORT METRICS_PORT [haproxy args...]
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import sys

from kvmesh.cluster.whole_file import atomic_write

LOOPBACK = "127.0.0.1"
PARENT_PID_ENV = "KVMESH_HAPROXY_PARENT_PID"  # the launcher's parent as the script saw it ($PPID)


def loopback_config(text: str, ports: set[int]) -> str:
    """`text` with every all-interfaces `bind` of one of `ports` rebound to 127.0.0.1."""

    def rebind(m: re.Match) -> str:
        port = int(m.group(3))
        return f"{m.group(1)}bind {LOOPBACK}:{port}" if port in ports else m.group(0)

    return re.sub(r"^(\s*)bind\s+(\*|0\.0\.0\.0|::|\[::\])?:(\d+)\b", rebind, text, flags=re.MULTILINE)


# The answers HAProxy makes itself when no replica can be reached (502-504, which Serve's config answers as one
# plain-text 500; 500 too), as OpenAI-style JSON like every answer of the app. Not the 400 and 408 of a request
# HAProxy 2.8 cannot parse or that does not arrive in time (headers past its 16 KB buffer): its H1 layer sends
# those itself, and `errorfile` does not reach them (checked: a frontend's own errorfile neither).
FRONT_ERRORS = {status: ("500 Internal Server Error", "Internal server error.") for status in (500, 502, 503, 504)}


def error_file(status_line: str, message: str) -> str:
    """A raw HTTP response HAProxy sends as is (`errorfile`): an OpenAI-style JSON server error."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "internal_error"}})
    return (
        f"HTTP/1.1 {status_line}\r\nContent-Type: application/json\r\nContent-Length: {len(body.encode())}\r\n"
        f"Cache-Control: no-cache\r\nConnection: close\r\n\r\n{body}"
    )


def json_errors(text: str, folder: str) -> str:
    """`text` with HAProxy's own error answers as JSON files written in `folder`: Serve's `errorfile` lines
    (a plain-text 500) replaced by ours, declared in the `defaults` section; `text` as it is if it has no such
    section (a template that changed: Serve's own answers then stay)."""
    lines = []
    for status, (status_line, message) in FRONT_ERRORS.items():
        path = os.path.join(folder, f"kvmesh-{status}.http")
        with atomic_write(path) as fh:  # whole or not at all: a reload may read it meanwhile
            fh.write(error_file(status_line, message))
        lines.append(f"    errorfile {status} {path}\n")
    head = re.compile(r"^defaults\b[^\n]*\n", flags=re.MULTILINE)
    if not head.search(text):
        return text
    text = re.sub(r"^[ \t]*errorfile[ \t]+\d+[ \t]+\S+[ \t]*\n", "", text, flags=re.MULTILINE)
    return head.sub(lambda m: m.group(0) + "".join(lines), text, count=1)


def no_reuseport(text: str) -> str:
    """`text` with `noreuseport` in its `global` section (one added at the top when it has none). Why: HAProxy
    binds with SO_REUSEPORT by default, so a second local run given the same port listened beside the first
    and the kernel split the clients between the two apps; without it the second front fails to bind. Reloads
    are unaffected: the new process takes the listeners from the old one over the admin socket (`-x`)."""
    if re.search(r"^[ \t]*noreuseport\b", text, flags=re.MULTILINE):
        return text
    head = re.compile(r"^global\b[^\n]*\n", flags=re.MULTILINE)
    if not head.search(text):
        return "global\n    noreuseport\n" + text
    return head.sub(lambda m: m.group(0) + "    noreuseport\n", text, count=1)


def rewrite_args(args: list[str], ports: set[int]) -> list[str]:
    """HAProxy's arguments with each `-f CONFIG` replaced by a loopback copy written next to it (its own
    error answers as JSON, `json_errors`; no SO_REUSEPORT, `no_reuseport`)."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "-f":
            src = out[i + 1]
            with open(src, encoding="utf-8") as fh:
                text = fh.read()
            dst = f"{src}.loopback"
            with open(dst, "w", encoding="utf-8") as fh:
                text = no_reuseport(loopback_config(text, ports))
                fh.write(json_errors(text, os.path.dirname(os.path.abspath(src))))
            out[i + 1] = dst
    return out


def write_launcher(folder: str, real_binary: str, stats_port: int, metrics_port: int) -> str:
    """An executable script in `folder` that Serve can run as its HAProxy binary; returns its path."""
    path = os.path.join(folder, "haproxy")
    cmd = [sys.executable, "-m", __name__, real_binary, str(stats_port), str(metrics_port)]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"#!/bin/sh\n{PARENT_PID_ENV}=$PPID\nexport {PARENT_PID_ENV}\n")
        fh.write(f'exec {" ".join(shlex.quote(c) for c in cmd)} "$@"\n')
    os.chmod(path, stat.S_IRWXU)
    return path


def main(argv: list[str]) -> None:
    from kvmesh.deployments.process_tree import end_if_parent_gone, set_parent_death_signal

    real, stats_port, metrics_port, *args = argv
    args = rewrite_args(args, {int(stats_port), int(metrics_port)})
    parent = os.environ.pop(PARENT_PID_ENV, "")
    set_parent_death_signal()
    if parent.isdigit():
        end_if_parent_gone(int(parent))
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
