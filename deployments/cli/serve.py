"""`kvmesh serve`: start a local Ray of its own (or join `--address`), deploy the kvmesh app, print URL +
API key, and stop cleanly on Ctrl-C / SIGTERM, leaving no process behind (deployments/supervisor.py).

Flags override the config file (`--config FILE`, the same YAML the Serve app builder takes).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import given, printable

DRIVER_KEY_ENV = "KVMESH_SERVE_API_KEY"  # the supplied API key as the relay hands it to the driver
API_KEY_ENV = "KVMESH_API_KEY"  # an operator's API key, kept off the command line (`ps` shows that to everyone)


# a terminal colour or style code (CSI ... final byte): Ray colours the task names in its errors
_ANSI_CODE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def start_failure(exc: BaseException) -> str:
    """The first line of why a start failed, as one plain line of text: Ray's errors carry terminal colour
    codes, which a log file or a service manager's journal shows as raw escapes."""
    text = _ANSI_CODE.sub("", str(exc)).strip()
    return printable(text.splitlines()[0]) if text else type(exc).__name__


def add_arguments(parser) -> None:
    parser.add_argument("--config", type=given, help="serving config YAML (deployments/config.py); flags override it")
    parser.add_argument("--model", type=given, help="'tiny' (built locally) or a local Hugging Face model directory")
    parser.add_argument("--replicas", type=int, help="engine replicas (default 2; not with --autoscaling)")
    parser.add_argument("--policy", type=given, help="placement policy (kvmesh.policies.registry; default kvmesh)")
    parser.add_argument("--host", type=given, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000; 0 = pick a free one)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key-file",
        type=given,
        metavar="PATH",
        help=f"file holding the API key clients must send (or set {API_KEY_ENV}; default: a generated one)",
    )
    keys.add_argument(
        "--api-key",
        type=given,
        help=f"the API key itself: every local user sees it in `ps` while kvmesh runs; prefer --api-key-file or "
        f"{API_KEY_ENV}",
    )
    parser.add_argument(
        "--tenants", type=given, help="tenants file (YAML/TOML/JSON, deployments/tenants.py) instead of --api-key"
    )
    parser.add_argument("--block-size", type=int, help="engine KV block size (multiple of 32 on CPU)")
    parser.add_argument("--max-model-len", type=int, help="engine context length")
    parser.add_argument(
        "--num-cpus", type=int, help="CPUs for a locally started Ray (default: all cores, or what the app needs)"
    )
    parser.add_argument(
        "--address",
        type=given,
        help="join this Ray cluster (host:port) instead of starting a local one; RAY_ADDRESS is ignored",
    )
    parser.add_argument(
        "--autoscaling",
        type=_replica_range,
        metavar="MIN:MAX",
        help="autoscale the engine replicas between MIN and MAX (Serve autoscaling; other keys from the config; "
        "not with --replicas)",
    )
    parser.add_argument(
        "--tool-call-parser",
        type=given,
        metavar="NAME",
        help="vLLM's tool-call parser for the model (its --tool-call-parser, e.g. hermes): serves tool choices",
    )
    parser.add_argument(
        "--proxy",
        choices=("haproxy", "serve"),
        help="HTTP front of a locally started Ray: Serve's HAProxy mode (default) or its Python proxy",
    )


