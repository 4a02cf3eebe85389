"""benchmarks.gpu_probe: the torch-only side a GPU runs (whole-region checkpointing by module
path) and the report's booking of seconds to op types."""

from __future__ import annotations

import copy

import pytest
import torch
from benchmarks.gpu_probe_cases import checkpoint_regions
from benchmarks.gpu_probe_report import by_kind, kind, measured_time_profile
from torch import nn

import memfit


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Linear(32, 4))


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model(x).pow(2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("regions", [[["0"]], [["2", "3"]], [["0", "1"], ["4.0"], ["5"]]],
                         ids=["one module", "run of siblings", "three regions"])
def test_checkpointed_regions_give_the_plain_gradients_bitwise(regions: list[list[str]]) -> None:
    plain, ckpt = _net(), _net()
    checkpoint_regions(ckpt, regions)
    x = torch.randn(8, 16)
    ref, got = _grads(plain, x), _grads(ckpt, x)
    assert len(got) == len(ref)
    for (n, g), (m, h) in zip(sorted(ref.items()), sorted(got.items()), strict=True):
        assert torch.equal(g, h), (n, m)
    assert sum(type(m).__name__ == "_Checkpointed" for m in ckpt.modules()) == len(regions)


def test_a_run_of_siblings_needs_a_sequential_parent() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(TypeError, match="nn.Sequential parent"):
        checkpoint_regions(nn.Sequential(Two()), [["0.a", "0.b"]])


@pytest.mark.parametrize(("name", "expected"), [
    ("aten.convolution_backward.default", "conv"),
    ("aten.cudnn_batch_norm_backward.default", "batch norm"),
    ("aten.native_batch_norm.default", "batch norm"),
    ("aten.threshold_backward.default", "relu"),
    ("aten._scaled_dot_product_cudnn_attention.default", "attention"),
    ("aten._softmax_backward_data.default", "softmax"),
    ("aten.native_dropout_backward.default", "dropout"),
    ("aten.addmm.default", "matmul"),
    ("aten.add.Tensor", "add"),
    ("aten.add_.Tensor", "other"),
    ("aten.view.default", "other"),
])
def test_op_types(name: str, expected: str) -> None:
    assert kind(name) == expected


def test_measured_time_profile_books_each_op_type_its_measured_seconds() -> None:
    prof = memfit.profile(copy.deepcopy(_net()), torch.randn(8, 16), repeats=1)
    roof = by_kind([(o.name, o.phase, o.time_s) for o in prof.ops])
    measured = {ph: {k: 3.0 * v + 1e-3 for k, v in d.items()} for ph, d in roof.items()}
    cal = measured_time_profile(prof, measured)
    got = by_kind([(o.name, o.phase, o.time_s) for o in cal.ops])
    for ph, d in measured.items():
        for k, v in d.items():
            if roof[ph][k] > 0:
                assert got[ph][k] == pytest.approx(v, rel=1e-12)   # float sums of scaled terms
    assert cal.step_time_s == pytest.approx(sum(o.time_s for o in cal.ops), rel=1e-12)
