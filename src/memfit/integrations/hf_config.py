"""Hugging Face models from a config alone: planning without weights.

A Hugging Face ``config.json`` describes a model fully enough to build it on the meta device
(no memory, no weights) and profile one step in fake mode, which is all a plan needs. This
module turns a config (a path, a dict or a ``PretrainedConfig``) into that model, its example
token ids and a causal-LM loss. ``transformers`` is imported here only, on first use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["is_config_file", "load_config", "model_from_config", "example_input_ids", "causal_lm_loss"]


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