def _replica_range(text: str) -> str:
    """Checks 'MIN:MAX' (0 <= MIN <= MAX, MAX >= 1); kept as text so the driver's command line repeats it."""
    import argparse

    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        pair = (-1, -1)
    if not sep or pair[0] < 0 or pair[1] < max(1, pair[0]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX replicas, 0 <= MIN <= MAX, MAX >= 1")
    return text


def _build_config(args) -> dict:
    from kvmesh.deployments.config import ConfigError, app_config, load_config
    from kvmesh.deployments.tenants import new_api_key

    if args.replicas is not None and args.autoscaling is not None:  # autoscaling would drop --replicas unsaid
        raise ConfigError("--replicas and --autoscaling exclude each other: give a fixed count or a MIN:MAX range")
    cfg = load_config(args.config) if args.config is not None else app_config({})
    if args.replicas is not None and cfg.get("autoscaling"):
        raise ConfigError(
            f"--replicas: config.autoscaling ({args.config}) sets the engine replicas; give --autoscaling MIN:MAX "
            "instead, or remove autoscaling from the config"
        )
    for flag, key in (
        ("replicas", "replicas"),
        ("policy", "policy"),
        ("host", "host"),
        ("port", "port"),
        ("proxy", "proxy"),
        ("address", "address"),
        ("tool_call_parser", "tool_call_parser"),
    ):
        if getattr(args, flag) is not None:
            cfg[key] = getattr(args, flag)
    eng = dict(cfg["engine"])
    for flag, key in (("model", "model"), ("block_size", "block_size"), ("max_model_len", "max_model_len")):
        if getattr(args, flag) is not None:
            eng[key] = getattr(args, flag)
    cfg["engine"] = eng
    if args.autoscaling is not None:
        lo, hi = (int(n) for n in args.autoscaling.split(":"))
        cfg["autoscaling"] = {**(cfg.get("autoscaling") or {}), "min_replicas": lo, "max_replicas": hi}
        cfg.pop("replicas", None)  # the flag sets the engine replicas: the config file's fixed count gives way
    if args.tenants and (args.api_key or args.api_key_file):  # the key would be dropped without a word
        raise ConfigError("--tenants and --api-key/--api-key-file exclude each other: keys go in the tenants file")
    api_key = supplied_api_key(args)
    if args.tenants:
        cfg["tenants_file"] = args.tenants
        cfg["api_keys"] = []
    elif api_key:  # one tenant, this key: a tenants file from the config would make the key printed useless
        cfg["api_keys"] = [api_key]
        cfg["tenants_file"] = None
        args._supplied_api_key = api_key  # the relay hands it to the driver (run)
    elif not cfg["api_keys"] and not cfg["tenants_file"]:
        cfg["api_keys"] = [new_api_key()]
        args._generated_api_key = cfg["api_keys"][0]  # new to everyone: the banner prints it once
    if cfg["engine"]["model"] != "tiny":
        from pathlib import Path

        if not Path(cfg["engine"]["model"]).is_dir():
            raise ConfigError(f"--model {cfg['engine']['model']}: not a local model directory (or 'tiny')")
    cfg = app_config(cfg)  # checks the policy, its parameters and the tenants' policies too
    if cfg["tool_call_parser"]:  # vLLM's names (loading vLLM takes seconds: only when one is named)
        from kvmesh.deployments.tool_calls import parser_names

        if cfg["tool_call_parser"] not in parser_names():
            raise ConfigError(
                f"tool_call_parser {cfg['tool_call_parser']!r} is not one of vLLM's: {', '.join(parser_names())}"
            )
    for i, key in enumerate(cfg["api_keys"]):
        where = _key_source(args) if key == api_key else f"config.api_keys[{i}]"
        _check_api_key(key, where)
    if cfg["tenants_file"]:
        _check_tenants_file(cfg["tenants_file"], "--tenants" if args.tenants else "config.tenants_file")
    return cfg


# A stand-in salt secret for the checks below: they derive no salt anyone uses (the replicas take the run's)
_CHECK_SECRET = b"validate-the-key-shape-only"


def _key_source(args) -> str:
    """Where the supplied API key came from, for its error message (see `supplied_api_key`)."""
    if args.api_key:
        return "--api-key"
    return f"--api-key-file {args.api_key_file}" if args.api_key_file else f"${API_KEY_ENV}"


def _check_api_key(key: str, where: str) -> None:
    """A key no client could send in an Authorization header (`TenantRegistry.single_key`'s rule) would lock
    every client out: refused here, named by where it came from."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import TenantRegistry

    try:
        TenantRegistry.single_key(key, secret=_CHECK_SECRET)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_tenants_file(path: str, where: str) -> None:
    """Load the tenants file as the ingress replica will (`TenantRegistry.from_file`), so that a missing,
    unreadable or malformed one stops here, not in a replica once Ray runs. The replica's salt secret comes
    from the run's environment, so a stand-in takes its place here."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import TenantRegistry

    try:
        TenantRegistry.from_file(path, secret=_CHECK_SECRET)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}".splitlines()[0]) from None


