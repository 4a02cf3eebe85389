"""MODEL on the command line: the argparse glue around ``memfit.zoo.specs.load_model``.

What a MODEL spec means (zoo names, ``module:factory``, Hugging Face configs) is
``memfit.zoo.specs``'s; this module adds the shared arguments and their parsers.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.zoo.specs import (
    LoadedModel,
    ModelSpecError,
    load_model,
    parse_dtype,
    parse_shape,
    split_options,
)

__all__ = ["UsageError", "LoadedModel", "load_model", "parse_shape", "parse_dtype", "split_options",
           "add_model_arguments", "load_from_args", "budget_arg", "positive_int", "TARGETS"]

#: Bad command-line input; the CLI prints the message and exits with code 2.
UsageError = ModelSpecError

# ---- shared command-line arguments ----------------------------------------------------------
TARGETS = ("cpu", "v100", "a100", "h100", "h200")


def add_model_arguments(parser: Any, *, target: bool = False) -> None:
    """MODEL and the options that size its example inputs (shared by every subcommand)."""
    parser.add_argument("model", metavar="MODEL",
                        help="zoo name with options (gpt:n_layer=4,batch=2), package.module:factory, "
                             "or a Hugging Face config.json")
    parser.add_argument("--input-shape", action="append", type=_shape_arg, metavar="SHAPE",
                        help="shape of a random example input for a module:factory model: "
                             "2,3,32,32, 2x3x32x32 or \"2 3 32 32\" (repeat for several inputs)")
    parser.add_argument("--dtype", type=_dtype_arg, help="dtype of those inputs (default float32); "
                        "for a Hugging Face config, the parameter dtype")
    parser.add_argument("--batch", type=positive_int, help="batch of a Hugging Face config's token ids (default 1)")
    parser.add_argument("--seq-len", type=positive_int,
                        help="sequence length for a Hugging Face config (default its context, at most 4096)")
    if target:
        parser.add_argument("--target", choices=TARGETS, default="cpu",
                            help="plan for this device with the fake-mode cost model (default cpu: "
                                 "measure a real step here)")


def load_from_args(args: Any) -> LoadedModel:
    return load_model(args.model, input_shapes=args.input_shape, dtype=args.dtype, batch=args.batch,
                      seq_len=args.seq_len)


def _shape_arg(text: str) -> tuple[int, ...]:
    import argparse

    try:
        return parse_shape(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype_arg(text: str) -> torch.dtype:
    import argparse

    try:
        return parse_dtype(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (``--batch``, ``--top``)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def budget_arg(text: str) -> str:
    """Validate a ``--budget``: ``60%``, ``0.6``, ``6GiB``, ``123456`` (bytes) or ``min``."""
    import argparse

    from memfit.units import resolve_budget

    t = text.strip()
    if t.lower() == "min":
        return "min"
    try:
        resolve_budget(t, 1 << 40)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"{e} (write e.g. 60%, 0.6, 6GiB, 500MB, a number of bytes, or min)") from None
    return t
