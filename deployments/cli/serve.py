"""`kvmesh serve`: start Ray (or join RAY_ADDRESS), deploy the kvmesh app, print URL + API key, and
shut down cleanly on Ctrl-C / SIGTERM.

Flags override the config file (`--config FILE`, the same YAML the Serve app builder takes).
"""

from __future__ import annotations

import signal
import sys
import threading

from kvmesh.deployments.cli import CliError


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="serving config YAML (deployments/config.py); flags override it")
    parser.add_argument("--model", help="'tiny' (built locally) or a local Hugging Face model directory")
    parser.add_argument("--replicas", type=int, help="engine replicas (default 2)")
    parser.add_argument("--policy", help="placement policy (kvmesh.policies.registry; default kvmesh)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000; 0 = pick a free one)")
    parser.add_argument("--api-key", help="the API key clients must send (default: a generated one)")
    parser.add_argument("--tenants", help="tenants file (YAML/TOML/JSON, deployments/tenants.py) instead of --api-key")
    parser.add_argument("--block-size", type=int, help="engine KV block size (multiple of 32 on CPU)")
    parser.add_argument("--max-model-len", type=int, help="engine context length")
    parser.add_argument("--num-cpus", type=int, help="CPUs for a locally started Ray (default: all)")
    parser.add_argument(
        "--proxy",
        choices=("haproxy", "serve"),
        help="HTTP front of a locally started Ray: Serve's HAProxy mode (default) or its Python proxy",
    )


def _build_config(args) -> dict:
    from kvmesh.deployments.config import ConfigError, app_config, load_config
    from kvmesh.deployments.tenants import new_api_key

    cfg = load_config(args.config) if args.config else app_config({})
    for flag, key in (
        ("replicas", "replicas"),
        ("policy", "policy"),
        ("host", "host"),
        ("port", "port"),
        ("proxy", "proxy"),
    ):
        if getattr(args, flag) is not None:
            cfg[key] = getattr(args, flag)
    eng = dict(cfg["engine"])
    for flag, key in (("model", "model"), ("block_size", "block_size"), ("max_model_len", "max_model_len")):
        if getattr(args, flag) is not None:
            eng[key] = getattr(args, flag)
    cfg["engine"] = eng
    if args.tenants:
        cfg["tenants_file"] = args.tenants
        cfg["api_keys"] = []
    elif args.api_key:
        cfg["api_keys"] = [args.api_key]
    elif not cfg["api_keys"] and not cfg["tenants_file"]:
        cfg["api_keys"] = [new_api_key()]
    if cfg["engine"]["model"] != "tiny":
        from pathlib import Path

        if not Path(cfg["engine"]["model"]).is_dir():
            raise ConfigError(f"--model {cfg['engine']['model']}: not a local model directory (or 'tiny')")
    from kvmesh.policies.registry import POLICY_NAMES

    if cfg["policy"] not in POLICY_NAMES:
        raise ConfigError(f"--policy {cfg['policy']}: unknown; known: {', '.join(POLICY_NAMES)}")
    return app_config(cfg)


def run(args) -> int:
    from kvmesh.deployments.config import ConfigError

    try:
        cfg = _build_config(args)
    except (ConfigError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if cfg["api_keys"]:
        from kvmesh.deployments.tenants import TenantRegistry

        try:
            TenantRegistry.single_key(cfg["api_keys"][0], secret=b"validate-the-key-shape-only")
        except Exception as exc:
            raise CliError(f"--api-key: {exc}") from None

    from kvmesh.deployments.app import start_local, stop_local

    stop = threading.Event()

    def _on_signal(signum, frame):
        stop.set()

    print(
        f"starting kvmesh: {cfg['replicas']} engine replica(s), policy {cfg['policy']}, model "
        f"{cfg['engine']['model']} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        url = start_local(cfg, num_cpus=args.num_cpus)
    except Exception as exc:
        stop_local()
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CliError(f"could not start the app: {first_line}") from None
    # after ray.init: Ray installs its own fatal-signal handler (logs and aborts on SIGTERM); ours wins
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"kvmesh serving at {url}/v1  (model: {cfg['engine']['model']})")
    if cfg["api_keys"]:
        print(f"API key: {cfg['api_keys'][0]}")
    else:
        print(f"API keys: from {cfg['tenants_file']}")
    print(f"metrics: {url}/metrics   stop: Ctrl-C", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print("shutting down ...", file=sys.stderr, flush=True)
        stop_local()
    return 0
