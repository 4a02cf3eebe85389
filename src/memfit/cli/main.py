"""``memfit``: the command line. One file per subcommand; this one parses and maps errors.

Every command prints text for people, or one JSON object with ``--json``; progress goes to
stderr. Errors print one line to stderr (``--debug`` adds the traceback) and exit with a code
that says what went wrong (see ``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from memfit.cli import demo, plan, profile, sweep, verify
from memfit.cli.models import UsageError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_VERIFY_FAILED", "EXIT_BAD_INPUT", "EXIT_INFEASIBLE",
           "EXIT_INTERNAL"]

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_INTERNAL = 4

EPILOG = """\
exit codes:
  0  success (and, for verify/demo, every check passed)
  1  verification failed: gradients, buffers or peak memory differ from what was promised
  2  bad input: unknown model, unparseable shape or budget, unreadable plan file, a model
     that raises or has nothing to differentiate, ...
  3  infeasible budget: no plan fits (the message names the smallest feasible peak)
  4  internal error: a bug in memfit (rerun with --debug and report the traceback)

MODEL is a zoo model with options (gpt, gpt:n_layer=4,d_model=128,batch=4; also unet3d,
resnet), package.module:factory (a function returning a module, or (module, inputs); give
--input-shape for a bare module), or a Hugging Face config.json (planned on the meta device
in fake mode, no weights needed).

examples:
  memfit demo
  memfit plan gpt:n_layer=4 --budget 60% -o plan.json
  memfit verify gpt:n_layer=4 --plan plan.json
  memfit plan llama-config.json --budget 40GiB --target h100
"""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    root = Parser(
        prog="memfit",
        description="Make a PyTorch training step fit a memory budget with gradient checkpointing: "
                    "profile, plan, apply, verify.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from memfit import __version__

    root.add_argument("--version", action="version", version=f"memfit {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    subs = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    subs.required = True
    for mod in (demo, profile, plan, sweep, verify):
        mod.add_parser(subs, common)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``memfit`` command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not debug:  # fake mode logs a traceback for a failing op; the one-line error says it all
        from memfit._torch import FAKE_TENSOR_LOGGER

        logging.getLogger(FAKE_TENSOR_LOGGER).setLevel(logging.CRITICAL)
    from memfit.errors import InfeasibleBudget, MemfitError, ModelError, PlanMismatch, SchemaError
    from memfit.units import format_bytes

    prog = f"memfit {args.command}"
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except InfeasibleBudget as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: infeasible budget {format_bytes(e.budget_bytes)}: the smallest feasible "
              f"peak is {format_bytes(e.min_feasible_bytes)} ({e.min_feasible_bytes} bytes); "
              f"try --budget {e.min_feasible_bytes} or --budget min", file=sys.stderr)
        return EXIT_INFEASIBLE
    except ModelError as e:  # the user's model raised: bad input, not a bug in memfit
        if debug:
            traceback.print_exc()
        model = getattr(args, "model", None)
        where = f"model {model}: " if model else ""
        print(f"{prog}: error: {where}{_first_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (UsageError, SchemaError, PlanMismatch, ValueError, TypeError, OSError, ImportError) as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_first_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemfitError as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except Exception as e:  # a bug: say so, and how to see the traceback
        if debug:
            traceback.print_exc()
        print(f"{prog}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
