"""`kvmesh model build-tiny DIR`: build the embedded default model (see deployments/tiny_model.py)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import existing_folder_above, int_up_to
from kvmesh.deployments.tiny_model import MAX_SEED


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True)
    p = sub.add_parser("build-tiny", help="build the tiny random-weight Llama with a locally trained tokenizer")
    p.add_argument("dir", type=_model_folder, help="output directory (a Hugging Face model directory)")
    p.add_argument(
        "--seed",
        type=int_up_to(MAX_SEED, minimum=0),
        default=0,
        help=f"weight seed, 0 to {MAX_SEED} (same seed -> same bytes)",
    )


def _model_folder(text: str) -> str:
    """Where the model may be built (argparse type): a new folder's build is made beside it (in its parent,
    which must be a folder that can be written) and renamed into place. An existing folder is the build's to
    judge: a finished build there is kept as it is, read-only or not. A path below a file names the file."""
    import argparse
    import os

    if not text:
        raise argparse.ArgumentTypeError("empty path: name a folder")
    if os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    if os.path.isdir(text):
        return text
    parent = existing_folder_above(text, Path(text).absolute().parent)  # the build makes the rest
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot be written here ({parent} is read-only)")
    return text


def run(args) -> int:
    from kvmesh.deployments.tiny_model import TinyModelError, build_tiny_model

    if args.model_command == "build-tiny":
        try:
            path = build_tiny_model(args.dir, seed=args.seed)
        except TinyModelError as exc:
            raise CliError(f"kvmesh model build-tiny: {exc}") from None
        except OSError as exc:
            raise CliError(f"cannot write the tiny model to {args.dir}: {exc.strerror or exc}") from None
        print(path)
        return 0
    raise CliError(f"unknown model command {args.model_command!r}")
