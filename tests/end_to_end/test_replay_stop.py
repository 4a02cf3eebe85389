"""Where a checkpoint's replay stops: after the last op dispatched before autograd saved the
region's last tensor (NOTE [region memory model] in ``memfit.planning.effects``), checked
against the ops torch's checkpoint really reruns in backward."""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.planning.effects import ProfileArrays
from memfit.planning.plan import Region
from memfit.planning.planner import plan_for_budget
from memfit.planning.simulate import region_models, simulate
from memfit.profiling.tracer import trace
from memfit.runtime.apply import apply_plan, unapply

_WATCHED = ("aten.gelu.default", "aten.bernoulli_.float", "aten.div_.Scalar", "aten.empty_like.default")


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj, self.drop = nn.Linear(32, 128), nn.Linear(128, 32), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mlp, self.out = nn.Linear(32, 32), _MLP(), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.mlp(h))  # residual, as a transformer block: nothing saves the MLP's output


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen[f"aten.{func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _reruns_in_backward(model: nn.Module, x: torch.Tensor) -> collections.Counter[str]:
    out = model(x)
    loss = out.sum()
    with _Count() as c:
        loss.backward()
    return collections.Counter({k: v for k, v in c.seen.items() if k in _WATCHED})


def test_the_replay_runs_dropouts_in_place_ops_up_to_the_op_that_saves_the_mask() -> None:
    """An MLP region saving both matmuls: backward needs GELU's output and dropout's mask. The
    mask is created by ``empty_like`` and filled in place by ``bernoulli_`` and ``div_``
    before ``mul`` saves it, so the replay reruns those too (the model had it stop at
    ``empty_like``: GELU and ``empty_like`` only, 1.8 ms predicted per GPT MLP region, 4.6 ms
    measured)."""
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(16, 32)
    prof = trace(model, x, repeats=1)
    base = plan_for_budget(prof, budget=1.0, solver="every_block")
    region = Region.saving(("mlp",), ["aten.addmm.default#0", "aten.addmm.default#1"])
    p = dataclasses.replace(base, regions=(region,))
    (rm, saved, _), = region_models(prof, ProfileArrays(prof), p.regions)[0]
    sel = rm.rerun(saved)
    idx = [i for k, i in enumerate(range(rm.a, rm.stop + 1)) if isinstance(sel, slice) or sel[k]]
    predicted = collections.Counter(prof.ops[i].name for i in idx if prof.ops[i].name in _WATCHED)
    assert predicted == collections.Counter(dict.fromkeys(_WATCHED, 1))

    apply_plan(model, p, check=False)
    try:
        measured = _reruns_in_backward(model, x)
    finally:
        unapply(model)
    assert measured == predicted
    # the replay's time counts them: the region's recompute is at least GELU's + the mask's
    bern = next(i for i in idx if prof.ops[i].name == "aten.bernoulli_.float")
    assert simulate(prof, p).recompute_s >= prof.ops[bern].time_s


class _Gated(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h * self.mlp(h))  # the MLP's output is saved, by an op outside it


def _backward_ops(model: nn.Module, x: torch.Tensor) -> collections.Counter[str]:
    loss = model(x).sum()
    with _Count() as c:
        loss.backward()
    return c.seen


def test_a_save_of_the_regions_output_by_a_later_op_does_not_extend_the_replay() -> None:
    """The gate ``h * mlp(h)`` saves the MLP's output (made by dropout's ``mul``), but in the
    root module's frame, not the region's: torch's replay stops at the save of dropout's mask,
    before that ``mul`` runs (the model had it rerun, and hold its output, to the region's
    end). Profiled as ``next_packs``: saves made while another module ran."""
    torch.manual_seed(0)
    model, x = _Gated(), torch.randn(16, 32)
    prof = trace(model, x, repeats=1)
    p = dataclasses.replace(plan_for_budget(prof, budget=1.0, solver="every_block"),
                            regions=(Region(("mlp",)),))
    (rm, _, _), = region_models(prof, ProfileArrays(prof), p.regions)[0]
    last = prof.modules[[m.path for m in prof.modules].index("mlp")].last_op
    assert prof.ops[last].name == "aten.mul.Tensor" and prof.ops[last].next_packs > 0
    assert rm.stop == last - 1  # div_: the mask is saved before the mul runs
    predicted = collections.Counter(prof.ops[i].name for i in range(rm.a, rm.stop + 1))
    plain = _backward_ops(model, x)
    apply_plan(model, p, check=False)
    try:
        checkpointed = _backward_ops(model, x)
    finally:
        unapply(model)
    reruns = checkpointed - plain
    for name in ("aten.mul.Tensor", "aten.addmm.default", "aten.gelu.default", "aten.div_.Scalar"):
        assert reruns[name] == predicted[name], (name, reruns, predicted)
