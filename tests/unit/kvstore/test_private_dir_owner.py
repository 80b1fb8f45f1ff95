"""The dead-owner sweeps judge only owners of this pid namespace on this host: a folder or secret file another
namespace (a container sharing /tmp or KVMESH_HOME) or host (an NFS home) made names a pid that means nothing
here, and is kept even though no process here has that pid. Things of our own tag, and folders made before
the tag was written (no owner file), are judged by their pid as before."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

OWNER_TAG_FILE = ".kvmesh-owner"  # kvstore/private_dir.py's, spelled out: the tests read and write it as is
FOREIGN_TAG = "f00dcafe"


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _our_tag() -> str:
    from kvmesh.kvstore.private_dir import owner_tag

    assert owner_tag() != FOREIGN_TAG
    return owner_tag()


def _folder(root, name: str, tag: str | None):
    folder = root / name
    folder.mkdir(mode=0o700)
    if tag is not None:
        (folder / OWNER_TAG_FILE).write_text(tag)
    return folder


def test_owner_tag_is_short_hex_and_the_same_in_every_process_of_this_namespace():
    tag = _our_tag()
    assert len(tag) == 8 and int(tag, 16) >= 0
    child = subprocess.run(
        [sys.executable, "-c", "from kvmesh.kvstore.private_dir import owner_tag; print(owner_tag())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == tag


def test_another_pid_namespace_has_another_owner_tag():
    unshare = shutil.which("unshare")
    if unshare is None or not os.path.exists("/proc/self/ns/pid"):
        pytest.skip("needs unshare and /proc")
    code = "from kvmesh.kvstore.private_dir import owner_tag; print(owner_tag())"
    child = subprocess.run(
        [unshare, "--user", "--map-root-user", "--pid", "--fork", sys.executable, "-c", code],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        pytest.skip(f"no new pid namespace here: {child.stderr.strip()[-200:]}")
    assert child.stdout.strip() != _our_tag()


@pytest.mark.parametrize("prefix", ["kvmesh-engine-", "kvmesh-lmcache-", "kvmesh-ray-"])
def test_a_dead_pids_folder_is_removed_only_when_ours_or_untagged(tmp_path, prefix):
    from kvmesh.kvstore.private_dir import remove_dead_owners_dirs

    dead = _dead_pid()
    foreign = _folder(tmp_path, f"{prefix}{dead}-aaaaaaaa", FOREIGN_TAG)  # a live run in a container
    ours = _folder(tmp_path, f"{prefix}{dead}-bbbbbbbb", _our_tag())
    legacy = _folder(tmp_path, f"{prefix}{dead}-cccccccc", None)  # made before the tag was written
    alive = _folder(tmp_path, f"{prefix}{os.getpid()}-dddddddd", _our_tag())
    assert remove_dead_owners_dirs(prefix, str(tmp_path)) == 2
    assert foreign.exists() and alive.exists()
    assert not ours.exists() and not legacy.exists()


def test_a_folder_is_judged_by_the_tag_of_whoever_sweeps(tmp_path, monkeypatch):
    from kvmesh.kvstore import private_dir

    dead = _dead_pid()
    folder = _folder(tmp_path, f"kvmesh-ray-{dead}-aaaaaaaa", _our_tag())
    # a sweep in another namespace (its own tag) must leave this namespace's folder alone
    monkeypatch.setattr(private_dir, "owner_tag", lambda: FOREIGN_TAG)
    assert private_dir.remove_dead_owners_dirs("kvmesh-ray-", str(tmp_path)) == 0
    assert folder.exists()
    monkeypatch.undo()
    assert private_dir.remove_dead_owners_dirs("kvmesh-ray-", str(tmp_path)) == 1
    assert not folder.exists()


def test_the_folders_kvmesh_makes_carry_the_owner_tag_and_keep_their_names(tmp_path, monkeypatch):
    from kvmesh.deployments import local_ray
    from kvmesh.kvstore import lmcache_server

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setattr(local_ray, "RAY_TEMP_ROOT", str(tmp_path))
    monkeypatch.setattr(lmcache_server, "CHANNEL_ROOT", str(tmp_path))
    ray_folder = os.path.dirname(local_ray.new_ray_temp_dir())
    local_ray._ray_temp_dir.remove(ray_folder)
    channel = lmcache_server.new_channel_dir()
    for folder, prefix in ((ray_folder, local_ray.RAY_TEMP_PREFIX), (channel, lmcache_server.CHANNEL_PREFIX)):
        name = os.path.basename(folder)
        assert name.startswith(f"{prefix}{os.getpid()}-") and len(name) == len(f"{prefix}{os.getpid()}-") + 8
        assert os.stat(folder).st_mode & 0o777 == 0o700
        with open(os.path.join(folder, OWNER_TAG_FILE)) as fh:
            assert fh.read().strip() == _our_tag()


def test_a_haproxy_folder_of_another_namespace_is_kept(tmp_path):
    from kvmesh.deployments.app import _remove_orphaned_haproxy_dirs

    dead = _dead_pid()
    foreign = _folder(tmp_path, "kvmesh-haproxy-aaa", FOREIGN_TAG)
    ours = _folder(tmp_path, "kvmesh-haproxy-bbb", _our_tag())
    legacy = _folder(tmp_path, "kvmesh-haproxy-ccc", None)
    for folder in (foreign, ours, legacy):
        (folder / "owner.pid").write_text(str(dead))
    assert sorted(_remove_orphaned_haproxy_dirs(str(tmp_path))) == [str(ours), str(legacy)]
    assert foreign.exists()


def test_a_runs_haproxy_folder_records_its_tag_next_to_the_bare_pid(tmp_path, monkeypatch):
    import tempfile

    from kvmesh.deployments import app

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    saved = dict(os.environ)
    try:
        env = app._proxy_env("haproxy")
        run = os.path.dirname(env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"])
        with open(os.path.join(run, "owner.pid")) as fh:
            assert int(fh.read()) == os.getpid()  # what operators and tests/support read
        with open(os.path.join(run, OWNER_TAG_FILE)) as fh:
            assert fh.read().strip() == _our_tag()
    finally:
        app.remove_haproxy_dir()
        os.environ.clear()
        os.environ.update(saved)


def test_secret_files_carry_the_owner_tag_and_only_ours_are_judged(tmp_path):
    from kvmesh.cluster.secure_channel import remove_dead_owners_secret_files, write_channel_secret

    mine = write_channel_secret(tmp_path)
    prefix, pid, tag, rest = mine.name.rsplit("-", 3)
    assert (prefix, pid, tag, len(rest)) == ("channel-secret", str(os.getpid()), _our_tag(), 8)
    dead = _dead_pid()
    foreign = tmp_path / f"channel-secret-{dead}-{FOREIGN_TAG}-0123abcd"  # a live run on another host
    orphan = tmp_path / f"salt-secret-{dead}-{_our_tag()}-0123abcd"
    untagged = tmp_path / f"salt-secret-{dead}-4567cdef"  # never shipped: not ours to judge
    for path in (foreign, orphan, untagged):
        path.write_text("s" * 64)
    assert remove_dead_owners_secret_files(tmp_path) == 1
    assert mine.exists() and foreign.exists() and untagged.exists() and not orphan.exists()
