"""`kvmesh model build-tiny`: a seed torch cannot take is refused as bad input before any work, and the
built folder can be read by users other than its builder (Ray workers may run as another user)."""

from __future__ import annotations

import os

import pytest

from kvmesh.deployments import tiny_model
from kvmesh.deployments.cli import main
from kvmesh.deployments.tiny_model import TinyModelError, build_tiny_model

MAX_SEED = 2**64 - 1  # torch.manual_seed's largest seed


@pytest.mark.parametrize("seed", [str(MAX_SEED + 1), "-1", str(-(2**70))])
def test_a_seed_outside_64_bits_is_one_line_and_exit_2(tmp_path, capsys, seed):
    """torch.manual_seed overflowed on a seed of 2**64 or more, as a traceback after the tokenizer was trained."""
    target = tmp_path / "m"
    assert main(["model", "build-tiny", str(target), "--seed", seed]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--seed" in err, err
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_the_largest_seed_reaches_the_build(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda out, seed=0: seen.append(seed) or out)
    assert main(["model", "build-tiny", str(tmp_path / "m"), "--seed", str(MAX_SEED)]) == 0
    assert seen == [MAX_SEED]


def test_the_library_refuses_such_a_seed_before_any_work(tmp_path):
    with pytest.raises(TinyModelError, match="seed"):
        build_tiny_model(tmp_path / "m", seed=MAX_SEED + 1)
    assert list(tmp_path.iterdir()) == []


def test_the_built_folder_has_the_mode_a_plain_mkdir_gives(tmp_path):
    """The build was made in a 0700 temporary folder renamed into place: Ray workers running as another
    user could not read the model."""
    old = os.umask(0o002)
    try:
        out = build_tiny_model(tmp_path / "m")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o775
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folder left beside it
