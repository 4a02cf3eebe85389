"""The methods compared: no checkpointing, torch's checkpointing tools, torch.compile, memfit.

Every method gets its own deep copy of the case's seeded model and runs the same step (forward,
loss, backward) on the same inputs. Peers are applied the way their users apply them:

- ``every_block``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around each block
  (for the HF model, its own ``activation_checkpointing_enable``, which does the same).
- ``sqrt_sequential``: ``checkpoint_sequential`` with round(sqrt(n)) segments, where the blocks
  sit in an ``nn.Sequential``.
- ``selective``: per block, torch's selective checkpointing (``create_selective_checkpoint_contexts``)
  saving the outputs of matmuls and convolutions and recomputing the rest.
- ``compile_budget_<b>``: ``torch.compile`` (inductor) with
  ``torch._functorch.config.activation_memory_budget = b`` set while the graph is partitioned.

NOTE [the measured step]
    Every method's step holds the model's output until its backward has run, as
    ``memfit.Step.run`` does when memfit profiles the step (and as a loop written
    ``out = model(x); loss = loss_fn(out, y); loss.backward()`` does). A step that dropped the
    output before backward would peak lower by the output's bytes than the step memfit
    planned (the UNet3D's 2.8 MB output, the Llama's 8.4 MB of logits), and memfit's plans
    would be made for, and compared against, a different step.
"""

from __future__ import annotations

import copy
import enum
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from benchmarks.models import Case

__all__ = [
    "Family",
    "Method",
    "NotApplicable",
    "build_peers",
    "plain",
    "every_block",
    "sqrt_sequential",
    "selective",
    "compiled",
    "SAVED_BY_SELECTIVE",
]


class Family(str, enum.Enum):
    NONE = "none"
    PEER = "peer"
    MEMFIT = "memfit"


COMPILED_PLAIN = "compile_plain"  # torch.compile without a budget: the compiled methods' reference


class NotApplicable(Exception):
    """A method cannot be applied honestly to a model; the message says why."""


@dataclass
class Method:
    """One way of running the case's step.

    Attributes:
        name: key in tables and JSON (``every_block``, ``memfit_0.50``, ...).
        label: short text for the plot.
        family: none, peer or memfit.
        model: the module whose parameters receive the gradients (a deep copy per method).
        forward_loss: ``forward_loss(*inputs) -> (loss, output)``; ``None`` when not
            applicable. ``step`` keeps the output referenced through backward, as
            ``memfit.Step.run`` (and a training loop that writes ``out = model(x)``) does, so
            the step measured is the step memfit profiled (NOTE [the measured step]).
        reason: why the method is not applicable (empty when it is).
        info: method-specific numbers (compile seconds, planning seconds, budget, plan).
    """

    name: str
    label: str
    family: Family
    model: nn.Module | None = None
    forward_loss: Callable[..., tuple[torch.Tensor, Any]] | None = None
    inputs: tuple[Any, ...] = ()
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def applicable(self) -> bool:
        return self.forward_loss is not None and not self.reason

    def step(self) -> torch.Tensor:
        """One training step: forward, loss, backward. Returns the (detached) loss."""
        if self.forward_loss is None:
            raise NotApplicable(f"{self.name}: {self.reason}")
        loss, out = self.forward_loss(*self.inputs)
        loss.backward()
        del out
        return loss.detach()

    def clear_grads(self) -> None:
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None


def _fresh(case: Case) -> nn.Module:
    model = copy.deepcopy(case.model)
    model.train()
    return model


def _method(case: Case, name: str, label: str, family: Family, model: nn.Module,
            call: Callable[..., Any] | None = None, **info: Any) -> Method:
    fn = call if call is not None else model
    loss_fn = case.loss_fn

    def forward_loss(*inputs: Any) -> tuple[torch.Tensor, Any]:
        out = fn(*inputs)
        return loss_fn(out), out

    return Method(name, label, family, model, forward_loss, case.inputs, info=dict(info))


def _not_applicable(name: str, label: str, reason: str) -> Method:
    return Method(name, label, Family.PEER, reason=reason)


def _wrap_blocks(model: nn.Module, paths: tuple[str, ...], **checkpoint_kwargs: Any) -> None:
    """Run each block's ``forward`` under a non-reentrant checkpoint (module hooks stay outside)."""
    for path in paths:
        block = model.get_submodule(path)
        forward = block.forward

        def wrapped(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **checkpoint_kwargs, **kwargs)

        block.forward = wrapped  # type: ignore[method-assign]


# ---- the peers ---------------------------------------------------------------------------
def plain(case: Case) -> Method:
    """No checkpointing: every activation is kept."""
    return _method(case, "none", "no checkpointing", Family.NONE, _fresh(case))


def every_block(case: Case) -> Method:
    """``checkpoint(use_reentrant=False)`` around every block (what HF's switch does)."""
    model = _fresh(case)
    if case.hf:
        llama = model.get_submodule(case.blocks[0].split(".model.layers.")[0])
        llama.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        how = "HF activation_checkpointing_enable(use_reentrant=False)"
    else:
        _wrap_blocks(model, case.blocks)
        how = f"checkpoint(use_reentrant=False) on {len(case.blocks)} blocks"
    return _method(case, "every_block", "every block", Family.PEER, model, how=how)


