"""``flashspec train-drafter --gpus N``: the same command on N GPUs of this machine, one process
each, started by torchrun (``python -m torch.distributed.run --standalone``); SPEC.md §11.3,
"Several processes". Under torchrun itself the command joins its ranks
(:func:`flashspec.training.distributed.join`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from ..checks import check_int

__all__ = ["add_gpus", "forwarded_argv", "launched", "torchrun_command"]


def add_gpus(parser: argparse.ArgumentParser) -> None:
    """Add ``--gpus N`` to ``parser`` (which it rebuilds the command line from for torchrun)."""
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="train on N GPUs of this machine, one process each (started with torchrun); --batch "
                             "is the batch of all of them and must be divisible by N (default: this process alone)")
    parser.set_defaults(launch_parser=parser)


def forwarded_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, leave_out: tuple[str, ...] = ("gpus",)
                   ) -> list[str]:
    """The options of ``args`` as a command line that ``parser`` reads back into the same values,
    without the options whose destinations are in ``leave_out``; options left at their default are
    left out."""
    argv: list[str] = []
    for action in parser._actions:  # argparse keeps its actions here; there is no public accessor
        if not action.option_strings or action.dest in leave_out or isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default and not action.required:
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                argv += [flag, str(item)]
        elif action.nargs == "?" and value == action.const:
            argv.append(flag)
        elif action.nargs is None or action.nargs == "?":
            argv += [flag, str(value)]
        else:
            raise ValueError(f"{flag} takes {action.nargs!r} values: it cannot be forwarded to torchrun.")
    return argv


def torchrun_command(gpus: int, argv: list[str], command: str = "train-drafter") -> list[str]:
    """torchrun running ``flashspec COMMAND ARGV`` as ``gpus`` processes of this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
            "-m", "flashspec", command, *argv]


def launched(args: argparse.Namespace, visible: int | None = None) -> bool:
    """Run ``flashspec train-drafter`` under torchrun on ``--gpus`` GPUs and return True once it
    ended well; False when this process trains itself (no ``--gpus``, or ``--gpus 1``).
    ``visible``: the CUDA GPUs there are (None: as torch counts them). A failed run, or options
    that cannot run on that many GPUs, is a ``ValueError``."""
    gpus: Any = getattr(args, "gpus", None)
    if gpus is None:
        return False
    check_int("--gpus", gpus, 1)
    from ..training.distributed import under_torchrun

    if under_torchrun():
        raise ValueError("--gpus N starts torchrun itself; under torchrun leave --gpus out (each process is one rank).")
    if args.batch % gpus:
        raise ValueError(f"--batch {args.batch} is the batch of all {gpus} GPUs together: it must be divisible by "
                         f"--gpus {gpus}.")
    if args.device is not None and args.device != "cuda":
        raise ValueError(f"--gpus trains on CUDA GPUs (each process on its own); leave --device out or give "
                         f"--device cuda, not {args.device!r}.")
    if visible is None:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > visible:
        raise ValueError(f"--gpus {gpus}: this machine has {visible} CUDA GPU{'s' * (visible != 1)} "
                         "(CUDA_VISIBLE_DEVICES counts).")
    if gpus == 1:
        return False
    command = torchrun_command(gpus, forwarded_argv(args.launch_parser, args))
    print(" ".join(command), flush=True)
    code = subprocess.run(command, check=False).returncode
    if code:
        raise ValueError(f"Training on {gpus} GPUs failed: torchrun exited with code {code} (the processes' errors "
                         "are above); a checkpoint that was in --out before is left as it was.")
    return True
