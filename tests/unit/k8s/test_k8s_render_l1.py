"""`kvmesh k8s render` refuses an LMCache L1 (`engine.lmcache.l1_size_gb`, GiB) that is not below the memory
limit of the pods the engines land on: the node's LMCache server holds its L1 in that pod's memory, and it
rendered an L1 of 200 GiB onto pods limited to 160Gi."""

from __future__ import annotations

import pytest
import yaml
from paths import REPO_ROOT

from kvmesh.deployments.cli import main

K8S = REPO_ROOT / "k8s"
GPU_MEMORY = "memory: 160Gi"  # the GPU worker group's request and limit in the repository's manifest


@pytest.fixture
def files(tmp_path):
    config = tmp_path / "kvmesh.yaml"
    manifest = tmp_path / "rayservice.yaml"
    config.write_text((K8S / "config" / "kvmesh.yaml").read_text())
    manifest.write_text((K8S / "rayservice.yaml").read_text())
    return config, manifest


def _l1(config, size) -> None:
    raw = yaml.safe_load(config.read_text())
    raw["engine"]["lmcache"]["l1_size_gb"] = size
    config.write_text(yaml.safe_dump(raw))


def _gpu_memory(manifest, quantity: str) -> None:
    text = manifest.read_text()
    assert text.count(GPU_MEMORY) == 2
    manifest.write_text(text.replace(GPU_MEMORY, f"memory: {quantity}"))


def _render(files, capsys) -> tuple[int, str]:
    config, manifest = files
    rc = main(["k8s", "render", "--config", str(config), "--manifest", str(manifest)])
    return rc, capsys.readouterr().err


def _refused(files, capsys) -> str:
    before = files[1].read_text()
    rc, err = _render(files, capsys)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert files[1].read_text() == before
    return err


@pytest.mark.parametrize("size", [200, 160])
def test_an_l1_at_or_above_the_engine_pods_memory_limit_is_refused(files, capsys, size):
    _l1(files[0], size)
    err = _refused(files, capsys)
    assert f"engine.lmcache.l1_size_gb {size} GiB" in err and "gpu-engines" in err and "160Gi" in err, err


def test_an_l1_below_the_limit_renders(files, capsys):
    _l1(files[0], 159)
    assert _render(files, capsys)[0] == 0


@pytest.mark.parametrize(
    ("limit", "size", "fits"),
    [
        (str(160 * 2**30), 160, False),  # plain bytes: 160 GiB exactly
        (str(160 * 2**30 + 1), 160, True),
        ("160G", 150, False),  # G is 10**9: 149.0 GiB
        ("172G", 160, True),  # 160.2 GiB
        ("163840Mi", 160, False),
        ("167772161Ki", 160, True),
        ("180000M", 167, True),  # 167.6 GiB
        ("1.6e11", 150, False),  # 149.0 GiB
    ],
)
def test_the_limit_is_read_in_kubernetes_units(files, capsys, limit, size, fits):
    _gpu_memory(files[1], limit)
    _l1(files[0], size)
    if fits:
        assert _render(files, capsys) == (0, "")
    else:
        assert "not below the memory limit" in _refused(files, capsys)


def test_quantity():
    from kvmesh.deployments.deploy_plan import quantity

    assert quantity("160Gi") == 160 * 2**30
    assert quantity("1k") == 1000 and quantity("1Ki") == 1024
    assert quantity("2M") == 2e6 and quantity("2Mi") == 2 * 2**20
    assert quantity(1048576) == 2**20 and quantity("1E3") == 1000 and quantity("1E") == 1e18
    assert quantity("500m") == 0.5
    assert quantity("lots") is None and quantity("1GB") is None and quantity("") is None
