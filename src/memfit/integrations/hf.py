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

from typing import TYPE_CHECKING, Any

from memfit.integrations.hf_config import (
    causal_lm_loss,
    example_input_ids,
    is_config_file,
    load_config,
    model_from_config,
)
from memfit.integrations.hf_enable import (
    disable,
    enable,
    take_over_hf_checkpointing,
    training_inputs,
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
    "take_over_hf_checkpointing",
]


def __getattr__(name: str) -> Any:
    # MemfitCallback subclasses transformers.TrainerCallback: defined where transformers is
    # imported, on first access, so that importing this module stays light.
    if name == "MemfitCallback":
        from memfit.integrations.hf_trainer import MemfitCallback

        return MemfitCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