def supplied_api_key(args) -> str | None:
    """The API key the operator supplied: --api-key, else the file --api-key-file names, else (in the driver)
    the one the relay handed over, else $KVMESH_API_KEY; None when none was. Both variables leave this
    process's environment here, so Ray's processes, started from it, never carry the key."""
    handed = os.environ.pop(DRIVER_KEY_ENV, None)
    from_env = os.environ.pop(API_KEY_ENV, None)
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        return read_api_key_file(args.api_key_file)
    return handed or (from_env.strip() if from_env else None) or None  # a trailing newline is not the key's


def read_api_key_file(path: str) -> str:
    """The key in `path`: its first line, surrounding blanks dropped (a trailing newline is usual)."""
    from kvmesh.deployments.config import ConfigError

    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline().strip()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--api-key-file {path}: not UTF-8 text (byte {exc.start})") from None
    if not first:
        raise ConfigError(f"--api-key-file {path}: the file is empty, expected the API key on its first line")
    return first


def api_key_banner(key: str, generated: bool) -> str:
    """The banner's line about the key: a key kvmesh generated is printed once (no one else has it); a
    supplied one only as a short fingerprint, enough to tell which key a server runs with, since stdout
    ends up in logs and terminals the key should not."""
    if generated:
        return f"API key: {key}"
    from kvmesh.deployments.tenants import hash_api_key

    return f"API key fingerprint: sha256:{hash_api_key(key)[:12]} (the key supplied; not printed)"


