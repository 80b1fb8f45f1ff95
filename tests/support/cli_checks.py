"""What the CLI bad-input tests check of a refusal, and `kvmesh serve` stopped at its launch."""

from __future__ import annotations

from kvmesh.deployments.cli import main


def refused(capsys, *argv: str) -> str:
    """The command must exit 2 with one line on stderr; returns that line."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def refused_naming(argv: list[str], capsys, needle: str) -> str:
    """`refused`, with no traceback, the line saying `needle`."""
    err = refused(capsys, *argv)
    assert "Traceback" not in err and needle in err, err
    return err


def serve_launches(monkeypatch) -> list[list[str]]:
    """`kvmesh serve` up to its launch, no API key in the environment: the launches reached (none when the
    input is refused)."""
    from kvmesh.deployments import supervisor

    for name in ("KVMESH_API_KEY", "KVMESH_SERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    reached: list[list[str]] = []
    monkeypatch.setattr(supervisor, "is_driver", lambda: False)
    monkeypatch.setattr(supervisor, "supervise", lambda argv: reached.append(argv) or 0)
    return reached
