"""Hugging Face: ``enable``/``disable`` a budget on a model, a Trainer callback, and models
from a config alone (planning without weights).

``enable(model, budget=0.5)`` is the budgeted counterpart of ``gradient_checkpointing_enable()``;
``MemfitCallback(budget=0.5)`` does the same inside a ``transformers.Trainer`` (defined in
``memfit.integrations.hf_trainer``, imported on first access). Caching and HF's own
checkpointing are handled as NOTE [the KV cache under checkpointing] and NOTE [taking over HF
checkpointing] in ``memfit.integrations.hf_state`` say.

A Hugging Face ``config.json`` describes a model fully enough to build it on the meta device
(no memory, no weights) and profile one step in fake mode, which is all a plan needs. This
module turns a config (a path, a dict or a ``PretrainedConfig``) into that model, its example
token ids and a causal-LM loss. ``transformers`` is imported here only, on first use.

Example:
    >>> from memfit.integrations import hf
    >>> model = hf.model_from_config("config.json")               # doctest: +SKIP
    >>> ids = hf.example_input_ids(model, batch=1, seq_len=2048)  # doctest: +SKIP
    >>> memfit.profile(model, ids, loss_fn=hf.causal_lm_loss(ids), mode="fake")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from memfit.integrations.hf_state import (
    remove_cache_off,
    restore_hf_checkpointing,
    suspend_hf_checkpointing,
)

if TYPE_CHECKING:
    from memfit.integrations.hf_trainer import MemfitCallback

__all__ = [
    "enable",
    "disable",
    "MemfitCallback",
    "training_inputs",
    "is_config_file",
    "load_config",
    "model_from_config",
    "example_input_ids",
    "causal_lm_loss",
]


log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


def __getattr__(name: str) -> Any:
    # MemfitCallback subclasses transformers.TrainerCallback: defined where transformers is
    # imported, on first access, so that importing this module stays light.
    if name == "MemfitCallback":
        from memfit.integrations.hf_trainer import MemfitCallback

        return MemfitCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def training_inputs(model: nn.Module, *, batch_size: int | None = None,
                   seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}`` of ``batch_size`` x ``seq_len`` for a causal LM's step.

    ``batch_size`` defaults to 1, ``seq_len`` to the config's ``max_position_embeddings``
    (capped at 4096); labels are the ids themselves (the model shifts them), so the output
    carries the loss the Trainer differentiates.

    Example:
        >>> training_inputs(torch.nn.Linear(2, 2), batch_size=2, seq_len=4)["input_ids"].shape
        torch.Size([2, 4])
    """
    ids = example_input_ids(model, batch=1 if batch_size is None else batch_size, seq_len=seq_len)
    return {"input_ids": ids, "labels": ids}


def enable(model: M, budget: int | float | str, example_inputs: Any = None, *,
           batch_size: int | None = None, seq_len: int | None = None,
           solver: str = "auto") -> M:
    """Plan ``model``'s training step for ``budget`` and apply it: the budgeted counterpart of
    ``model.gradient_checkpointing_enable()``.

    Caching is turned off for training calls as HF's checkpointing does (logged once), and if
    HF's own checkpointing is on, memfit takes it over (logged; ``disable`` switches it back on).
    Works on any ``PreTrainedModel`` and on a ``peft.PeftModel``, whose plan then counts only the
    gradients of the parameters that train (call it after ``get_peft_model``).

    Args:
        model: a ``transformers.PreTrainedModel`` (or a ``PeftModel``), changed in place.
        budget: the cap on peak activation memory: ``int`` bytes, a fraction of the plain peak
            (``0.5``), ``"6GiB"``, ``"50%"`` or ``"min"``.
        example_inputs: the inputs of one training step (a dict of keyword arguments, as the
            Trainer passes them); default ``training_inputs(model, batch_size=..., seq_len=...)``.
        batch_size: rows of the default inputs (default 1); only without ``example_inputs``.
        seq_len: tokens per row of the default inputs (default the config's
            ``max_position_embeddings``, at most 4096); only without ``example_inputs``.
        solver: as for ``memfit.fit`` (default ``"auto"``).

    Returns:
        ``model``, planned; the plan is ``model.memfit_plan``.

    Raises:
        ValueError: ``example_inputs`` given together with ``batch_size``/``seq_len``.
        memfit.InfeasibleBudget: no plan fits the budget.

    Example:
        >>> model = LlamaForCausalLM(LlamaConfig(...))                      # doctest: +SKIP
        >>> hf.enable(model, budget=0.5, batch_size=8, seq_len=1024)        # doctest: +SKIP
        >>> hf.disable(model)                                               # doctest: +SKIP
    """
    from memfit.api import fit

    if example_inputs is not None and (batch_size is not None or seq_len is not None):
        raise ValueError("give example_inputs or batch_size/seq_len, not both: batch_size and "
                         "seq_len only shape the default inputs")
    if example_inputs is None:
        example_inputs = training_inputs(model, batch_size=batch_size, seq_len=seq_len)
    take_over_hf_checkpointing(model)
    try:
        fit(model, example_inputs, budget=budget, solver=solver)
    except BaseException:
        restore_hf_checkpointing(model)
        raise
    return model


