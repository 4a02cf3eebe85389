"""A flat nn.Sequential of layers (VGG's ``features``) gets a chain over merged blocks (NOTE
[merged blocks] in ``memfit.planning.candidates``): its plans are segments, peak as predicted
to the byte and give bitwise gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.planning.candidates import PlanningContext
from memfit.planning.solvers.chain import ChainModel
from memfit.profiling.tracer import trace

LAYERS = [16, 16, 16, 16, 16, 16, "M", 32, 32]  # 8 convolutions, each with an in-place ReLU


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c = 3
    for v in LAYERS:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            c = int(v)
    model = nn.Sequential(nn.Sequential(*layers), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    return model, torch.randn(32, 3, 16, 16)


@pytest.fixture(scope="module")
def case():  # type: ignore[no-untyped-def]
    model, x = _cnn()
    return model, x, trace(model, x, repeats=1)


def test_a_flat_sequential_is_a_chain_of_merged_blocks(case) -> None:
    _, _, prof = case
    ctx = PlanningContext(prof)
    chain = ctx.chains[0]
    assert chain.parent == "0"
    # each conv with its in-place ReLU, the max-pool alone (it drops its indices)
    assert chain.blocks == (("0.0", "0.1"), ("0.2", "0.3"), ("0.4", "0.5"), ("0.6", "0.7"),
                            ("0.8", "0.9"), ("0.10", "0.11"), ("0.12",), ("0.13", "0.14"),
                            ("0.15", "0.16"))
    # neither child of a pair is a region alone; the pair is
    assert ctx.candidate(("0.0",)) is None and ctx.candidate(("0.1",)) is None
    assert ctx.candidate(("0.0", "0.1")) is not None
    # the DP's constants hold on every block but the last, whose output the head's backward
    # releases (the chain's tail: its maximum there is used, NOTE [chain DP])
    model = ChainModel(ctx, chain)
    assert model.notes == ["chain: the effect of 0.15..0.16 is not constant over later blocks; "
                           "its maximum is used (conservative)"]


@pytest.mark.parametrize("solver", ["chain", "sqrt", "auto"])
@pytest.mark.parametrize("budget", ["70%", "85%"])
def test_plans_over_merged_blocks_peak_as_predicted_and_are_bitwise(case, solver, budget) -> None:
    model, x, prof = case
    p = memfit.plan(prof, budget=budget, solver=solver)
    assert p.regions and all(r.is_segment for r in p.regions)
    assert p.predicted_peak_bytes < prof.peak_bytes or solver == "sqrt"
    report = memfit.verify(model, x, plan=p)
    assert report.bitwise
    assert report.peak_bytes == p.predicted_peak_bytes


def test_sqrt_cuts_the_merged_blocks_into_segments(case) -> None:
    _, _, prof = case
    p = memfit.plan(prof, budget="100%", solver="sqrt")
    assert [r.name for r in p.regions] == ["0.0..0.5", "0.6..0.11", "0.12..0.16"]


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_zoo_chains_keep_their_single_module_blocks(name: str) -> None:
    """GPT's and ResNet's main chains are what they were: one module per block; ResNet's stem
    (conv, norm, relu) merges into a chain of its own, which the baselines do not take whole
    (NOTE [baseline blocks]): every_block still checkpoints its norm and relu."""
    from memfit import zoo

    model = zoo.build(name)
    prof = trace(model, zoo.example_inputs(model, batch=2), repeats=1)
    ctx = PlanningContext(prof)
    main = ctx.chains[0]
    assert main.parent == ("blocks" if name == "gpt" else "layers")
    assert all(len(blk) == 1 for blk in main.blocks)
    if name == "resnet":
        assert [c.blocks for c in ctx.chains[1:]] == [(("stem.0", "stem.1"), ("stem.2",))]
        every = memfit.plan(prof, budget="100%", solver="every_block")
        assert [r.name for r in every.regions] == ["stem.1", "stem.2", *main.modules(0, len(main.blocks) - 1)]
