"""Plans on models that write in place across region boundaries (the parent's ``h += block(h)``,
a block that starts with ``relu_`` on its input): they train plainly, so a plan must too."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import assert_bitwise_twin
from torch import nn

import memfit


class ScaledMLP(nn.Module):
    """``mlp(x * 0.5)``: the scale by a Python float saves nothing, so autograd does not keep
    ``x`` and the parent may write it in place after the call (as it may in plain PyTorch)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x * 0.5)


class InplaceNet(nn.Module):
    """Stages of blocks on (tokens, d) activations, with in-place writes where ``mode`` says:

    - ``"block_iadd"``: ``h += block(h)`` in the parent loop (writes each block's input);
    - ``"stage_iadd"``: ``h += stage(h)``, a stage being an ``nn.Sequential`` of blocks (writes
      the input of the stage and of a segment starting at its first block);
    - ``"relu_input"``: each block starts with ``nn.ReLU(inplace=True)`` (writes its own input,
      the previous block's output).
    """

    def __init__(self, mode: str, d: int = 32, n_stage: int = 2, n_block: int = 3) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(d, d)

        def block() -> nn.Module:
            if mode == "relu_input":
                return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(d, 4 * d), nn.GELU(),
                                     nn.Linear(4 * d, d))
            return ScaledMLP(d)

        self.stages = nn.ModuleList(nn.Sequential(*(block() for _ in range(n_block)))
                                    for _ in range(n_stage))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)                                          # (tokens, d)
        for stage in self.stages:
            if self.mode == "block_iadd":
                for block in stage:
                    h += block(h)
            elif self.mode == "stage_iadd":
                h += stage(h)
            else:
                h = stage(h)
        return self.head(h)


MODES = ("block_iadd", "stage_iadd", "relu_input")
# Where every block's input is written (``h += block(h)``, ``relu_`` first) no block may be a
# region, so there is no chain and the chain solver raises NotAChain, and the baselines find no
# block (``NoBlocks``); the others still plan the blocks' sub-modules where that drops something
# (``ScaledMLP.mlp``). Listed: the solvers whose plans broke backward before NOTE [clobbered
# inputs] (milp and auto happened to pick valid regions on the two iadd models).
CASES = [
    ("block_iadd", "greedy"),
    *(("stage_iadd", s) for s in ("every_block", "save_matmuls", "chain", "greedy")),
    *(("relu_input", s) for s in ("milp", "greedy", "auto")),
]
NO_BLOCKS = [(m, s) for m in ("block_iadd", "relu_input") for s in ("every_block", "save_matmuls", "sqrt")]


def _model(mode: str) -> nn.Module:
    torch.manual_seed(0)
    return InplaceNet(mode).train()


@pytest.mark.parametrize("budget", ["min", "mid"])
@pytest.mark.parametrize("mode,solver", CASES, ids=[f"{m}-{s}" for m, s in CASES])
@pytest.mark.slow
def test_plans_keep_in_place_writes_working(mode, solver, budget):
    """Plans at the smallest peak and halfway to the plain peak: bitwise equal to the plain
    twin over two steps, and ``memfit.verify`` agrees."""
    model = _model(mode)
    twin = copy.deepcopy(model)
    x = torch.randn(64, 32)
    if budget == "mid":
        plain_peak = memfit.profile(model, x).peak_bytes
        smallest = memfit.fit(copy.deepcopy(model), x, budget="min", search=memfit.Search(solver=solver))
        budget = (smallest.memfit_plan.predicted_peak_bytes + plain_peak) // 2
    memfit.fit(model, x, budget=budget, search=memfit.Search(solver=solver))
    assert_bitwise_twin(model, twin, (x.clone().requires_grad_(),), steps=2)
    report = memfit.verify(model, x)
    # The peak checks are left out: baselines ignore the budget, and the simulator reads a
    # few percent low on these blocks with or without in-place writes (a separate issue).
    failed = [c.name for c in report.checks if not c.passed and not c.name.startswith("peak")]
    assert report.bitwise and not failed, str(report)


@pytest.mark.parametrize("mode,solver", NO_BLOCKS, ids=[f"{m}-{s}" for m, s in NO_BLOCKS])
def test_baselines_find_no_block_whose_input_is_written_in_place(mode, solver):
    from memfit.planning.solvers.baselines import NoBlocks

    model = _model(mode)
    with pytest.raises(NoBlocks, match=rf"baseline '{solver}' found no blocks to checkpoint in "
                                       r"InplaceNet: .*an in-place write such as h \+= block\(h\)"):
        memfit.fit(model, torch.randn(64, 32), budget="min", search=memfit.Search(solver=solver))
    assert "memfit_plan" not in model.__dict__