def take_over_hf_checkpointing(model: nn.Module) -> list[str]:
    """Switch HF's own checkpointing off (logged) so memfit's plan replaces it; ``disable``
    switches it back on. Returns the paths it was on for."""
    paths = suspend_hf_checkpointing(model)
    if paths:
        log.warning("memfit: %s had Hugging Face gradient checkpointing on for %d modules; "
                    "memfit's plan replaces it (memfit.integrations.hf.disable turns it back on)",
                    type(model).__name__, len(paths))
    return paths


def disable(model: M) -> M:
    """Undo ``enable``: remove the plan, the training-time ``use_cache=False``, and switch HF's
    own checkpointing back on if ``enable`` took it over.

    Example:
        >>> hf.disable(model)            # doctest: +SKIP
    """
    from memfit.runtime.apply import unapply

    for m in list(model.modules()):
        if "_memfit_applied" in m.__dict__:
            unapply(m)
    remove_cache_off(model)
    restore_hf_checkpointing(model)
    return model


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "building a model from a Hugging Face config needs transformers; "
            "install it with: pip install 'memfit[hf]'"
        ) from None
    return transformers


def is_config_file(path: str | Path) -> bool:
    """True if ``path`` is a readable JSON file that looks like a Hugging Face model config.

    Example:
        >>> is_config_file("no/such/file.json")
        False
    """
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return False
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "model_type" in data


def load_config(config: str | Path | Mapping[str, Any] | Any) -> Any:
    """A ``transformers.PretrainedConfig`` from a ``config.json`` path, a dict, or a config.

    Raises:
        ValueError: the file is not JSON, or has no known ``model_type``.
    """
    tf = _transformers()
    if isinstance(config, tf.PretrainedConfig):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read Hugging Face config {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); expected a Hugging Face config.json") from None
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"expected a config path, dict or PretrainedConfig, got {type(config).__name__}")
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type is None:
        raise ValueError("the config has no 'model_type' key; is it a Hugging Face config.json?")
    try:
        config_class = tf.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ValueError(
            f"transformers {tf.__version__} does not know model_type {model_type!r}; "
            "upgrade transformers or check the config"
        ) from None
    return config_class.from_dict(data)


def model_from_config(
    config: str | Path | Mapping[str, Any] | Any,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build the model a config describes, on ``device`` (default ``meta``: no memory, no weights).

    The class is the config's first ``architectures`` entry when transformers has it, else
    ``AutoModelForCausalLM`` (falling back to ``AutoModel`` for configs that are not language
    models). The model is put in training mode: memfit plans training steps.

    Args:
        config: a ``config.json`` path, a dict, or a ``PretrainedConfig``.
        device: where to build the parameters; ``"meta"`` allocates nothing.
        dtype: parameter dtype; default the config's ``torch_dtype``/``dtype``, else float32.

    Example:
        >>> from transformers import LlamaConfig                          # doctest: +SKIP
        >>> m = model_from_config(LlamaConfig(num_hidden_layers=2))        # doctest: +SKIP
        >>> next(m.parameters()).device                                    # doctest: +SKIP
        device(type='meta')
    """
    tf = _transformers()
    cfg = load_config(config)
    if dtype is None:
        # transformers 5 calls it ``dtype`` (reading ``torch_dtype`` warns); 4.x ``torch_dtype``
        want = getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype")
        if isinstance(want, str):
            want = getattr(torch, want, None)
        dtype = want if isinstance(want, torch.dtype) else torch.float32
    cls = None
    for arch in getattr(cfg, "architectures", None) or ():
        cls = getattr(tf, arch, None)
        if cls is not None:
            break
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if cls is not None:
                model = cls(cfg)
            else:
                try:
                    model = tf.AutoModelForCausalLM.from_config(cfg)
                except ValueError:  # not a causal LM config: the bare model
                    model = tf.AutoModel.from_config(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    return model


def example_input_ids(model: nn.Module, *, batch: int = 1, seq_len: int | None = None,
                      device: str | torch.device | None = None) -> torch.Tensor:
    """Token ids ``(batch, seq_len)`` for a Hugging Face model, on the model's device.

    ``seq_len`` defaults to the config's ``max_position_embeddings`` (capped at 4096). Ids
    are zeros: a step's memory and time do not depend on their values, and on the meta
    device there are no values anyway.
    """
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    cfg = getattr(model, "config", None)
    if seq_len is None:
        seq_len = min(int(getattr(cfg, "max_position_embeddings", 512) or 512), 4096)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else "cpu"
    return torch.zeros(batch, seq_len, dtype=torch.long, device=device)  # (batch, time)


def causal_lm_loss(input_ids: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """A loss for ``model(input_ids)``: next-token cross-entropy on the output's logits.

    Example:
        >>> ids = torch.zeros(1, 8, dtype=torch.long)
        >>> loss_fn = causal_lm_loss(ids)
        >>> loss_fn({"logits": torch.zeros(1, 8, 5)}).shape
        torch.Size([])
    """
    targets = input_ids[:, 1:].reshape(-1)  # (batch * (time - 1),)

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output["logits"] if isinstance(output, Mapping) else getattr(output, "logits", output)
        vocab = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets)  # logits (B, T, V)

    return loss_fn
