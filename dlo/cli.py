"""The ``dlo`` command: ``dlo run`` (the main job, :mod:`dlo.commands.run`), ``dlo bench``
(:mod:`dlo.bench`), ``dlo save-checkpoint`` and ``dlo save-pipeline`` (:mod:`dlo.commands.save`). ``dlo`` alone
prints this help; ``dlo --version`` the versions of dlo and torch."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import torch

from dlo.commands import run as run_command
from dlo.commands import run_flags
from dlo.commands import save as save_command

logger = logging.getLogger(__name__)


class _FORMAT(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help already says it in words
    (``--tokens``: "(default: the preset's)", not "(default: None)" after it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "(default:" in help_text:
            return help_text
        return super()._get_help_string(action)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _FORMAT)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # one clear line, no traceback, exit 2
        raise _UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from dlo import __version__
    from dlo.bench.flags import add_arguments as add_bench_arguments

    p = _Parser(
        prog="dlo",
        description="Distributed layerwise offload: run diffusion transformers whose weights "
        "do not fit in device memory by streaming blocks from host memory. Start with "
        "`dlo run --check` (a tiny demo pipeline, checked bit for bit against a resident run).",
    )
    p.add_argument(
        "--version", action="version", version=f"dlo {__version__} (torch {torch.__version__})"
    )
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    run_flags.add_arguments(
        sub.add_parser(
            "run", help="run the demo pipeline, or a pipeline folder (--pipeline), under a strategy"
        )
    )
    add_bench_arguments(
        sub.add_parser("bench", help="benchmark dlo against peers and the measured limits")
    )
    save_command.add_arguments(
        sub.add_parser("save-checkpoint", help="save the demo pipeline as safetensors")
    )
    save_command.add_pipeline_arguments(
        sub.add_parser(
            "save-pipeline", help="write a random-weight diffusers pipeline folder (real layout)"
        )
    )
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        if args.command == "bench":
            from dlo.bench.runner import check_args
            from dlo.bench.runner import main as bench_main
            from dlo.parallel.groups import init, shutdown

            check_args(args)  # before the process group and any measurement
            init()
            rc = bench_main(args)
            shutdown()
            return rc
        if args.command == "save-checkpoint":
            return save_command.save(args)
        if args.command == "save-pipeline":
            return save_command.save_pipeline(args)
        return run_command.run(args, _defaults(parser, "run"))
    except _UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"dlo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # what was being written was removed on the way out (see [Note: writing files] in
        # dlo.io.files): one line instead of a traceback
        print("dlo: interrupted", file=sys.stderr)
        return 130


def _defaults(parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """The defaults of ``command``'s flags (to tell which flags were given)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[command]
            return {a.dest: a.default for a in sub._actions}
    raise KeyError(command)
