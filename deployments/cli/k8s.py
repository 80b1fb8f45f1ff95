"""`kvmesh k8s render`: write the kvmesh serving config into the RayService's serveConfigV2.

The manifest's Serve config is generated, never edited by hand: `deploy_plan.serve_deploy_config` is the
builder, the same validation as `kvmesh serve --config`. Render also refuses a config the manifest could not
run (`deploy_plan.kuberay_problems`): keys KubeRay sets elsewhere, credentials that serveConfigV2 would
publish, deployments that fit no pod, files a pod does not mount. `--check` changes nothing and exits 1 when
the manifest is out of date (for CI and review).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvmesh.deployments.cli import CliError

DEFAULT_CONFIG = "k8s/config/kvmesh.yaml"
DEFAULT_MANIFEST = "k8s/rayservice.yaml"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="k8s_command", required=True)
    p = sub.add_parser("render", help="write the serving config into the RayService manifest's serveConfigV2")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"kvmesh serving config YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--manifest", default=DEFAULT_MANIFEST, help=f"RayService manifest (default {DEFAULT_MANIFEST})")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the manifest is out of date")


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"{path} is not UTF-8 text (byte {exc.start})") from None


def _yaml_documents(path: str | Path, text: str) -> list[Any]:
    import yaml

    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise CliError(f"{path} is not valid YAML: {exc}".splitlines()[0]) from None
    except RecursionError:  # collections nested deeper than the YAML reader recurses
        raise CliError(f"{path}: YAML nested too deeply to read") from None


def _config(path: str | Path) -> dict:
    docs = _yaml_documents(path, _read_text(path))
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise CliError(f"{path} must be one mapping of kvmesh config keys")
    return docs[0]


def _rayservice(path: str | Path, text: str) -> dict:
    services = [d for d in _yaml_documents(path, text) if isinstance(d, dict) and d.get("kind") == "RayService"]
    if len(services) != 1:
        raise CliError(f"{path} must hold one RayService, found {len(services)}")
    return services[0]


def rendered_manifest(config_path: str | Path, manifest_path: str | Path) -> tuple[str, str]:
    """(the manifest as it is, the manifest with its serveConfigV2 rendered from the config)."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.deploy_plan import kuberay_problems, render_serve_config, replace_block

    raw = _config(config_path)
    manifest = _read_text(manifest_path)
    service = _rayservice(manifest_path, manifest)
    try:
        serve_config = render_serve_config(raw)
    except ConfigError as exc:
        raise CliError(f"{config_path}: {exc}") from None
    except RecursionError:  # read, but nested deeper than the config checks and the YAML writer recurse
        raise CliError(f"{config_path}: values nested too deeply to render") from None
    try:
        problems = kuberay_problems(raw, service)
    except (KeyError, TypeError, ValueError, ArithmeticError, RecursionError) as exc:
        # a manifest without the pod fields KubeRay requires, or with sizes no pod has (1e999 CPUs)
        raise CliError(f"{manifest_path}: not a RayService kvmesh can check ({type(exc).__name__}: {exc})") from None
    if problems:
        raise CliError(f"{config_path} cannot run on {manifest_path}: {'; '.join(problems)}")
    try:
        return manifest, replace_block(manifest, "serveConfigV2", serve_config)
    except ValueError as exc:
        raise CliError(f"{manifest_path}: {exc}") from None


def run(args) -> int:
    if args.k8s_command != "render":
        raise CliError(f"unknown k8s command {args.k8s_command!r}")
    current, wanted = rendered_manifest(args.config, args.manifest)
    if args.check:
        if current != wanted:
            print(f"{args.manifest} is out of date: run `kvmesh k8s render`", file=sys.stderr)
            return 1
        print(f"{args.manifest} is up to date")
        return 0
    if current != wanted:
        Path(args.manifest).write_text(wanted)
        print(f"wrote serveConfigV2 of {args.manifest} from {args.config}")
    else:
        print(f"{args.manifest} already up to date")
    return 0
