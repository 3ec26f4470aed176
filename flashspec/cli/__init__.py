"""The ``flashspec`` command: ``generate``, ``demo``, ``calibrate`` (:mod:`~flashspec.cli.commands`),
``train-drafter``, ``distill`` (:mod:`~flashspec.cli.train`), ``export-drafter``
(:mod:`~flashspec.cli.export`), ``serve`` (:mod:`~flashspec.cli.serve`) and ``bench ...``
(:mod:`~flashspec.cli.bench`); the flags they share are in
:mod:`~flashspec.cli.options`.

Each sub-parser names its function with ``set_defaults(run=...)``; :func:`main` calls it and
turns a ``ValueError`` into a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, commands, export, serve, train

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except ValueError as error:
        print(f"flashspec: error: {error}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashspec", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_parsers(sub)
    train.add_parsers(sub)
    export.add_parsers(sub)
    bench.add_parsers(sub)
    serve.add_parsers(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
