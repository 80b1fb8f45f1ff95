"""Where the tiny model may be built: a new or empty folder, or over an earlier tiny-model build (its stamp
says so), never over a folder of other files, which the build would delete, and never at a path that is not
UTF-8, where the tokenizer's save failed at the end of the build with a traceback."""

from __future__ import annotations

import json
import os

import pytest

from kvmesh.deployments.tiny_model import STAMP, TINY_VERSION, TinyModelError, build_tiny_model


def test_a_folder_of_other_files_is_refused_before_any_work(tmp_path):
    target = tmp_path / "mine"
    (target / "sub").mkdir(parents=True)
    (target / "notes.txt").write_text("precious")
    with pytest.raises(TinyModelError, match="not a tiny-model build"):
        build_tiny_model(target)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt", "sub"]
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no temporary build left beside it


def test_an_empty_path_and_a_file_are_refused(tmp_path):
    with pytest.raises(TinyModelError, match="empty path"):
        build_tiny_model("")
    (tmp_path / "f").write_text("x")
    with pytest.raises(TinyModelError, match="not a folder"):
        build_tiny_model(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_an_earlier_tiny_model_build_is_still_rebuilt(tmp_path):
    """`model: tiny` builds into one folder for every version (config.tiny_model_dir): an older build
    there, whatever it holds, is replaced."""
    old = tmp_path / "tiny"
    old.mkdir()
    (old / STAMP).write_text(json.dumps({"version": TINY_VERSION - 1, "seed": 0}))
    (old / "model.safetensors").write_text("old weights")
    assert build_tiny_model(old) == old.resolve()
    assert json.loads((old / STAMP).read_text()) == {"version": TINY_VERSION, "seed": 0}
    assert (old / "model.safetensors").read_bytes() != b"old weights"


def test_model_tiny_mends_kvmeshs_own_folder(tmp_path, monkeypatch):
    """`model: tiny` builds under KVMESH_HOME, a folder kvmesh owns: an interrupted build or an older layout
    there is replaced, or no app could start until someone deleted it by hand."""
    from kvmesh.deployments.config import resolve_model, tiny_model_dir
    from kvmesh.deployments.tiny_model import is_built

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    partial = tiny_model_dir()
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # a build cut short: no stamp
    assert is_built(resolve_model("tiny"))
    assert json.loads((partial / "config.json").read_text())  # the real config now


def test_a_folder_below_a_file_is_named_as_the_trouble_before_any_work(tmp_path, capsys):
    """`kvmesh model build-tiny file/sub`: the file is not a folder (it said "File exists", naming the path)."""
    from kvmesh.deployments.cli import main

    (tmp_path / "f").write_text("x")
    assert main(["model", "build-tiny", str(tmp_path / "f" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'f'} is a file, not a folder" in err, err
    assert (tmp_path / "f").read_text() == "x"


def test_a_finished_build_in_a_read_only_folder_is_kept_as_it_is(tmp_path, monkeypatch, capsys):
    """The folder check asked for a writable DIR/config.json, refusing a finished build nothing would write."""
    from kvmesh.deployments import tiny_model
    from kvmesh.deployments.cli import main

    built = tmp_path / "m"
    built.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if str(p).startswith(str(built)) else real_access(p, mode, **kw)
    )
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda out, seed=0: out)
    assert main(["model", "build-tiny", str(built)]) == 0
    assert capsys.readouterr().out.strip() == str(built)


def _not_utf8(folder) -> str:
    """A folder name in `folder` whose bytes are not UTF-8 (as a shell's $'\\xfdtiny' gives it)."""
    return os.fsdecode(os.fsencode(folder) + b"/\xfdtiny")


def test_a_path_that_is_not_utf8_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    from kvmesh.deployments.cli import main

    assert main(["model", "build-tiny", _not_utf8(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\\xfdtiny: the path is not UTF-8" in err, err
    assert list(tmp_path.iterdir()) == []  # no build, no temporary folder beside it


def test_a_kvmesh_home_that_is_not_utf8_is_refused_for_model_tiny(tmp_path, monkeypatch):
    from kvmesh.deployments.config import resolve_model

    monkeypatch.setenv("KVMESH_HOME", _not_utf8(tmp_path))
    with pytest.raises(TinyModelError, match="the path is not UTF-8"):
        resolve_model("tiny")
    assert list(tmp_path.iterdir()) == []
