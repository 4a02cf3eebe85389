"""``memfit doctor``: what memfit can do on this torch and device (``memfit.capabilities()``)."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.exits import EXIT_OK
from memfit.cli.output import emit

__all__ = ["add_parser", "run"]


def add_parser(subs: Any, common: argparse.ArgumentParser) -> None:
    p = subs.add_parser("doctor", parents=[common], help="what memfit can do on this torch and device",
                        description="Print one row per feature that the installed torch release or "
                                    "the device decides: full, degraded (how) or refused (which "
                                    "torch release has it). The same rows as memfit.capabilities().")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.torch_support.capabilities import capabilities

    caps = capabilities()
    emit(args, str(caps), {"kind": "memfit.Capabilities", **caps.to_dict()})
    return EXIT_OK
