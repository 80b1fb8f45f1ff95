"""`kvmesh k8s render`: write the kvmesh serving config into the RayService's serveConfigV2.

The manifest's Serve config is generated, never edited by hand: `deploy_plan.serve_deploy_config` is the
builder, the same validation as `kvmesh serve --config`. `--check` changes nothing and exits 1 when the
manifest is out of date (for CI and review).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvmesh.deployments.cli import CliError

DEFAULT_CONFIG = "k8s/config/kvmesh.yaml"
DEFAULT_MANIFEST = "k8s/rayservice.yaml"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="k8s_command", required=True)
    p = sub.add_parser("render", help="write the serving config into the RayService manifest's serveConfigV2")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"kvmesh serving config YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--manifest", default=DEFAULT_MANIFEST, help=f"RayService manifest (default {DEFAULT_MANIFEST})")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the manifest is out of date")


def rendered_manifest(config_path: str | Path, manifest_path: str | Path) -> tuple[str, str]:
    """(the manifest as it is, the manifest with its serveConfigV2 rendered from the config)."""
    import yaml

    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.deploy_plan import render_serve_config, replace_block

    try:
        raw = yaml.safe_load(Path(config_path).read_text())
        manifest = Path(manifest_path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CliError(f"{config_path} is not valid YAML: {exc}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise CliError(f"{config_path} must be a mapping of kvmesh config keys")
    try:
        return manifest, replace_block(manifest, "serveConfigV2", render_serve_config(raw))
    except ConfigError as exc:
        raise CliError(f"{config_path}: {exc}") from None
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