def run(args) -> int:
    from kvmesh.deployments.config import ConfigError

    try:
        cfg = _build_config(args)
    except (ConfigError, ValueError, TypeError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None

    from kvmesh.deployments.supervisor import is_driver, supervise

    if not is_driver():
        from kvmesh.deployments.local_ray import NotEnoughResources, local_num_cpus
        from kvmesh.deployments.port_check import check_port_free
        from kvmesh.deployments.ray_join import address_is_here, check_reachable
        from kvmesh.deployments.salt_secret import check_usable_secret

        try:
            # a published placeholder, a short secret, a missing file stop here, not in the replicas once Ray runs
            # (a cluster joined with nodes elsewhere may hold the file on its nodes only: one this machine cannot
            # read is theirs, and KVMESH_SALT_SECRET alone cannot reach them)
            check_usable_secret(os.environ, file_is_here=not cfg["address"] or address_is_here(cfg["address"]))
            if cfg["address"]:  # a wrong or dead address fails here, not after Ray's minutes of retries
                check_reachable(cfg["address"])
            else:  # deployed onto a cluster, kvmesh binds nothing here: its Serve proxy does
                check_port_free(cfg["host"], cfg["port"])
                local_num_cpus(cfg, args.num_cpus)
        except (OSError, NotEnoughResources, ConfigError) as exc:
            raise CliError(getattr(exc, "strerror", None) or str(exc)) from None
        supplied = getattr(args, "_supplied_api_key", None)
        if supplied:  # to the driver through its environment, not its command line (`ps` shows that)
            os.environ[DRIVER_KEY_ENV] = supplied
        return supervise(["serve", *_flags(args)])
    return _drive(args, cfg)


def _flags(args) -> list[str]:
    """The command line that reproduces `args` (for the driver process)."""
    out = []
    for dest, value in vars(args).items():
        if value is not None and dest not in ("command", "api_key", "api_key_file") and not dest.startswith("_"):
            out += [f"--{dest.replace('_', '-')}", str(value)]
    return out


def salt_secret_line(path: str | None) -> str:
    """Where the replicas' salt secret comes from, as the start-up line says it: the file handed to them (the
    one kept in $KVMESH_HOME across restarts, or another), or, on a joined cluster handed none, the nodes'."""
    from kvmesh.deployments.salt_secret import FILE_NAME, kvmesh_home

    if path is None:
        return "salt secret: the cluster nodes' own (their tenants file's secret_file or environment; docs/tenants.md)"
    kept = os.path.abspath(path) == os.path.abspath(kvmesh_home() / FILE_NAME)
    return f"salt secret: {path}" + (" (kept across restarts; see docs/tenants.md)" if kept else "")


def engine_replicas_text(cfg: dict) -> str:
    """The banner's engine count: under autoscaling `replicas` is not used, so the range is what runs, as
    Serve resolves it (`config.serve_autoscaling`: Serve's defaults for the autoscaling deployments fill the
    keys the config leaves out, max_replicas 100 among them, as the CPU check and the ingress count too)."""
    if not cfg.get("autoscaling"):
        return f"{cfg['replicas']} engine replica(s)"
    from kvmesh.deployments.app import initial_engine_replicas
    from kvmesh.deployments.config import serve_autoscaling

    auto = serve_autoscaling(cfg["autoscaling"])
    start = initial_engine_replicas(cfg)
    return f"{auto.min_replicas}-{auto.max_replicas} engine replicas (autoscaling, {start} at start)"


def _drive(args, cfg: dict) -> int:
    """The Ray driver: start the app, wait for a stop signal, stop the app."""
    from kvmesh.deployments.app import (
        proxy_elsewhere,
        remove_dead_runs_files,
        remove_haproxy_dir,
        remove_run_secret_files,
        start_local,
        stop_local,
    )
    from kvmesh.deployments.local_ray import remove_ray_temp_dir
    from kvmesh.deployments.process_tree import become_subreaper, end_descendants

    become_subreaper()  # leftovers of Ray's workers stay below this process, so stop_local can end them
    stop = threading.Event()
    fast = threading.Event()
    waiting = [False]  # the main thread polls `stop` (and `fast`): a signal only has to set them

    def _stop_now() -> None:
        """The relay is gone and nobody waits for an orderly stop: end every process below this one now (an
        orderly ray.shutdown took over 10 s on a busy machine), remove what the run wrote, and leave. The
        raylet goes last: Ray's core worker in this process exits it the moment its raylet is gone, which cut
        the clean-up short."""
        import psutil

        remove_haproxy_dir()
        remove_run_secret_files()
        remove_ray_temp_dir()
        raylets = []
        for child in psutil.Process().children():
            try:
                if child.name() == "raylet":
                    raylets.append(child.pid)
            except psutil.Error:  # gone meanwhile
                pass
        end_descendants(grace_s=2.0, exclude=raylets)
        remove_dead_runs_files()  # its replicas' and LMCache servers' folders: their processes are gone now
        end_descendants(grace_s=2.0)
        os._exit(1)

    def _on_signal(signum, frame):
        if signum == signal.SIGHUP:  # the relay died: stop now, without waiting for requests in flight
            fast.set()
            if not waiting[0]:  # starting, or already stopping: nothing polls `fast`
                _stop_now()
        stop.set()

    # from the start (Ray leaves SIGHUP alone): the relay can die while the app starts. A SIGTERM during the
    # start raises SystemExit (cli.main), which start_local's clean-up and the one below unwind through
    signal.signal(signal.SIGHUP, _on_signal)
    try:  # the banner too: a config it cannot describe is a one-line error, like any failed start
        print(
            f"starting kvmesh: {engine_replicas_text(cfg)}, policy {cfg['policy']}, model {cfg['engine']['model']} ...",
            file=sys.stderr,
            flush=True,
        )
        url = start_local(cfg, num_cpus=args.num_cpus, address=args.address)
    except Exception as exc:
        stop_local()
        raise CliError(f"could not start the app: {start_failure(exc)}") from None
    except BaseException:  # a stop signal during the start (SystemExit, KeyboardInterrupt)
        stop_local(drain=False)
        raise
    # after ray.init: Ray installs its own fatal-signal handler (logs and aborts on SIGTERM); ours wins
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    print(f"kvmesh serving at {url}/v1  (model: {cfg['engine']['model']})")
    head = proxy_elsewhere()
    if head:  # Serve's one HTTP proxy runs on the joined cluster's head node, not on this machine
        print(f"the URL is the Ray head node's ({head}): Serve's HTTP proxy runs there, not on this machine")
    if cfg["api_keys"]:
        key = cfg["api_keys"][0]
        print(api_key_banner(key, generated=key == getattr(args, "_generated_api_key", None)))
    else:
        print(f"API keys: from {cfg['tenants_file']}")
    print(salt_secret_line(os.environ.get("KVMESH_SALT_SECRET_FILE")))
    print(f"metrics: {url}/metrics   stop: Ctrl-C", flush=True)
    waiting[0] = True
    try:
        while not stop.wait(0.5):
            pass
    finally:
        waiting[0] = False
        print("shutting down ...", file=sys.stderr, flush=True)
        if fast.is_set():
            _stop_now()
        stop_local()
    return 0
