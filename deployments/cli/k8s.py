"""`kvmesh k8s render`: write the kvmesh serving config into the RayService's serveConfigV2.

The manifest's Serve config is generated, never edited by hand: `deploy_plan.serve_deploy_config` is the
builder, the same validation as `kvmesh serve --config`. Render also refuses a config the manifest could not
run (`deploy_plan.kuberay_problems`): keys KubeRay sets elsewhere, credentials that serveConfigV2 would
publish (in the shared tier's setting, LMCache's extra arguments or the KV-transfer config), a shared tier
that cannot read the manifest's Valkey password (LMCache's valkey adapter) or pod groups for the engines of
which only some have it, a route prefix other than `/` (the PodMonitor scrapes `/metrics`), deployments that
fit no pod, an LMCache L1 not below its engine pods' memory limit, files a pod does not mount; and a manifest
whose Ray pods disagree on the Serve proxy (`RAY_SERVE_ENABLE_HA_PROXY`).
`--check` changes nothing and exits 1 when the manifest is out of date (for CI and review).

Render also writes the annotation `kvmesh.io/node-server-config` on every Ray pod template (head and worker
groups): a digest of what each node's LMCache server is created from (`node_server_digest`). A node's server
is a detached actor that keeps the settings it started with (kvstore/node_server.py), and KubeRay applies a
change of serveConfigV2 alone to the running cluster's Serve in place; a changed pod template instead makes
KubeRay prepare a new RayCluster (fresh node servers) and move traffic to it (docs/kubernetes.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvmesh.deployments.cli import CliError

DEFAULT_CONFIG = "k8s/config/kvmesh.yaml"
DEFAULT_MANIFEST = "k8s/rayservice.yaml"
NODE_SERVER_ANNOTATION = "kvmesh.io/node-server-config"
PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


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


def node_server_digest(config: Mapping[str, Any]) -> str:
    """A digest of what every node's LMCache server is created from: the engine's `lmcache` settings as the
    config spells them (kvstore/node_server.py makes the server from them; its code and environment are the
    pod template's image and env, which KubeRay compares itself)."""
    engine = config.get("engine") or {}
    lmcache = engine.get("lmcache") if isinstance(engine, Mapping) else None
    text = json.dumps({"lmcache": lmcache}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pod_templates(service: Mapping[str, Any]) -> dict[str, Any]:
    """group name ("head" or a worker group's) -> its pod template, as the manifest has it."""
    from kvmesh.deployments.deploy_plan import pod_groups

    return {name: group["template"] for name, group in pod_groups(service).items()}


# the annotation's line: its value (quoted or plain) replaced, a comment after it kept
_ANNOTATION_LINE = re.compile(
    rf"^(?P<indent>[ \t]*){re.escape(NODE_SERVER_ANNOTATION)}:[ \t]*"
    r"""(?:"[^"\n]*"|'[^'\n]*'|[^\s#][^\n#]*?)?(?P<rest>[ \t]+#[^\n]*)?[ \t]*$""",
    re.MULTILINE,
)


def stamp_node_server_digest(manifest: str, digest: str) -> str:
    """`manifest` with the value of every `kvmesh.io/node-server-config:` line set to `digest` (textual, so
    comments and layout survive; `check_stamped` says whether every pod template got it)."""
    return _ANNOTATION_LINE.sub(
        lambda m: f'{m.group("indent")}{NODE_SERVER_ANNOTATION}: "{digest}"{m.group("rest") or ""}', manifest
    )


def _annotation(template: Any) -> Any:
    """The node-server annotation of a pod template (None when it has none, or no such mapping)."""
    metadata = template.get("metadata") if isinstance(template, Mapping) else None
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return annotations.get(NODE_SERVER_ANNOTATION) if isinstance(annotations, Mapping) else None


def check_stamped(service: Mapping[str, Any], digest: str, lines: int) -> list[str]:
    """Why the rendered manifest does not carry `digest` on exactly its Ray pod templates (empty when it does)."""
    templates = _pod_templates(service)
    missing = [name for name, template in templates.items() if _annotation(template) != digest]
    if missing:
        return [
            f"the pod template of {', '.join(missing)} has no annotation {NODE_SERVER_ANNOTATION}: add "
            f'an `annotations:` key under its template.metadata with the line `{NODE_SERVER_ANNOTATION}: ""` below it '
            "(block style, one key per line: render fills the value in) so "
            "that a change of engine.lmcache rolls a new RayCluster instead of leaving the old node servers"
        ]
    if lines != len(templates):
        return [f"{NODE_SERVER_ANNOTATION} appears {lines} times, but there are {len(templates)} Ray pod templates"]
    return []


def proxy_problems(service: Mapping[str, Any]) -> list[str]:
    """The Ray containers must agree on RAY_SERVE_ENABLE_HA_PROXY (Serve's proxy or its HAProxy mode), each
    setting it: one left unset would follow Ray's default, not the manifest's choice."""
    from kvmesh.deployments.deploy_plan import container_env, pod_groups

    seen = {name: container_env(group["pod"]).get(PROXY_ENV) for name, group in pod_groups(service).items()}
    if len(set(seen.values())) > 1 or None in seen.values():
        values = ", ".join(f"{name}: {'unset' if v is None else repr(v)}" for name, v in seen.items())
        return [f"the Ray containers must all set {PROXY_ENV} to the same value ({values})"]
    return []


def rendered_manifest(config_path: str | Path, manifest_path: str | Path) -> tuple[str, str]:
    """(the manifest as it is, the manifest with its serveConfigV2 rendered from the config and its pod
    templates stamped with the node servers' digest)."""
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
        problems = kuberay_problems(raw, service) + proxy_problems(service)
    except (KeyError, TypeError, ValueError, ArithmeticError, RecursionError, AttributeError, IndexError) as exc:
        # a manifest without the pod fields KubeRay requires, or with sizes no pod has (1e999 CPUs)
        raise CliError(f"{manifest_path}: not a RayService kvmesh can check ({type(exc).__name__}: {exc})") from None
    if problems:
        raise CliError(f"{config_path} cannot run on {manifest_path}: {'; '.join(problems)}")
    digest = node_server_digest(raw)
    try:
        wanted = replace_block(stamp_node_server_digest(manifest, digest), "serveConfigV2", serve_config)
    except ValueError as exc:
        raise CliError(f"{manifest_path}: {exc}") from None
    stamped = check_stamped(_rayservice(manifest_path, wanted), digest, len(_ANNOTATION_LINE.findall(wanted)))
    if stamped:
        raise CliError(f"{manifest_path}: {'; '.join(stamped)}")
    return manifest, wanted


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
        print(f"wrote serveConfigV2 and the {NODE_SERVER_ANNOTATION} annotations of {args.manifest} from {args.config}")
    else:
        print(f"{args.manifest} already up to date")
    return 0
