"""`kvmesh model build-tiny DIR`: build the embedded default model (see deployments/tiny_model.py)."""

from __future__ import annotations

from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import output_folder


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True)
    p = sub.add_parser("build-tiny", help="build the tiny random-weight Llama with a locally trained tokenizer")
    p.add_argument("dir", type=output_folder("config.json"), help="output directory (a Hugging Face model directory)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> same bytes)")


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
