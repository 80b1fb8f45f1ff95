"""Local runs: sized to fit, side ports on loopback, a taken port named with its holder, a kept salt secret,
an unschedulable deployment explained in one line, and no process left below a stopped run."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from kvmesh.deployments.config import app_config
from kvmesh.deployments.deploy_watch import unschedulable_reason
from kvmesh.deployments.local_ray import NotEnoughResources, cpus_needed, local_num_cpus
from kvmesh.deployments.loopback_haproxy import loopback_config, rewrite_args
from kvmesh.deployments.port_check import check_port_free
from kvmesh.deployments.salt_secret import persistent_secret_file

SERVE_HAPROXY_CFG = """\
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 0.0.0.0:8000
listen stats
  bind *:8404
  stats enable
"""


def test_four_half_cpu_engines_and_the_ingress_fit_a_local_ray_on_two_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = app_config({"replicas": 4})
    assert cpus_needed(cfg) == pytest.approx(4 * 0.5 + 0.1)
    assert local_num_cpus(cfg, None) == 3  # more logical CPUs than cores: engines share them, none waits
    assert local_num_cpus(app_config({"replicas": 1}), None) == 2
    with pytest.raises(NotEnoughResources, match=r"needs 2\.1 CPUs .* --num-cpus gives 2: raise --num-cpus"):
        local_num_cpus(cfg, 2)


def test_haproxy_side_ports_move_to_loopback_and_the_front_keeps_its_host(tmp_path):
    out = loopback_config(SERVE_HAPROXY_CFG, {9101, 8404})
    assert "bind 127.0.0.1:9101" in out and "  bind 127.0.0.1:8404" in out
    assert "bind 0.0.0.0:8000" in out  # the HTTP front is the operator's choice (--host), untouched
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(SERVE_HAPROXY_CFG)
    args = rewrite_args(["-db", "-f", str(cfg), "-sf", "12"], {9101, 8404})
    assert args[:2] == ["-db", "-f"] and args[3:] == ["-sf", "12"]
    assert "bind 127.0.0.1:9101" in open(args[2]).read() and cfg.read_text() == SERVE_HAPROXY_CFG


def test_the_haproxy_config_binds_without_so_reuseport():
    from kvmesh.deployments.loopback_haproxy import no_reuseport

    out = no_reuseport("global\n    maxconn 100\ndefaults\n    mode http\n")
    assert out.startswith("global\n    noreuseport\n    maxconn 100\n") and out.count("noreuseport") == 1
    assert no_reuseport(out) == out
    assert no_reuseport("defaults\n    mode http\n").startswith("global\n    noreuseport\n")


def test_a_second_haproxy_on_a_bound_port_fails_instead_of_sharing_it(tmp_path):
    """Two local runs on one --port: each passed the port check before either front was up, and with HAProxy's
    default SO_REUSEPORT both fronts listened and the kernel split the clients between the two apps. The real
    binary, on the rewritten config, as the launcher runs it (without Serve's -dR)."""
    import time

    from ray.serve._private.haproxy import get_haproxy_binary

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for name in ("a", "b"):
            cfg = tmp_path / f"{name}.cfg"
            cfg.write_text(
                "global\n    maxconn 100\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n"
                f"    timeout server 5s\nfrontend http_frontend\n    bind 127.0.0.1:{port}\n"
                f'    http-request return status 200 content-type text/plain string "{name}"\n'
            )
            args = rewrite_args(["-db", "-f", str(cfg)], set())
            procs.append(
                subprocess.Popen([get_haproxy_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
            deadline = time.monotonic() + 10
            while name == "a" and procs[0].poll() is None:  # the first listens before the second starts
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except ConnectionRefusedError:
                    assert time.monotonic() < deadline, "the first HAProxy never listened"
                    time.sleep(0.05)
        assert procs[1].wait(timeout=10) != 0, "the second HAProxy listened on the port the first holds"
        assert procs[0].poll() is None, "the first HAProxy did not keep its port"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stderr.close()  # type: ignore[union-attr]


def test_a_taken_port_is_refused_naming_the_holder():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=rf"port {port} on 127.0.0.1 is already in use by pid {os.getpid()} \("):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again once its holder closed it


def test_the_generated_salt_secret_is_private_and_kept_across_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    first = persistent_secret_file()
    assert stat.S_IMODE(first.stat().st_mode) == 0o600 and len(first.read_text()) == 64
    assert persistent_secret_file() == first and first.read_text() == first.read_text()
    explicit = persistent_secret_file("an-explicit-secret-of-enough-bytes")
    assert explicit != first and explicit.read_text() == "an-explicit-secret-of-enough-bytes"
    first.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        persistent_secret_file()


def test_a_replica_waiting_for_resources_becomes_a_one_line_reason():
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    message = (
        "Deployment 'Ingress' in application 'kvmesh' has 1 replicas that have taken more than 30s to be "
        "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to be "
        "installed. Resources required for each replica: {'CPU': 0.1}, total resources available: {'CPU': 0.0}. "
        "Use `ray status` for more details."
    )

    def dep(msg: str = "") -> DeploymentStatusOverview:
        return DeploymentStatusOverview(
            status="UPDATING", status_trigger="CONFIG_UPDATE_STARTED", replica_states={}, message=msg
        )

    app = ApplicationStatusOverview(
        status="DEPLOYING",
        message="",
        last_deployed_time_s=0.0,
        deployments={"EngineReplica": dep(), "Ingress": dep(message)},
    )
    status = ServeStatus(applications={"kvmesh": app})
    reason = unschedulable_reason(status, "kvmesh")
    assert reason and "\n" not in reason
    assert reason.startswith("deployment Ingress: 1 replica(s) cannot be scheduled: each needs {'CPU': 0.1}")
    assert "the cluster has {'CPU': 0.0} free" in reason and "--num-cpus" in reason and "--replicas" in reason
    slow_init = message.replace("to be scheduled", "to initialize")
    app.deployments["Ingress"] = dep(slow_init)
    assert unschedulable_reason(ServeStatus(applications={"kvmesh": app}), "kvmesh") is None


def test_a_stopped_run_ends_what_its_children_orphaned(tmp_path):
    """A subreaper inherits a grandchild whose parent exited (as HAProxy outlives a killed Ray worker) and
    end_descendants ends it; without the subreaper, the orphan would belong to init, out of reach."""
    script = textwrap.dedent(
        """
        import subprocess, time, psutil
        from kvmesh.deployments.process_tree import become_subreaper, end_descendants
        assert become_subreaper()
        subprocess.run(["sh", "-c", "sleep 300 & echo $!"], check=True, stdout=open("pid", "w"))
        orphan = psutil.Process(int(open("pid").read()))
        assert orphan.ppid() == psutil.Process().pid, orphan.ppid()
        deadline = time.monotonic() + 30
        while orphan.name() != "sleep" and time.monotonic() < deadline:  # forked by sh, not yet exec'd
            time.sleep(0.01)
        ended = end_descendants(grace_s=5)
        print(ended, orphan.is_running())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "sleep (" in out.stdout and out.stdout.strip().endswith("False"), out.stdout


def test_still_running_names_what_a_stop_left_behind_and_not_what_ended():
    import psutil

    from kvmesh.deployments.process_tree import still_running

    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        procs = [psutil.Process(p.pid) for p in (left, ended)]
        assert [p.pid for p in still_running(procs, 3.0)] == [left.pid]
    finally:
        left.kill()
        left.wait()
        ended.wait()


def test_a_start_that_fails_after_ray_is_up_stops_what_it_started(monkeypatch, tmp_path):
    """Serve can kill its own proxy during start-up (a health check missed on a busy machine); the failed
    start must not leave its Ray cluster running, nor its HAProxy folder behind."""
    import ray
    from ray import serve

    from kvmesh.deployments import app as app_module
    from kvmesh.deployments import local_ray, process_tree

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    calls = []
    up = [False]
    # an engine replica the failed start had begun: killed with its cluster, it never removed its folder
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left_folder = tempfile.mkdtemp(prefix=f"kvmesh-engine-{gone.pid}-", dir="/tmp")

    def fake_start_local_ray(**kw):
        up[0] = True
        calls.append("ray up")

    def fake_shutdown():
        up[0] = False
        calls.append("ray down")

    def proxy_killed(**kw):
        raise RuntimeError("The actor died unexpectedly before finishing this task")

    monkeypatch.setattr(local_ray, "start_local_ray", fake_start_local_ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: up[0])
    monkeypatch.setattr(ray, "shutdown", fake_shutdown)
    monkeypatch.setattr(serve, "start", proxy_killed)
    monkeypatch.setattr(process_tree, "end_descendants", lambda **kw: calls.append("descendants ended") or [])
    made = []
    real_proxy_env = app_module._proxy_env
    monkeypatch.setattr(app_module, "_proxy_env", lambda proxy: made.append(real_proxy_env(proxy)) or made[-1])
    saved = dict(os.environ)  # start_local exports its secrets' and proxy's settings for Ray's processes
    try:
        with pytest.raises(RuntimeError, match="actor died"):
            app_module.start_local({"replicas": 1, "port": 0})
    finally:
        os.environ.clear()
        os.environ.update(saved)
        exists = os.path.exists(left_folder)
        shutil.rmtree(left_folder, ignore_errors=True)
    assert not exists, "a dead replica's private folder outlived the failed start"
    assert calls == ["ray up", "ray down", "descendants ended"]
    run = os.path.dirname(made[0]["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"])
    assert os.path.basename(run).startswith("kvmesh-haproxy-") and not os.path.exists(run)
    # Serve puts the admin socket under a 56-character node id; HAProxy refused a 102-character socket path
    # (the length every run had used before was 96)
    for key in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        node_socket = os.path.join(run, "0" * 56, os.path.basename(made[0][key]))
        assert len(node_socket) <= 96, node_socket
    assert not app_module._started_ray and app_module._haproxy_dir is None


def test_haproxy_folders_of_runs_whose_process_is_gone_are_removed(tmp_path):
    from kvmesh.deployments.app import _remove_orphaned_haproxy_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine, orphan = tmp_path / "kvmesh-haproxy-abc", tmp_path / "kvmesh-haproxy-def"
    unowned = tmp_path / "kvmesh-haproxy-xyz"  # an older run's, without an owner file: not ours to judge
    other = tmp_path / "something-else"
    for d, pid in ((mine, os.getpid()), (orphan, dead.pid), (unowned, None), (other, dead.pid)):
        d.mkdir()
        if pid is not None:
            (d / "owner.pid").write_text(str(pid))
    assert _remove_orphaned_haproxy_dirs(str(tmp_path)) == [str(orphan)]
    assert mine.exists() and unowned.exists() and other.exists() and not orphan.exists()


def test_under_autoscaling_the_cpu_check_counts_the_maximum_and_names_its_flag():
    cfg = app_config({"replicas": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 8}})
    assert cpus_needed(cfg) == pytest.approx(8 * 0.5 + 0.1)
    with pytest.raises(NotEnoughResources) as info:
        local_num_cpus(cfg, 4)
    assert str(info.value) == (
        "the app needs 4.1 CPUs (8 engine replica(s) (the autoscaling maximum) x 0.5 + ingress 0.1) but "
        "--num-cpus gives 4: raise --num-cpus, lower --autoscaling MAX or engine.num_cpus"
    )
    with pytest.raises(NotEnoughResources) as info:
        local_num_cpus(app_config({"replicas": 8, "ingress_replicas": 2}), 4)
    assert str(info.value) == (
        "the app needs 4.2 CPUs (8 engine replica(s) x 0.5 + ingress 0.2) but --num-cpus gives 4: "
        "raise --num-cpus, lower --replicas or engine.num_cpus"
    )


def test_a_local_cluster_refuses_custom_resources_and_more_gpus_than_the_machine_has(monkeypatch):
    """start_local_ray gives its node no custom resources and Ray counts the machine's GPUs: engines asking for
    either passed the CPU check, and waited to be placed once Ray and Serve ran."""
    from kvmesh.deployments import local_ray

    with pytest.raises(NotEnoughResources, match=r"engine.resources \(kvmesh_engine\): .*`ray start --resources`"):
        local_num_cpus(app_config({"engine": {"resources": {"kvmesh_engine": 1}}}), None)
    monkeypatch.setattr(local_ray, "local_gpus", lambda: 0)
    with pytest.raises(
        NotEnoughResources, match=r"2 engine replica\(s\) of engine.num_gpus 1 need more GPUs than the 0"
    ):
        local_num_cpus(app_config({"engine": {"num_gpus": 1}}), None)
    monkeypatch.setattr(local_ray, "local_gpus", lambda: 2)
    assert local_num_cpus(app_config({"engine": {"num_gpus": 1}}), 4) == 4
    assert local_num_cpus(app_config({"replicas": 4, "engine": {"num_gpus": 0.5}}), 4) == 4
    # a fractional request is placed within one GPU: 0.6 + 0.6 do not share one, so 3 need 3 GPUs
    with pytest.raises(NotEnoughResources, match=r"room for 2\): lower --replicas or engine.num_gpus"):
        local_num_cpus(app_config({"replicas": 3, "engine": {"num_gpus": 0.6}}), 4)
    monkeypatch.setattr(local_ray, "local_gpus", lambda: None)  # not known: left to Ray
    assert local_num_cpus(app_config({"engine": {"num_gpus": 1}}), 4) == 4


def test_a_local_gpu_run_with_autoscaling_is_refused_only_when_the_engines_it_starts_with_do_not_fit(
    home, fake_ray, monkeypatch, caplog
):
    """The GPU check counted the autoscaling maximum (Serve's 100 where none is set): `{min_replicas: 1}` on a
    2-GPU machine was refused, though it starts one engine and Serve only ever scales up to what is placed.
    What the app starts with must fit; a maximum above the GPUs gets one warning line."""
    from kvmesh.deployments import local_ray

    monkeypatch.setattr(local_ray, "local_gpus", lambda: 2)

    def check(auto: dict) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvmesh.deployments.local_ray"):
            local_ray.check_local_resources(
                app_config({"autoscaling": auto, "engine": {"num_gpus": 1}}), warn_pending=True
            )
        return [r.getMessage() for r in caplog.records]

    pending = (
        "autoscaling may ask for up to 100 engine replicas of engine.num_gpus 1, but the 2 GPU(s) on this "
        "machine hold 2: replicas above 2 stay pending"
    )
    assert check({"min_replicas": 1}) == [pending]
    assert len(check({"min_replicas": 1, "max_replicas": 4})) == 1
    assert check({"min_replicas": 1, "max_replicas": 2}) == []  # all of it fits: nothing to say
    # `kvmesh serve`'s relay checks without the warning: its driver's start says it, once
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvmesh.deployments.local_ray"):
        local_num_cpus(app_config({"autoscaling": {"min_replicas": 1}, "engine": {"num_gpus": 1}}), None)
    assert caplog.records == []
    from kvmesh.deployments.app import start_local, stop_local

    with caplog.at_level("WARNING", logger="kvmesh.deployments.local_ray"):  # the start says it, once
        start_local({"port": 0, "proxy": "serve", "autoscaling": {"min_replicas": 1}, "engine": {"num_gpus": 1}})
    stop_local(drain=False)
    assert [r.getMessage() for r in caplog.records] == [pending]
    for start in ({"min_replicas": 3, "max_replicas": 4}, {"min_replicas": 1, "initial_replicas": 3}):
        with pytest.raises(NotEnoughResources, match=r"^3 engine replica\(s\) \(the autoscaling start\).*MIN"):
            check(start)


def test_the_gpu_count_follows_cuda_visible_devices_and_the_devices_present(tmp_path, monkeypatch):
    import shutil

    from kvmesh.deployments import local_ray

    monkeypatch.setattr(local_ray, "AMD_GPU_DEVICE", str(tmp_path / "kfd"))
    monkeypatch.setattr(local_ray, "NVIDIA_CONTROL_DEVICE", str(tmp_path / "nvidiactl"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_ray.local_gpus() == 0  # no driver, no tool
    (tmp_path / "nvidiactl").touch()
    assert local_ray.local_gpus() is None  # a driver without nvidia-smi: Ray's own count decides
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_ray.local_gpus() == 0
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: A (UUID: a)'\necho 'GPU 1: B (UUID: b)'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(smi))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_ray.local_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert local_ray.local_gpus() == 1
    (tmp_path / "kfd").touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_ray.local_gpus() is None  # AMD GPUs count as GPU for Ray too


def test_haproxys_own_error_answers_are_openai_style_json(tmp_path):
    """HAProxy's own answer when no replica can be reached was Serve's plain-text 500: run the real binary on the
    rewritten config and ask it."""
    import json as _json
    import subprocess
    import time

    from ray.serve._private.haproxy import get_haproxy_binary

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plain_500 = tmp_path / "500.http"
    plain_500.write_text("HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\nInternal Server Error")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(
        "defaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n    timeout server 5s\n"
        f"    errorfile 502 {plain_500}\n    errorfile 503 {plain_500}\n    errorfile 504 {plain_500}\n"
        f"frontend http_frontend\n    bind 127.0.0.1:{port}\n    default_backend nowhere\n"
        "backend nowhere\n    server s1 127.0.0.1:1\n"
    )
    args = rewrite_args(["-db", "-f", str(cfg)], set())
    assert str(plain_500) not in open(args[2]).read()
    proc = subprocess.Popen([get_haproxy_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:

        def ask(headers: str) -> tuple[str, dict]:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                        c.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
                        raw = b""
                        while chunk := c.recv(65536):
                            raw += chunk
                    break
                except ConnectionRefusedError:  # not listening yet
                    assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
                    time.sleep(0.05)
            head, _, body = raw.decode().partition("\r\n\r\n")
            assert "content-type: application/json" in head.lower(), raw
            return head.split("\r\n")[0], _json.loads(body)

        status, body = ask("")  # no replica reachable: Serve's 500, as JSON
        assert status.startswith("HTTP/1.1 500") and body["error"]["type"] == "server_error"
    finally:
        proc.kill()
        proc.wait()


def test_a_config_without_the_defaults_section_keeps_serves_own_error_answers(tmp_path):
    """The JSON answers go in the `defaults` section; a template without one keeps Serve's `errorfile` lines
    (they were dropped, leaving HAProxy's HTML), and a named section (`defaults serve`) takes them too."""
    from kvmesh.deployments.loopback_haproxy import json_errors

    text = "global\n    maxconn 10\nfrontend f\n    errorfile 503 /x/500.http\n"
    assert json_errors(text, str(tmp_path)) == text
    named = json_errors("defaults serve\n    mode http\n    errorfile 503 /x/500.http\n", str(tmp_path))
    assert "/x/500.http" not in named and f"errorfile 503 {tmp_path}/kvmesh-503.http" in named


def _serve_status(app_status: str, proxy: str | None = "HEALTHY", message: str = ""):
    from ray.serve.schema import ApplicationStatusOverview, ServeStatus

    app = ApplicationStatusOverview(status=app_status, message=message, last_deployed_time_s=0.0, deployments={})
    return ServeStatus(proxies={"head-node": proxy} if proxy else {}, applications={"kvmesh": app})


def test_joined_from_another_machine_than_the_head_the_start_asks_serve_not_the_url(home, fake_ray, monkeypatch):
    """Serve's one HTTP proxy runs on the head node (proxy_location HeadOnly): a driver on another machine
    polled http://127.0.0.1:<port>/health on its own, which never answered, and deleted the app after 600 s."""
    import ray
    from ray import serve

    from kvmesh.deployments import app, ray_join

    monkeypatch.setattr(ray_join, "join_cluster", lambda address, **kw: fake_ray.__setitem__("up", True))
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.5", "Resources": {"CPU": 4.0, "node:__internal_head__": 1.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 4.0}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.9")
    polled = []
    monkeypatch.setattr(app, "_wait_ready", lambda cfg, timeout_s: polled.append(cfg["port"]))
    monkeypatch.setattr(serve, "status", lambda: _serve_status("RUNNING"))
    monkeypatch.setattr(serve, "delete", lambda name: None)
    assert app.start_local({"port": 8000}, address="10.0.0.5:6379") == "http://127.0.0.1:8000"
    assert polled == [] and app.proxy_elsewhere() == "10.0.0.5"
    app.stop_local(drain=False)
    assert app.proxy_elsewhere() is None
    # a driver on the head node itself polls the URL, as before
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")
    app.start_local({"port": 8000}, address="10.0.0.5:6379")
    assert polled == [8000] and app.proxy_elsewhere() is None
    app.stop_local(drain=False)


def test_waiting_through_serve_ends_at_a_failed_app_with_its_reason(monkeypatch):
    from ray import serve

    from kvmesh.deployments import app

    cfg = app_config({})
    monkeypatch.setattr(serve, "status", lambda: _serve_status("DEPLOY_FAILED", message="replica died\ntrace"))
    with pytest.raises(RuntimeError, match=r"^kvmesh app DEPLOY_FAILED: replica died$"):
        app._wait_serving(cfg, 60)
    monkeypatch.setattr(serve, "status", lambda: _serve_status("RUNNING", proxy="UNHEALTHY"))
    with pytest.raises(TimeoutError, match=r"app RUNNING, proxies \['UNHEALTHY'\]"):
        app._wait_serving(cfg, 0)
