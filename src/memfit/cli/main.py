"""``memfit``: the command line. One file per subcommand; this one parses and maps errors.

Every command prints text for people, or one JSON object with ``--json``; progress goes to
stderr. Errors print one line to stderr (``--debug`` adds the traceback) and exit with the code
of their class (``EXIT_CODES``, listed in ``memfit --help``); with ``--json`` they also print
one JSON object on stdout, ``{"kind": "memfit.Error", "error": {"type", "message",
"exit_code", ...}}``. A value that starts with ``-`` (``--budget -5%``) reaches the option's
own parser, which says what is wrong with it (NOTE [values that start with a dash]).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from memfit.cli import demo, doctor, plan, profile, sweep, verify
from memfit.cli.exits import (
    EXIT_BAD_INPUT,
    EXIT_CODES,
    EXIT_INFEASIBLE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    error_object,
    exit_code_for,
)
from memfit.errors import InfeasibleBudget, ModelError, UnsupportedTorch

__all__ = ["main", "build_parser", "exit_code_for", "error_object", "EXIT_CODES", "EXIT_OK",
           "EXIT_VERIFY_FAILED", "EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_INTERNAL", "EXIT_INTERRUPTED"]

EPILOG = """\
exit codes (one per kind of error; with --json, every error also prints one JSON object
{"kind": "memfit.Error", "error": {"type", "message", "exit_code", ...}} on stdout):
  0  success (and, for verify/demo, every check passed)
  1  verification failed: a verify/demo check failed (gradients, buffers or peak memory
     differ from what was promised), or a recomputation diverged (RecomputeMismatch)
  2  bad input: a usage error (unknown option or model, unparseable shape, budget or value),
     a model that raises or has nothing to differentiate (ModelError), an unreadable or
     corrupt file (SchemaError, OSError), a plan made for another model or input shape
     (PlanMismatch, ProfileMismatch), a module checkpointed by hand (WrapError), an
     unsupported torch (UnsupportedTorch), a ValueError, TypeError or ImportError
  3  no plan: an infeasible budget (InfeasibleBudget; the message and JSON name the smallest
     feasible peak), or --solver milp found none in its time limit (SolverTimeout)
  4  internal error: any other exception, a bug in memfit (rerun with --debug)
  130  interrupted (Ctrl-C)

MODEL is a zoo model with options (gpt, gpt:n_layer=4,d_model=128,batch=4; also unet3d,
resnet), package.module:factory (a function returning a module, or (module, inputs); give
--input-shape for a bare module, e.g. 8,3,224,224, 8x3x224x224 or "8 3 224 224"), or a
Hugging Face config.json (planned on the meta device in fake mode, no weights needed).

examples:
  memfit demo
  memfit doctor                      (what memfit can do on this torch and device)
  memfit plan gpt:n_layer=4 --budget 60% -o plan.json
  memfit verify gpt:n_layer=4 --plan plan.json
  memfit plan llama-config.json --budget 40GiB --target h100
"""


class _UsageExit(Exception):  # noqa: N818 - internal signal: argparse rejected the command line
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2), raised to ``main`` so
    that ``--json`` can print it as an error object too."""

    def error(self, message: str) -> NoReturn:
        raise _UsageExit(self.prog, message)


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
    for mod in (demo, profile, plan, sweep, verify, doctor):
        mod.add_parser(subs, common)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``memfit`` command line; returns the exit code."""
    try:
        parser = build_parser()
    except UnsupportedTorch as e:  # a torch outside the range: one line, not a traceback
        print(f"memfit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args_in = attach_dash_values(list(sys.argv[1:] if argv is None else argv), parser)
    want_json = "--json" in args_in[: args_in.index("--")] if "--" in args_in else "--json" in args_in
    try:
        args = parser.parse_args(args_in)
    except _UsageExit as e:
        print(f"{e.prog}: error: {e.message} (see {e.prog} --help)", file=sys.stderr)
        if want_json:
            _print_json(error_object("UsageError", e.message, EXIT_BAD_INPUT))
        return EXIT_BAD_INPUT
    debug = bool(getattr(args, "debug", False))
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not debug:  # fake mode logs a traceback for a failing op; the one-line error says it all
        from memfit._torch import FAKE_TENSOR_LOGGER

        logging.getLogger(FAKE_TENSOR_LOGGER).setLevel(logging.CRITICAL)
    prog = f"memfit {args.command}"
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        if args.json:
            _print_json(error_object("KeyboardInterrupt", "interrupted", EXIT_INTERRUPTED))
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug:
            traceback.print_exc()
        code = exit_code_for(e)
        line, extra = _describe(e, code, args)
        print(f"{prog}: {line}", file=sys.stderr)
        if args.json:
            _print_json(error_object(type(e).__name__, line.partition("error: ")[2], code, **extra))
        return code


def _describe(e: Exception, code: int, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The one-line message of ``e`` (after ``memfit CMD: ``) and the JSON object's extras."""
    if isinstance(e, InfeasibleBudget) and e.memory is not None:  # a whole job: the breakdown
        return (f"error: {e}", {"budget_bytes": e.budget_bytes,
                                "min_feasible_bytes": e.min_feasible_bytes,
                                "memory": e.memory.to_dict(), "fits_with": list(e.fits_with)})
    if isinstance(e, InfeasibleBudget):
        from memfit.units import format_bytes

        return (f"error: infeasible budget {format_bytes(e.budget_bytes)}: the smallest feasible "
                f"peak is {format_bytes(e.min_feasible_bytes)} ({e.min_feasible_bytes} bytes); "
                f"try --budget {e.min_feasible_bytes} or --budget min",
                {"budget_bytes": e.budget_bytes, "min_feasible_bytes": e.min_feasible_bytes})
    if isinstance(e, ModelError):  # the user's model raised: bad input, not a bug in memfit
        model = getattr(args, "model", None)
        return f"error: {f'model {model}: ' if model else ''}{_first_line(e)}", {"model": e.model}
    if code == EXIT_INTERNAL:
        return (f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
                {})
    if code == EXIT_BAD_INPUT:
        return f"error: {_first_line(e)}", {}
    return f"error: {type(e).__name__}: {e}", {}


def _print_json(data: dict[str, Any]) -> None:
    print(json.dumps(data, indent=1))


def attach_dash_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``["--budget", "-5%"]`` -> ``["--budget=-5%"]`` for every option that takes a value.

    NOTE [values that start with a dash]
        argparse reads a word that starts with ``-`` after an option as another option
        unless it looks like a negative number, so ``--budget -5%`` (or ``--input-shape
        -4,3``) fails with a bare "expected one argument". Joined to its option with ``=``, the
        value reaches the option's own parser, which names what is wrong with it (a budget
        must be positive, a size must be a positive integer). A word that is itself an option
        of memfit (``--budget --json``) is left alone: the value is missing, and argparse says so.
    """
    takes_value, known = _option_strings(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return out + argv[i:]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (word in takes_value and nxt is not None and nxt.startswith("-") and len(nxt) > 1
                and nxt.split("=", 1)[0] not in known):
            out.append(f"{word}={nxt}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def _option_strings(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """The option strings that take one value, and every option string, of ``parser`` and its
    subcommands."""
    takes_value: set[str] = set()
    known: set[str] = set()
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in p._actions:  # argparse has no public list of a parser's actions
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
                continue
            known.update(action.option_strings)
            if action.option_strings and action.nargs is None:
                takes_value.update(action.option_strings)
    return takes_value, known


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
