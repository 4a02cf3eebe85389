"""State a Hugging Face forward carries between calls, and HF's own checkpointing.

Duck-typed (``transformers`` is never imported here), so ``memfit.fit`` can use it on any
model: a module counts as a Hugging Face model when its ``config.use_cache`` exists and its
class's ``forward`` takes a ``use_cache`` argument.

NOTE [the KV cache under checkpointing]
    Every causal-LM config defaults to ``use_cache=True``: each forward creates a cache and
    every decoder layer appends its keys and values to it. A checkpointed layer runs twice
    (forward, then the recomputation in backward) with the same cache object, which the first
    run already filled, so the recomputation concatenates where the forward initialised
    (``RecomputeMismatch``: forward ``aten.lift_fresh``, recompute ``aten.cat``); the cache
    would also keep every layer's keys and values alive, the memory checkpointing frees.
    Hugging Face's own checkpointing turns caching off for a whole call in one situation: a
    training call (``module.training``) with grad enabled (transformers 5.24,
    ``merge_with_config_defaults``). memfit's regions checkpoint whenever autograd records,
    in ``eval()`` too (NOTE [when a region checkpoints] in ``memfit.runtime.wrap``:
    dropout-off fine-tuning steps in ``eval()``), so a forward pre-hook on the model passes
    ``use_cache=False`` to every call with grad enabled while the model carries a memfit plan
    (and while ``fit`` profiles it), in train and eval mode alike. Such an output carries no
    cache (``None``) and ``config.use_cache`` is never changed: ``torch.no_grad()`` and
    ``torch.inference_mode()`` calls, and so ``generate``, keep their cache. ``memfit.unapply``
    (no plan: the hook passes calls through) or ``memfit.integrations.hf.disable`` (removes
    the hook) restores the model's own behaviour.

NOTE [taking over HF checkpointing]
    HF's checkpointing (``gradient_checkpointing_enable()``, ``TrainingArguments(
    gradient_checkpointing=True)``) sets ``gradient_checkpointing = True`` on its layers;
    memfit on top would checkpoint the same layers twice (each recomputed twice, nothing
    saved). ``memfit.fit`` refuses such a model; ``hf.enable`` and ``MemfitCallback`` take
    over: they switch every flag off, remember each module's flag and checkpoint function, and
    ``hf.disable`` puts them back as they were.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit._torch import forward_pre_hooks, remove_forward_pre_hook
from memfit.step.families import ModelFamily

__all__ = [
    "CARRIED_STATE_KWARGS",
    "CacheOff",
    "cache_module",
    "cache_off_for_training",
    "install_cache_off",
    "remove_cache_off",
    "hf_checkpointing_modules",
    "suspend_hf_checkpointing",
    "restore_hf_checkpointing",
    "refuse_carried_state",
    "claims",
    "FAMILY",
]

log = logging.getLogger(__name__)

#: Keyword arguments through which a forward receives state from an earlier call.
CARRIED_STATE_KWARGS = ("past_key_values", "cache", "layer_past")


def _use_cache_position(module: nn.Module) -> int | None:
    """Where ``use_cache`` sits among the positional arguments of ``module.forward`` (self
    excluded), or None if the forward takes no ``use_cache``."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            return i if p.kind is p.POSITIONAL_OR_KEYWORD else -1
    return None


