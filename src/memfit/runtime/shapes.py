"""The planned model's input guard: a plan holds for the inputs it was profiled on.

NOTE [inputs other than the profiled ones]
    A plan's peak is predicted for one step: the shapes and dtypes of the inputs it was
    profiled on (``Plan.input_signature``, NOTE [input signature] in
    ``memfit.profiling.inputs``). Twice the sequence length ran a plan at 259% of its budget,
    twice the batch at 190%, ``.to(float64)`` at 197%, silently. Until plans cover ranges of
    shapes, ``apply`` puts a forward pre-hook on the planned model that compares each call's
    signature with the plan's and, on the first that differs, logs one warning naming both
    and saying to fit again; after it the hook returns at once. Not compared: calls that
    record no autograd graph (``torch.no_grad``, evaluation: they run no checkpoint and keep
    no activations, NOTE [when a region checkpoints] in ``memfit.runtime.wrap``), calls while
    the plan is suspended (``memfit.profile`` of the planned model: NOTE [suspended plans] in
    ``memfit.runtime.marks``), and calls traced by ``torch.compile`` (dynamo guards on shapes
    itself, and would trace the comparison into the graph). A plan without a signature (made
    before the field) installs no guard. Cost, measured on this project's shared 2-core
    machine: 4.2 us per call for one positional tensor and the parameters' dtype (the common
    call, compared in place; others build the signature: 9.4 us), against milliseconds for
    the forward of the smallest zoo GPT.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memfit.profiling.inputs import PARAMETERS_KEY, call_signature, first_floating_parameter
from memfit.runtime.marks import suspended

__all__ = ["InputGuard"]

log = logging.getLogger(__name__)

_TENSORS = (torch.Tensor, nn.Parameter)


def _dtype(name: str) -> Any:
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else name


class InputGuard:
    """Forward pre-hook of a planned model: warns once on inputs other than the profiled ones
    (NOTE [inputs other than the profiled ones]).

    Attributes:
        expected: the plan's signature as ``(name, torch.Size, torch.dtype)``.
        warned: whether the warning was given.
    """

    def __init__(self, model: nn.Module, signature: tuple[tuple[str, tuple[int, ...], str], ...],
                 model_name: str = "") -> None:
        self.expected = [(n, torch.Size(s), _dtype(d)) for n, s, d in signature]
        self.signature = signature
        self.parameter = (first_floating_parameter(model)
                          if any(n == PARAMETERS_KEY for n, _, _ in signature) else None)
        self.model_name = model_name or type(model).__name__
        self.warned = False
        # the common call: tensors as positional arguments only, compared without building
        # the signature
        tensors = [(s, d) for n, s, d in self.expected if n != PARAMETERS_KEY]
        self._positional = (tensors if [n for n, _, _ in self.expected if n != PARAMETERS_KEY]
                            == [str(i) for i in range(len(tensors))] else None)
        self._parameter_dtype = next((d for n, _, d in self.expected if n == PARAMETERS_KEY), None)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned or torch.compiler.is_compiling() or not torch.is_grad_enabled() or suspended():
            return
        pos = self._positional
        if (pos is not None and not kwargs and len(args) == len(pos)
                and all(type(a) in _TENSORS and a.shape == s and a.dtype == d
                        for a, (s, d) in zip(args, pos, strict=True))
                and (self.parameter is None or self.parameter.dtype == self._parameter_dtype)):
            return
        got = call_signature(args, kwargs, self.parameter)
        if got == self.expected:
            return
        self.warned = True
        log.warning(
            "memfit: %s was planned for inputs %s and is now called with %s; the plan's peak "
            "(and its budget) holds for the profiled shapes and dtypes only: fit it again "
            "(memfit.fit) on inputs of the new shape",
            self.model_name, _describe(self.expected), _describe(got))


def _describe(sig: list[tuple[str, Any, Any]]) -> str:
    parts = [f"{n}={'x'.join(map(str, s)) or '()'}:{str(d).removeprefix('torch.')}"
             if n != PARAMETERS_KEY else f"parameters:{str(d).removeprefix('torch.')}"
             for n, s, d in sig]
    return "(" + ", ".join(parts) + ")"
