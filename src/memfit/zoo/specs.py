"""A model from a spec: a zoo name, a ``module:factory``, or a Hugging Face config.

``load_model(spec)`` is what the command line's MODEL argument means, as a Python API.
Three spellings, tried in this order:

- ``gpt``, ``gpt:n_layer=4,d_model=128``, ``resnet:blocks_per_stage=(1,1),width=8``: a zoo
  model and its options. ``batch=`` and ``size=`` are not model options: they size the example
  inputs (batch, and sequence length or image/volume side).
- ``package.module:factory`` or ``path/to/file.py:factory``: a function called without
  arguments that returns an ``nn.Module``, or ``(module, example_inputs)``. For a bare module
  the inputs come from ``input_shapes`` and ``dtype`` (seeded random values; zeros for
  integer dtypes, a valid index for any embedding table).
- ``path/to/config.json``: a Hugging Face config; the model is built on the meta device (no
  weights) and can only be profiled and planned in fake mode.

Example:
    >>> lm = load_model("resnet:blocks_per_stage=(1,1),width=8,batch=2,size=16")
    >>> type(lm.model).__name__, tuple(lm.example_inputs.shape)
    ('ResNet', (2, 3, 16, 16))
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSpecError", "LoadedModel", "load_model", "parse_shape", "parse_dtype", "split_options"]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
}


class ModelSpecError(ValueError):
    """A model spec names nothing memfit can build, or its options or input shapes are wrong
    (the command line prints the message and exits with code 2)."""


@dataclass(frozen=True)
class LoadedModel:
    """A model resolved from a spec, with example inputs for one step.

    Attributes:
        model: the module, in train mode.
        example_inputs: a tensor, or a tuple of them (``model(*inputs)``).
        name: the spec, for tables and messages.
        loss_fn: output -> scalar loss, where the spec implies one (a Hugging Face config's
            next-token loss); ``None``: the default loss.
        on_meta: the model has no weights (a Hugging Face config): it can be profiled and
            planned in fake mode only.
    """

    model: nn.Module
    example_inputs: Any
    name: str
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    on_meta: bool = False


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,3,32,32"``, ``"2x3x32x32"`` or ``"2 3 32 32"`` -> ``(2, 3, 32, 32)``.

    One separator throughout (commas, else ``x``, else spaces; spaces around commas and ``x``
    are ignored); every part must be a positive integer.

    Raises:
        ModelSpecError: an empty shape, or a part that is not a positive integer (named).

    Example:
        >>> parse_shape("2,3,32,32"), parse_shape("2x16"), parse_shape("4 3 32 32")
        ((2, 3, 32, 32), (2, 16), (4, 3, 32, 32))
    """
    t = text.strip()
    pieces = t.split(",") if "," in t else re.split("[xX]", t) if "x" in t.lower() else t.split()
    parts = [p.strip() for p in pieces]
    example = "e.g. 2,3,32,32, 2x3x32x32 or '2 3 32 32'"
    if not t:
        raise ModelSpecError(f"empty input shape {text!r}: write one or more positive sizes, {example}")
    for p in parts:
        if not p.isascii() or not p.isdigit() or int(p) <= 0:
            what = "an empty part" if not p else f"part {p!r} is not a positive integer"
            raise ModelSpecError(f"cannot parse input shape {text!r}: {what}; write positive sizes "
                                 f"separated by commas, x or spaces, {example}")
    return tuple(int(p) for p in parts)


