"""The secret files every Ray pod mounts (salt and channel secrets) are readable by the Ray processes and by
no other user of the container.

Kubelet writes a secret volume's files owned by root, with the volume's defaultMode (0644 when unset), and
with the pod's securityContext.fsGroup as their group when one is set (root's group otherwise). The Ray
processes run as the image's user: `ray`, uid 1000, primary group 100 ("users") in rayproject/ray images,
which k8s/Dockerfile builds on without changing the user.
"""

from __future__ import annotations

import pytest
import yaml
from paths import REPO_ROOT

K8S = REPO_ROOT / "k8s"
RAY_UID, RAY_GROUPS = 1000, {100}
OTHER_UID, OTHER_GROUPS = 2000, {2000}  # any other user of the container
SECRET_VOLUMES = ("salt", "channel")


def _pods() -> list[tuple[str, dict]]:
    svc = yaml.safe_load((K8S / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    out = [("head", svc["headGroupSpec"]["template"]["spec"])]
    return out + [(g["groupName"], g["template"]["spec"]) for g in svc["workerGroupSpecs"]]


def secret_file(pod: dict, volume: str) -> tuple[int, int, int]:
    """(owner uid, group gid, mode) of the files kubelet writes for a secret volume of the pod."""
    source = next(v for v in pod["volumes"] if v["name"] == volume)["secret"]
    group = (pod.get("securityContext") or {}).get("fsGroup", 0)
    return 0, group, source.get("defaultMode", 0o644)


def can_read(uid: int, groups: set[int], file: tuple[int, int, int]) -> bool:
    owner, group, mode = file
    if uid == owner:
        return bool(mode & 0o400)
    if group in groups:
        return bool(mode & 0o040)
    return bool(mode & 0o004)


def test_the_image_runs_as_the_ray_images_user():
    dockerfile = (K8S / "Dockerfile").read_text().splitlines()
    assert next(line for line in dockerfile if line.startswith("FROM ")).startswith("FROM rayproject/ray:")
    assert not [line for line in dockerfile if line.startswith("USER ")]
    for _, pod in _pods():
        for context in [pod.get("securityContext") or {}] + [c.get("securityContext") or {} for c in pod["containers"]]:
            assert context.get("runAsUser", RAY_UID) == RAY_UID
            assert context.get("runAsGroup", 100) in RAY_GROUPS


@pytest.mark.parametrize("volume", SECRET_VOLUMES)
def test_the_ray_processes_read_the_secret_files(volume):
    for group, pod in _pods():
        assert can_read(RAY_UID, RAY_GROUPS, secret_file(pod, volume)), f"{group}: Ray cannot read {volume}"


@pytest.mark.parametrize("volume", SECRET_VOLUMES)
def test_no_other_user_reads_the_secret_files(volume):
    for group, pod in _pods():
        assert not can_read(OTHER_UID, OTHER_GROUPS, secret_file(pod, volume)), f"{group}: {volume} is world-readable"
