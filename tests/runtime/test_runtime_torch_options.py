"""torch's checkpoint arguments at memfit's regions: ``context_fn`` composed with memfit's
contexts, ``debug=True`` and torch's global debug mode refused with a line that says what to
use instead of torch's raw error about a context_fn the caller never passed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    set_checkpoint_debug_enabled,
)

import memfit
from memfit.errors import MemfitError
from memfit.runtime.policies import save_matmuls
from memfit.runtime.segment import checkpoint_segment
from memfit.runtime.wrap import wrap


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def test_a_selective_context_fn_is_composed_with_memfits_check() -> None:
    mlp, x = _mlp(), torch.randn(4, 8, requires_grad=True)
    ref = copy.deepcopy(mlp)
    saved_ops: list[str] = []

    def keep_mm(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not ctx.is_recompute:
            saved_ops.append(str(op))
        return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    out = memfit.checkpoint(mlp, x, check="always",
                            context_fn=lambda: create_selective_checkpoint_contexts(keep_mm))
    out.sum().backward()
    ref(x.detach()).sum().backward()
    assert "aten.addmm.default" in saved_ops  # the caller's policy was consulted
    for p, q in zip(mlp.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_context_fn_with_a_policy_is_refused() -> None:
    mlp, x = _mlp(), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="policy= or a context_fn=, not both"):
        memfit.checkpoint(mlp, x, policy=save_matmuls(),
                          context_fn=lambda: create_selective_checkpoint_contexts(lambda *a: True))


def test_debug_true_is_refused_with_what_to_use() -> None:
    mlp, x = _mlp(), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"does not take debug=True.*check=\"always\""):
        memfit.checkpoint(mlp, x, debug=True)
    memfit.checkpoint(mlp, x, debug=False).sum().backward()  # the default passes through


@pytest.mark.parametrize("how", ["wrap", "segment"])
def test_torchs_global_debug_mode_names_itself(how: str) -> None:
    model = nn.Sequential(_mlp(), _mlp(), _mlp())
    x = torch.randn(4, 8)
    if how == "wrap":
        wrap(model[1])
    else:
        checkpoint_segment(model, [0, 1])
    with set_checkpoint_debug_enabled(True), pytest.raises(
            MemfitError, match=r"checkpoint debug mode is on.*set_checkpoint_debug_enabled\(None\)"):
        model(x).sum().backward()
    model(x).sum().backward()  # and fine with the mode off