def parse_dtype(text: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; the names of ``_DTYPES``."""
    try:
        return _DTYPES[text.lower().removeprefix("torch.")]
    except KeyError:
        raise ModelSpecError(f"unknown dtype {text!r}; choose one of {sorted(set(_DTYPES))}") from None


def split_options(text: str) -> dict[str, Any]:
    """``"n_layer=4,blocks=(1,1),name=x"`` -> ``{"n_layer": 4, "blocks": (1, 1), "name": "x"}``.

    Commas inside brackets do not split. Values are Python literals where they parse as one,
    else strings.

    Example:
        >>> split_options("n_layer=4,blocks_per_stage=(1,1)")
        {'n_layer': 4, 'blocks_per_stage': (1, 1)}
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    options: dict[str, Any] = {}
    for item in (s.strip() for s in items):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ModelSpecError(f"cannot parse model option {item!r}: write name=value, e.g. n_layer=4")
        try:
            options[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key] = value.strip()
    return options


def _zoo_model(name: str, option_text: str, batch: int | None = None) -> LoadedModel:
    from memfit import zoo

    options = split_options(option_text)
    input_opts = {k: options.pop(k) for k in ("batch", "size") if k in options}
    if batch is not None:
        input_opts["batch"] = batch
    factory = zoo.MODELS[name]
    params = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ModelSpecError(
            f"zoo model {name!r} has no option {', '.join(map(repr, unknown))}; its options are "
            f"{', '.join(p for p in params)} (plus batch= and size= for the example inputs)"
        )
    try:
        model = factory(**options)
        inputs = zoo.example_inputs(model, **input_opts)
    except (TypeError, ValueError) as e:
        raise ModelSpecError(f"cannot build zoo model {name}:{option_text}: {e}") from None
    label = name + (f":{option_text}" if option_text else "")
    return LoadedModel(model, inputs, label)


def _import_factory(spec: str) -> Callable[[], Any]:
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise ModelSpecError(f"unknown MODEL {spec!r}: there is no file {module_part}")
        mod_spec = importlib.util.spec_from_file_location(f"memfit_user_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ModelSpecError(f"cannot import {module_part} as a Python module")
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:  # the user's file failed: say so in one line
            raise ModelSpecError(f"importing {module_part} failed: {type(e).__name__}: {e}") from None
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # console scripts do not put the cwd on the path
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ModelSpecError(f"unknown MODEL {spec!r}: cannot import module {module_part!r} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSpecError(f"unknown MODEL {spec!r}: module {module_part!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def _random_inputs(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> Any:
    g = torch.Generator().manual_seed(0)
    tensors = []
    for shape in shapes:
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=g).to(dtype))
        else:  # zeros are a valid index for any embedding table
            tensors.append(torch.zeros(shape, dtype=dtype))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def load_model(
    spec: str,
    *,
    input_shapes: list[tuple[int, ...]] | None = None,
    dtype: torch.dtype | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
) -> LoadedModel:
    """Resolve a model spec (see the module docstring) to a model and example inputs.

    The command line's MODEL argument is this spec: ``memfit profile MODEL`` profiles
    ``lm.model`` on ``lm.example_inputs`` with ``lm.loss_fn``.

    Args:
        spec: a zoo name with options (``"gpt:n_layer=4,batch=2"``), ``"package.module:factory"``
            or ``"path/to/file.py:factory"``, or a Hugging Face ``config.json`` path.
        input_shapes: shapes of seeded random example inputs, for a factory that returns a
            bare module (``--input-shape``); default none.
        dtype: the dtype of those inputs (default float32); a Hugging Face model's parameter
            dtype (``--dtype``).
        batch, seq_len: the token batch of a Hugging Face config (default 1 and the config's
            context length, capped at 4096). ``batch`` also sizes a zoo model's inputs (over
            its spec's ``batch=``) and the first dimension of ``input_shapes``.

    Returns:
        A ``LoadedModel``: the module (in train mode), its example inputs, a name, and a
        loss function where the spec implies one.

    Raises:
        ModelSpecError: the spec names nothing memfit can build, or its options are wrong.

    Example:
        >>> lm = load_model("gpt:n_layer=1,d_model=32,n_head=2,seq_len=16,batch=1")
        >>> tuple(lm.example_inputs.shape)
        (1, 16)
        >>> report = memfit.profile(lm.model, lm.example_inputs, loss_fn=lm.loss_fn)  # doctest: +SKIP
    """
    from memfit import zoo

    spec = spec.strip()
    if not spec:
        raise ModelSpecError("the model spec is empty; try 'gpt', 'gpt:n_layer=4' or 'mypkg.models:build'")
    name, _, option_text = spec.partition(":")
    if name in zoo.MODELS:
        if input_shapes:
            raise ModelSpecError("input_shapes (--input-shape) apply to module:factory models; "
                                 "size zoo models with batch= and size= in the spec")
        return _zoo_model(name, option_text, batch)

    if spec.endswith(".json"):
        from memfit.integrations import hf

        if not Path(spec).is_file():
            raise ModelSpecError(f"unknown MODEL {spec!r}: there is no file {spec}")
        if not hf.is_config_file(spec):
            raise ModelSpecError(f"MODEL {spec!r} is not a Hugging Face config.json (no 'model_type' key)")
        try:
            model = hf.model_from_config(spec, dtype=dtype)
            ids = hf.example_input_ids(model, batch=batch or 1, seq_len=seq_len)
        except (ValueError, TypeError, ImportError) as e:
            raise ModelSpecError(f"cannot build a model from {spec}: {e}") from None
        return LoadedModel(model, ids, f"{type(model).__name__} ({Path(spec).name})",
                           loss_fn=hf.causal_lm_loss(ids), on_meta=True)

    if ":" not in spec:
        raise ModelSpecError(
            f"unknown MODEL {spec!r}: not a zoo model ({', '.join(sorted(zoo.MODELS))}), "
            "a package.module:factory, or a Hugging Face config .json file"
        )
    factory = _import_factory(spec)
    try:
        made = factory()
    except Exception as e:  # the user's factory failed: say so in one line
        raise ModelSpecError(f"{spec}() failed: {type(e).__name__}: {e}") from None
    if input_shapes and batch is not None:
        input_shapes = [(batch, *s[1:]) for s in input_shapes]
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        if input_shapes:
            inputs = _random_inputs(input_shapes, dtype or torch.float32)
        elif batch is not None:
            raise ModelSpecError(f"{spec} returns its own example inputs, which cannot be "
                                 "resized to another batch; pass --input-shape")
    elif isinstance(made, nn.Module):
        model = made
        if not input_shapes:
            raise ModelSpecError(
                f"{spec} returned a module without example inputs; pass input_shapes=[(2, 3, 32, 32)] "
                "(--input-shape 2,3,32,32 on the command line; repeat it for several inputs)"
            )
        inputs = _random_inputs(input_shapes, dtype or torch.float32)
    else:
        raise ModelSpecError(f"{spec}() returned {type(made).__name__}; expected an nn.Module or (module, inputs)")
    model.train()
    return LoadedModel(model, inputs, spec)
