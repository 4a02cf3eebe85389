from __future__ import annotations

import pytest
import torch
from profiling_models import TinyGPT, gpt_inputs, mlp
from torch import nn

from memfit.profiling.measure import measure
from memfit.profiling.profile import Phase, Profile, StorageKind
from memfit.profiling.tracer import trace


def _mlp_profile() -> tuple[nn.Module, torch.Tensor, Profile]:
    model, x = mlp(), torch.randn(32, 64)
    return model, x, trace(model, x, repeats=1)


def _live_by_brute_force(p: Profile) -> list[int]:
    # The simulator's contract, written independently of the library's difference array:
    # live storages plus the op's own kernel workspace (NOTE [storage lifetimes]).
    out = []
    for i in range(len(p.ops)):
        out.append(sum(
            s.nbytes for s in p.storages
            if s.kind in (StorageKind.ACTIVATION, StorageKind.GRADIENT)
            and s.created_by is not None and s.created_by <= i
            and (s.freed_after is None or s.freed_after >= i)) + p.ops[i].workspace_bytes)
    return out


def test_mlp_saved_storages_and_peak_by_hand() -> None:
    # Linear(64,128) -> ReLU -> Linear(128,10), batch 32, fp32. Autograd saves: the input x
    # (for dW0), W1 (for dX1) and the ReLU output (for dW1 and for ReLU's own backward),
    # 32*128*4 = 16384 bytes; the pre-ReLU addmm output is not saved and dies at the ReLU.
    _, _, p = _mlp_profile()
    saved_act = [s for s in p.storages if s.saved and s.kind == StorageKind.ACTIVATION]
    assert [s.nbytes for s in saved_act] == [16384]
    relu_out = saved_act[0]
    assert p.ops[relu_out.created_by].name == "aten.relu.default"
    assert {p.storage(i).kind for i in range(len(p.storages))
            if p.storage(i).saved and p.storage(i).kind != StorageKind.ACTIVATION} == {
        StorageKind.INPUT, StorageKind.PARAMETER}
    assert sorted(s.nbytes for s in p.storages if s.saved) == [5120, 8192, 16384]
    pre_relu = next(s for s in p.storages if s.kind == StorageKind.ACTIVATION and s.nbytes == 16384
                    and not s.saved)
    assert p.ops[pre_relu.created_by].name == "aten.addmm.default"
    assert pre_relu.freed_after == relu_out.created_by
    # first_unpack: a backward op; last_forward_use: the second addmm read it last.
    assert p.ops[relu_out.first_unpack].phase is Phase.BACKWARD
    assert p.ops[relu_out.last_forward_use].name == "aten.addmm.default"
    assert p.ops[relu_out.last_forward_use].module == "2"
    # Peak: the step keeps the output (32*10*4 = 1280) through backward, as a training loop
    # holding `out` does; while layer 0's bias grad is made, live are: out 1280 + loss 4 +
    # its grad 4 + dW1 5120 + db1 40 + dZ0 16384 + dW0 32768 + db0 512 = 56112 bytes.
    assert p.peak_bytes == 56112
    # Baseline: parameters (33280 + 5160) + the input 32*64*4 = 8192.
    assert p.baseline_bytes == 33280 + 5160 + 8192
    grads = sorted(s.nbytes for s in p.storages if s.kind == StorageKind.GRADIENT and s.freed_after is None)
    assert grads == [40, 512, 5120, 32768]


@pytest.mark.parametrize("model_id", ["mlp", "gpt"])
def test_live_bytes_contract_and_tracker_peak(model_id: str) -> None:
    if model_id == "mlp":
        _, _, p = _mlp_profile()
    else:
        p = trace(TinyGPT(), gpt_inputs(), loss_fn=lambda out: out, repeats=1)
    assert list(p.live_bytes) == _live_by_brute_force(p)
    assert p.peak_bytes == max(p.live_bytes) == p.extra["tracked_peak_bytes"]
    assert len(p.live_bytes) == len(p.ops)
    assert all(op.index == i for i, op in enumerate(p.ops))
    assert all(op.phase is (Phase.FORWARD if i < p.n_forward else Phase.BACKWARD)
               for i, op in enumerate(p.ops))


def test_profile_peak_equals_allocator_meter() -> None:
    model, x = TinyGPT(), gpt_inputs()

    def step() -> None:
        out = model(x)
        out.backward()

    r = measure(step, model=model)
    p = trace(model, x, loss_fn=lambda out: out, repeats=1)
    assert p.peak_bytes == r.peak_bytes == r.allocator_peak_bytes


