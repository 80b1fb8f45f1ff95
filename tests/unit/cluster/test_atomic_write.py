"""`whole_file.atomic_write`: an output is written whole or not at all. Written in place with open(path, "w"), a
write that failed part way (a full disk) left the file cut short, replacing an earlier good one."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from kvmesh.cluster.whole_file import atomic_write
from kvmesh.cluster.workloads import write_jsonl


def test_a_write_that_fails_leaves_the_earlier_file_and_no_temporary_one(tmp_path):
    out = tmp_path / "o.json"
    out.write_text("earlier")
    with pytest.raises(OSError, match="No space"):
        with atomic_write(out) as fh:
            fh.write("x" * 100_000)
            fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
    assert out.read_text() == "earlier"
    assert os.listdir(tmp_path) == ["o.json"]


def test_an_interrupt_leaves_no_file_where_there_was_none(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(tmp_path / "new" / "o.png", "wb") as fh:
            fh.write(b"\x89PNG")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path / "new") == []


def test_a_write_that_ends_replaces_the_file_keeping_its_permissions(tmp_path):
    out = tmp_path / "o.json"
    out.write_text("earlier")
    out.chmod(0o640)
    with atomic_write(out) as fh:
        fh.write("later")
    assert out.read_text() == "later"
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["o.json"]


def test_a_link_is_followed_and_kept(tmp_path):
    (tmp_path / "real.json").write_text("earlier")
    (tmp_path / "link.json").symlink_to("real.json")
    with atomic_write(tmp_path / "link.json") as fh:
        fh.write("later")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "later"


def test_a_device_is_written_in_place():
    """Replacing /dev/null would put a file where the device was (and fail without the rights to)."""
    with atomic_write(os.devnull) as fh:
        fh.write("gone")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_write_jsonl_that_fails_part_way_leaves_the_earlier_trace(tmp_path):
    out = tmp_path / "t.jsonl"
    out.write_text('{"earlier": 1}\n')

    def records():
        yield {"timestamp": 0}
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_jsonl(records(), out)
    assert out.read_text() == '{"earlier": 1}\n'
    assert os.listdir(tmp_path) == ["t.jsonl"]