def sqrt_sequential(case: Case) -> Method:
    """``checkpoint_sequential`` with round(sqrt(n)) segments over the model's ``nn.Sequential``."""
    name, label = "sqrt_sequential", "checkpoint_sequential sqrt(n)"
    if case.sequential is None:
        return _not_applicable(name, label, case.sequential_reason or "not applicable: no nn.Sequential of blocks")
    model = _fresh(case)
    seq = model.get_submodule(case.sequential)
    if not isinstance(seq, nn.Sequential):
        return _not_applicable(name, label, f"not applicable: {case.sequential} is a {type(seq).__name__}")
    segments = max(1, round(math.sqrt(len(seq))))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(seq, segments, x, use_reentrant=False)

    seq.forward = forward  # type: ignore[method-assign]
    return _method(case, name, label, Family.PEER, model, segments=segments, n_blocks=len(seq))


aten = torch.ops.aten
SAVED_BY_SELECTIVE = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.convolution.default, aten._convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
})


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def selective(case: Case) -> Method:
    """Selective checkpointing per block: matmul and convolution outputs saved, the rest recomputed."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    model = _fresh(case)
    if case.hf:
        llama = model.get_submodule(case.blocks[0].split(".model.layers.")[0])
        llama.activation_checkpointing_enable(  # type: ignore[operator]
            activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn})
    else:
        _wrap_blocks(model, case.blocks, context_fn=context_fn)
    return _method(case, "selective", "selective (save matmul/conv)", Family.PEER, model,
                   how="create_selective_checkpoint_contexts: MUST_SAVE mm/addmm/bmm/conv, PREFER_RECOMPUTE rest")


def compiled(case: Case, budget: float, *, name: str | None = None) -> Method:
    """``torch.compile`` whose partitioner keeps activations within ``budget`` (a fraction);
    ``name`` given: the compiled plain step (``budget`` 1.0, the partitioner's default), the
    reference of the compiled methods' gradients.

    The budget is read when AOTAutograd partitions the joint graph, so it is set inside this
    method's own backend; each compiled method has its own backend, hence its own dynamo cache
    entry, and methods can be called in any order afterwards.
    """
    family = Family.PEER if name is None else Family.NONE
    label = f"torch.compile budget {budget:g}" if name is None else "torch.compile, no budget"
    name = name or f"compile_budget_{budget:g}"
    model = _fresh(case)
    try:
        import torch._functorch.config as functorch_config
        from torch._inductor.compile_fx import compile_fx
    except ImportError as e:  # pragma: no cover - depends on the torch build
        return _not_applicable(name, label, f"cannot import inductor: {e}")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    loss_fn = case.loss_fn

    def forward_loss(*inputs: Any) -> tuple[torch.Tensor, Any]:
        out = model(*inputs)
        return loss_fn(out), out

    fn = torch.compile(forward_loss, backend=backend)
    method = Method(name, label, family, model, fn, case.inputs, info={"budget": budget})
    return method


RECOMPILE_LIMIT = 64


def room_for_recompiles() -> None:
    """Raise dynamo's recompile limit to ``RECOMPILE_LIMIT``: every compiled method runs the
    same ``forward_loss`` code, so dynamo counts each one's graph as a recompilation of that
    frame, and past the limit (8) it runs the frame eagerly without a word in the results
    (seen: the fourth model of ``tradeoff --model all`` measured every compiled method at the
    eager plain step's peak)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across releases
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))
            return


def warm_compiled(method: Method) -> None:
    """Run the first (compiling) step of a compiled method and record how long it took."""
    from torch._dynamo.utils import counters

    room_for_recompiles()
    before = {k: dict(v) for k, v in counters.items()}
    t0 = time.perf_counter()
    try:
        method.step()
    except Exception as e:  # noqa: BLE001 - any compiler failure makes the peer not applicable here
        method.forward_loss = None
        method.reason = f"torch.compile failed here: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return
    finally:
        method.clear_grads()
    method.info["first_call_s"] = time.perf_counter() - t0
    after = {k: dict(v) for k, v in counters.items()}
    hits = {k: after.get("inductor", {}).get(k, 0) - before.get("inductor", {}).get(k, 0)
            for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    hits.update({k: after.get("aot_autograd", {}).get(k, 0) - before.get("aot_autograd", {}).get(k, 0)
                 for k in ("autograd_cache_hit", "autograd_cache_miss")})
    method.info["compile_cache"] = hits


def build_peers(case: Case, *, compile_budgets: tuple[float, ...] = (0.5, 0.2)) -> list[Method]:
    """The plain step and every peer, each on its own copy of the case's model."""
    methods = [plain(case), every_block(case), sqrt_sequential(case), selective(case)]
    methods.extend(compiled(case, b) for b in compile_budgets)
    if compile_budgets:
        methods.append(compiled(case, 1.0, name=COMPILED_PLAIN))
    return methods