def cache_module(model: nn.Module) -> nn.Module | None:
    """The outermost module of ``model`` that caches by default: its ``config.use_cache`` is
    truthy and its forward takes ``use_cache`` (the ``LlamaForCausalLM`` inside a
    ``PeftModel``); None if there is none."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) and _use_cache_position(module) is not None:
            return module
    return None


class CacheOff:
    """Forward pre-hook: ``use_cache=False`` for calls with grad of a planned model.

    See NOTE [the KV cache under checkpointing]. Plain data and picklable; ``deepcopy`` of the
    model copies it with ``root`` pointing at the copy.
    """

    def __init__(self, root: nn.Module, position: int) -> None:
        self.root = root          # the module memfit planned; the hook is live while it has a plan
        self.position = position  # index of use_cache among positional args, -1 keyword-only
        self.profiling = 0        # > 0 while ``fit`` profiles the plain model

    def active(self) -> bool:
        return self.profiling > 0 or "memfit_plan" in self.root.__dict__

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not (torch.is_grad_enabled() and self.active()):
            return None
        if 0 <= self.position < len(args):
            if args[self.position] is False:
                return None
            args = (*args[:self.position], False, *args[self.position + 1:])
            return args, kwargs
        if kwargs.get("use_cache") is False:
            return None
        return args, {**kwargs, "use_cache": False}

    def __repr__(self) -> str:
        return f"memfit.CacheOff(root={type(self.root).__name__})"


def _find_hook(module: nn.Module) -> tuple[int, CacheOff] | None:
    for key, hook in forward_pre_hooks(module).items():
        if isinstance(hook, CacheOff):
            return key, hook
    return None


def install_cache_off(model: nn.Module) -> CacheOff | None:
    """Put a ``CacheOff`` hook on ``model``'s caching module (once; a second call returns the
    same hook, re-rooted at ``model``). None if the model does not cache."""
    target = cache_module(model)
    if target is None:
        return None
    found = _find_hook(target)
    if found is not None:
        found[1].root = model
        return found[1]
    position = _use_cache_position(target)
    hook = CacheOff(model, -1 if position is None else position)
    target.register_forward_pre_hook(hook, with_kwargs=True)
    return hook


def remove_cache_off(model: nn.Module) -> bool:
    """Remove the ``CacheOff`` hook from ``model`` (True if there was one)."""
    removed = False
    for module in model.modules():
        found = _find_hook(module)
        if found is not None:
            key, _ = found
            remove_forward_pre_hook(module, key)
            removed = True
    return removed


@contextlib.contextmanager
def cache_off_for_training(model: nn.Module) -> Iterator[CacheOff | None]:
    """Install the hook (if the model caches) and keep it live inside the block, where ``fit``
    profiles the model before it has a plan. If the block raises and the hook was new, it is
    removed again: a failed ``fit`` leaves the model as it was."""
    target = cache_module(model)
    new = target is not None and _find_hook(target) is None
    hook = install_cache_off(model)
    if hook is None:
        yield None
        return
    hook.profiling += 1
    try:
        yield hook
    except BaseException:
        if new:
            remove_cache_off(model)
        raise
    finally:
        hook.profiling -= 1
    if new:
        _announce(target)


def _announce(target: nn.Module | None) -> None:
    log.warning(
        "memfit: %s caches keys/values by default (config.use_cache=True), which breaks "
        "recomputation; as with Hugging Face's gradient checkpointing, its calls with grad "
        "enabled (train or eval mode) now run with use_cache=False while it carries a memfit "
        "plan. config.use_cache is unchanged; no_grad calls (generate) keep the cache.",
        type(target).__name__)


def hf_checkpointing_modules(model: nn.Module) -> list[str]:
    """Paths of the modules whose Hugging Face checkpointing flag is on."""
    return [name or "<root>" for name, m in model.named_modules()
            if getattr(m, "gradient_checkpointing", False) is True]


def suspend_hf_checkpointing(model: nn.Module) -> list[str]:
    """Switch HF's checkpointing off, remembering each flag and checkpoint function on the
    model (NOTE [taking over HF checkpointing]); returns the paths switched off."""
    saved: list[tuple[nn.Module, bool, Any]] = []
    paths = hf_checkpointing_modules(model)
    for m in model.modules():
        if "gradient_checkpointing" in m.__dict__:
            saved.append((m, m.__dict__["gradient_checkpointing"],
                          m.__dict__.get("_gradient_checkpointing_func")))
            setattr(m, "gradient_checkpointing", False)  # noqa: B010
    if paths:
        model.__dict__.setdefault("_memfit_hf_checkpointing", saved)
    return paths


def restore_hf_checkpointing(model: nn.Module) -> bool:
    """Put back what ``suspend_hf_checkpointing`` switched off (True if anything)."""
    saved = model.__dict__.pop("_memfit_hf_checkpointing", None)
    if saved is None:
        return False
    for m, flag, func in saved:
        setattr(m, "gradient_checkpointing", flag)  # noqa: B010
        if func is not None:
            setattr(m, "_gradient_checkpointing_func", func)  # noqa: B010
    return True


def refuse_carried_state(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` if the model's HF checkpointing is on or the inputs carry a cache:
    either would break or double the checkpointing a plan applies."""
    paths = hf_checkpointing_modules(model)
    if paths:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise ValueError(
            f"{type(model).__name__} has Hugging Face gradient checkpointing on ({shown}); a "
            "memfit plan would checkpoint the same layers twice. Turn it off first "
            "(model.gradient_checkpointing_disable()), or use "
            "memfit.integrations.hf.enable(model, budget=...), which takes it over")
    for name in CARRIED_STATE_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"the example inputs pass {name}={type(kwargs[name]).__name__}: state from an "
                "earlier call, which a checkpointed layer would update twice (forward and "
                f"recomputation). Train without it ({name}=None), as Hugging Face's "
                "checkpointing does")


#: Instance attributes a Hugging Face model sets: ``PreTrainedModel.config``, and each layer's
#: checkpointing flag (the hooks above read nothing else).
HF_ATTRIBUTES = ("config", "gradient_checkpointing")


def claims(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether ``fit`` should run this module's hooks for ``model`` called with ``kwargs``: a
    module has one of :data:`HF_ATTRIBUTES`, or the inputs pass one of
    :data:`CARRIED_STATE_KWARGS` (duck-typed: transformers is not imported)."""
    return (any(hasattr(m, a) for m in model.modules() for a in HF_ATTRIBUTES)
            or any(kwargs.get(k) is not None for k in CARRIED_STATE_KWARGS))


#: Hugging Face's models as ``fit`` treats them (NOTE [model families] in
#: ``memfit.step.families``; registered in pyproject.toml's ``memfit.model_families``).
# bookkeeping: transformers' output collector (utils/output_capturing.py, a CompileableContextVar
# set in forward) gathers hidden states for the outputs; its replay in a compiled backward
# would be a dynamo graph break per region (measured: 14 on a 4-layer Llama, +43% step time)
FAMILY = ModelFamily("Hugging Face", claims, refuse_carried_state, cache_off_for_training,
                     bookkeeping_side_effects=True)
