"""Model families: what a step must do differently for the models of one library, found through
a registry so that memfit's core names no integration.

NOTE [model families]
    Some libraries' models need two things from ``fit`` that no other model does: inputs that
    carry state from an earlier call refused (recomputation would update it twice), and the
    model's own caching turned off in the calls with grad while it is profiled and re-planned
    (Hugging Face's ``past_key_values``: NOTE [the KV cache under checkpointing] in
    ``memfit.integrations.hf_state``). An integration provides them as a :class:`ModelFamily`
    and registers it under the ``memfit.model_families`` entry-point group (memfit's own in
    ``pyproject.toml``; another package may add its own). ``fit`` asks each registered family
    whether it ``claims`` the model and its inputs, the first that does supplies the two
    hooks, and a model no family claims gets :data:`NO_FAMILY`, whose hooks do nothing.

    A family's ``claims`` must be cheap and import nothing heavy (it runs on every ``fit``), and
    its hooks must be picklable module-level callables: a fitted model's re-planner holds
    ``cache_off_for_training`` (NOTE [a fitted model pickles] in ``memfit.job.shape_plans``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from torch import nn

__all__ = ["ModelFamily", "NO_FAMILY", "ENTRY_POINT_GROUP", "registered_families", "family_of"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "memfit.model_families"


@dataclass(frozen=True)
class ModelFamily:
    """The hooks ``fit`` runs for the models of one library (NOTE [model families]).

    Attributes:
        name: the library, as messages name it (``"Hugging Face"``).
        claims: ``(model, input kwargs) -> bool``: whether the model or its inputs are this
            family's.
        refuse_carried_state: ``(model, input kwargs) -> None``: raise ``ValueError`` for inputs
            (or model settings) that a plan would break.
        cache_off_for_training: ``model -> context manager``: the model's caching off in calls
            with grad while the block runs.
        bookkeeping_side_effects: the family's forwards mutate Python state that no number
            depends on (Hugging Face's output collector), so a compiled region may skip
            replaying it in backward (``memfit.compile``: NOTE [budgets measured under
            compilation]); default False.
    """

    name: str
    claims: Callable[[nn.Module, dict[str, Any]], bool]
    refuse_carried_state: Callable[[nn.Module, dict[str, Any]], None]
    cache_off_for_training: Callable[[nn.Module], contextlib.AbstractContextManager[Any]]
    bookkeeping_side_effects: bool = False


def _claims_nothing(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    return False


def _nothing_to_refuse(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """A model no family claims carries no state a plan could break."""


def _as_it_is(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A model no family claims has no cache to turn off."""
    return contextlib.nullcontext()


NO_FAMILY = ModelFamily("no family", _claims_nothing, _nothing_to_refuse, _as_it_is)


@functools.cache
def registered_families() -> tuple[ModelFamily, ...]:
    """The families registered under :data:`ENTRY_POINT_GROUP`, loaded once per process.

    A family that fails to load is logged and left out (the models it would claim get
    :data:`NO_FAMILY`); an entry that is not a :class:`ModelFamily` is a ``TypeError`` naming it.
    """
    found = []
    for entry in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            family = entry.load()
        except Exception as e:  # a broken third-party plugin must not break fit
            log.warning("memfit: model family %r (%s) failed to load: %s", entry.name,
                        entry.value, e)
            continue
        if not isinstance(family, ModelFamily):
            raise TypeError(f"entry point {entry.name!r} ({entry.value}) of group "
                            f"{ENTRY_POINT_GROUP!r} is a {type(family).__name__}, not a "
                            "memfit.step.families.ModelFamily")
        found.append(family)
    return tuple(found)


def family_of(model: nn.Module, kwargs: dict[str, Any]) -> ModelFamily:
    """The first registered family that claims ``model`` with inputs ``kwargs``, else
    :data:`NO_FAMILY`."""
    for family in registered_families():
        if family.claims(model, kwargs):
            return family
    return NO_FAMILY