class _Fc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Fc() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_module_paths_forward_and_backward() -> None:
    p = trace(_Stack(), torch.randn(4, 8), repeats=1)
    fwd = [(op.name, op.module) for op in p.forward_ops]
    assert ("aten.addmm.default", "layers.1.fc") in fwd
    assert ("aten.tanh.default", "layers.1") in fwd
    # Backward ops carry the module whose forward they differentiate.
    bwd = [(op.name, op.module) for op in p.backward_ops]
    assert ("aten.tanh_backward.default", "layers.1") in bwd
    assert ("aten.mm.default", "layers.1.fc") in bwd
    rec = p.module("layers.1.fc")
    assert rec.type == "Linear" and rec.parent == "layers.1" and rec.calls == 1
    assert rec.parameter_bytes == (8 * 8 + 8) * 4
    assert {p.ops[i].module for i in range(rec.first_op, rec.last_op + 1)} == {"layers.1.fc"}
    assert p.module("layers").children == ("layers.0", "layers.1", "layers.2")
    assert p.module("").parent is None
    assert rec.inputs == p.module("layers.0").outputs
    assert p.module("layers.1").backward_time_s >= p.module("layers.1.fc").backward_time_s > 0


def test_views_share_one_storage() -> None:
    class Views(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2                         # (4, 6): 96 bytes, the only new storage
            z = y.view(6, 4).t().transpose(0, 1)[1:]
            return z.sum() + y.reshape(-1)[0]

    x = torch.randn(4, 6, requires_grad=True)
    p = trace(Views(), x, repeats=1)
    fwd_created = [p.storage(o.storage) for op in p.forward_ops for o in op.outputs
                   if p.storage(o.storage).created_by == op.index]
    big = [s for s in fwd_created if s.nbytes == 96]
    assert len(big) == 1
    view_ops = [op for op in p.forward_ops if op.name in ("aten.view.default", "aten.t.default")]
    assert view_ops and all(o.storage == big[0].id for op in view_ops for o in op.outputs)


def test_flags_flops_and_time() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(32, 4))
    p = trace(model, torch.randn(8, 16), repeats=2)
    names = {op.name: op for op in p.forward_ops}
    assert names["aten.relu_.default"].inplace
    assert not names["aten.addmm.default"].inplace
    assert any(op.random for op in p.forward_ops)
    assert all(not op.random for op in p.forward_ops if op.name.startswith("aten.addmm"))
    # addmm (8x16 @ 16x32): 2*8*16*32 FLOPs.
    assert p.forward_ops[1].name == "aten.addmm.default" and p.forward_ops[1].flops == 2 * 8 * 16 * 32
    assert all(op.time_s > 0 for op in p.ops)
    assert p.step_time_s > 0 and p.cost_model == "measured"


def test_state_left_as_found() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    g = torch.full_like(model[0].weight, 3.0)
    model[0].weight.grad = g
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    rng = torch.get_rng_state()
    trace(model, x, repeats=2)
    assert model[0].weight.grad is g and torch.equal(g, torch.full_like(g, 3.0))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "0.weight")
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert all(torch.equal(v, params[k]) for k, v in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class _HFStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        y = self.lin(x)
        return {"logits": y, "loss": (y * y).mean()}


@pytest.mark.parametrize("inputs_kind", ["tensor", "tuple", "dict"])
def test_input_forms_and_default_loss(inputs_kind: str) -> None:
    x = torch.randn(3, 4)
    inputs = {"tensor": x, "tuple": (x,), "dict": {"x": x, "scale": 2.0}}[inputs_kind]
    p = trace(_HFStyle(), inputs, repeats=1)
    # The loss is output["loss"] (mean of y*y), not the sum over outputs.
    assert any(op.name == "aten.mean.default" for op in p.forward_ops)
    assert not any(op.name == "aten.sum.default" for op in p.forward_ops)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        trace(lambda x: x, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="example_inputs"):
        trace(mlp(), 3)
    with pytest.raises(ValueError, match="measure"):
        trace(mlp(), torch.randn(2, 64), mode="simulate")


def test_profile_leaves_input_grads_as_found():
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    y = torch.randn(2, 3, requires_grad=True)
    y.grad = torch.full((2, 3), 7.0)
    trace(m, (x, ), repeats=1)
    assert x.grad is None
    trace(_TwoInputs(), (x, y), repeats=1)
    assert x.grad is None
    assert torch.equal(y.grad, torch.full((2, 3), 7.0))


class _TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) * b


def test_mutable_twins_have_the_frozen_records_fields():
    """TracedStorage and the module recorder's records freeze into StorageRecord and
    ModuleRecord field for field, so the two cannot drift apart."""
    from dataclasses import fields

    from memfit.profiling.modules import _Mod
    from memfit.profiling.profile import ModuleRecord, StorageKind, StorageRecord
    from memfit.profiling.storages import TracedStorage

    assert [f.name for f in fields(TracedStorage)] == [f.name for f in fields(StorageRecord)][1:]
    assert [f.name for f in fields(_Mod)] == [f.name for f in fields(ModuleRecord)][:-1]
    ts = TracedStorage(64, StorageKind.ACTIVATION, created_by=3, freed_after=9, saved=True,
                       first_unpack=7, last_forward_use=4)
    assert ts.freeze(5) == StorageRecord(5, 64, StorageKind.ACTIVATION, 3, 9, True, 7, 4)
    m = _Mod("a.b", "Linear", "a", ["a.b.c"], 1, 2, 1, (0,), (1,), 128)
    assert m.freeze(0.5) == ModuleRecord("a.b", "Linear", "a", ("a.b.c",), 1, 2, 1, (0,), (1,), 128, 0.5)
