"""memfit.runtime.compress: saved tensors of named ops kept packed, the step bitwise plain."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from runtime_helpers import assert_bitwise_twin, pair
from torch import nn

from memfit import zoo
from memfit.planning.compression import Compressed
from memfit.planning.plan import Plan
from memfit.runtime.apply import apply_plan, compressor, unapply
from memfit.runtime.compress import Compressor


def _cnn() -> nn.Module:
    # conv -> relu -> max-pool (relu's result is also max-pool's saved input: its bits save
    # nothing); linear -> relu -> dropout -> linear (relu's result is saved by relu alone)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Dropout(0.5), nn.Linear(36, 8), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(8, 2))


# B=2: conv out (2,4,6,6) fp32 = 1152 B; pool indices (2,4,3,3) int64 = 576 B -> int8 72 B;
# masks (2,36) and (2,8) fp32 = 288 B and 64 B -> 9+4 and 2+4 B; relu#1 (2,8) = 64 B -> 2 B
CNN_PLAN = (
    Compressed("aten.max_pool2d_with_indices.default#0", "narrow_int", "2", 576, 288, 1),
    Compressed("aten.div_.Scalar#0", "two_level", "4", 288, 13),
    Compressed("aten.relu.default#0", "sign_bit", "6", 64, 2),
    Compressed("aten.div_.Scalar#0", "two_level", "7", 64, 6),
)


def _plan(entries: tuple[Compressed, ...]) -> Plan:
    return Plan((), 0, 0.0, None, "test", "", compressed=entries)


def test_cnn_step_is_bitwise_plain_and_packs_exact_bytes() -> None:
    model, twin = pair(_cnn)
    apply_plan(model, _plan(CNN_PLAN))
    x = torch.randn(2, 2, 8, 8)
    assert_bitwise_twin(model, twin, (x,), steps=2)
    comp = compressor(model)
    # two steps: indices 576 -> 72 (int8: the 6x6 plane has 36 positions; the plan's bound
    # is int32), masks 288 -> 9 + 4 (72 bits + the value), 64 -> 2 + 4; relu bits 64 -> 2
    assert comp.raw_bytes == 2 * (576 + 288 + 64 + 64)
    assert comp.packed_bytes == 2 * (72 + 13 + 2 + 6)
    assert comp.kept_whole == 0
    unapply(model)
    assert compressor(model) is None


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [_saved_and_loaded, copy.deepcopy], ids=["torch.save", "deepcopy"])
def test_a_compressing_model_pickles_and_copies(copier) -> None:
    """The hooks are objects, not closures (NOTE [a fitted model pickles]): torch.save raised
    "Can't pickle local object 'Compressor.install.<locals>.end'" (issue #39). The copy packs
    its own saves, the same bytes, bitwise plain."""
    model, twin = pair(_cnn)
    apply_plan(model, _plan(CNN_PLAN))
    copied = copier(model)
    assert_bitwise_twin(copied, twin, (torch.randn(2, 2, 8, 8),), steps=2)
    comp = compressor(copied)
    assert comp is not compressor(model) and compressor(model).raw_bytes == 0
    assert (comp.raw_bytes, comp.packed_bytes) == (2 * (576 + 288 + 64 + 64), 2 * (72 + 13 + 2 + 6))


def test_relu_bits_go_only_to_relus_own_save() -> None:
    # relu#0's result is saved twice: by relu (its bits) and by max-pool (whole, read by value)
    model, twin = pair(_cnn)
    apply_plan(model, _plan((Compressed("aten.relu.default#0", "sign_bit", "1", 1152, 36),)))
    assert_bitwise_twin(model, twin, (torch.randn(2, 2, 8, 8),))
    assert compressor(model).packed_bytes == 36


def test_relu_without_a_node_is_not_packed() -> None:
    # relu of an input that needs no grad has no node; the next linear saves its result whole
    model, twin = pair(lambda: nn.Sequential(nn.ReLU(), nn.Linear(4, 3)))
    apply_plan(model, _plan((Compressed("aten.relu.default#0", "sign_bit", "0"),)))
    assert_bitwise_twin(model, twin, (torch.randn(5, 4),))
    assert compressor(model).packed_bytes == 0


def test_gpt_dropout_masks_lossless() -> None:
    model, twin = pair(lambda: zoo.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16))
    ids = torch.randint(0, 64, (2, 16))
    # every dropout's mask: the embedding's, and per block attention probs + two residuals
    drops = ["drop"] + [f"blocks.{i}.{d}" for i in range(2)
                        for d in ("attn.attn_drop", "attn.resid_drop", "mlp.drop")]
    masks = tuple(Compressed("aten.div_.Scalar#0", "two_level", d) for d in drops)
    apply_plan(model, _plan(masks))
    assert_bitwise_twin(model, twin, (ids,), steps=2)
    comp = compressor(model)
    # per step: embedding (2,16,32) 4096 B; per block attn (2,4,16,16) 2048 elements 8192 B
    # and two residual (2,16,32) 4096 B
    assert comp.raw_bytes == 2 * (4096 + 2 * (8192 + 2 * 4096))
    assert comp.packed_bytes == 2 * ((128 + 4) + 2 * ((256 + 4) + 2 * (128 + 4)))


def test_lossy_bf16_changes_gradients_a_little() -> None:
    model, twin = pair(_cnn)
    apply_plan(model, _plan((Compressed("aten.mul.Tensor#0", "bf16", "4"),)))
    x = torch.randn(2, 2, 8, 8)
    torch.manual_seed(0)
    model(x).square().mean().backward()
    torch.manual_seed(0)
    twin(x).square().mean().backward()
    g, ref = model[5].weight.grad, twin[5].weight.grad
    assert compressor(model).packed_bytes == 144  # the first dropout's output, 72 floats
    # the linear's weight gradient reads its input in bf16: 2^-8 relative error per element,
    # sums of a few terms: stated bound 2^-7 in norm
    assert 0 < float((g - ref).norm() / ref.norm()) <= 2.0**-7


def test_bad_decisions() -> None:
    with pytest.raises(ValueError, match="only the nodes of"):
        Compressor([("", "aten.gelu.default#0", "sign_bit", 0)])
    with pytest.raises(ValueError, match="not of the form"):
        Compressor([("", "aten.relu.default", "sign_bit", 0)])
    with pytest.raises(ValueError, match="does not have"):
        Compressor([("9", "aten.relu.default#0", "sign_bit", 0)]).install(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown codec"):
        Compressed("aten.relu.default#0", "zip")


def test_unet_pool_indices_narrowed_and_its_input_freed_bitwise() -> None:
    import memfit
    from memfit.planning.compress_pass import with_compression

    model, twin = pair(lambda: zoo.unet3d(base=2, depth=1))
    x = torch.randn(1, 1, 8, 8, 8)
    prof = memfit.profile(model, x)
    plan = with_compression(prof, Plan((), prof.peak_bytes, 0.0, None, "none", prof.signature))
    # the encoder's last relu result is saved by relu and by the pool (its geometry only:
    # NOTE [geometry-only readers]): its bits and shape_only; the other relu results are the
    # next conv's saved inputs; the pool's indices narrowed
    assert [(c.module, c.codec, c.raw_bytes) for c in plan.compressed] == [
        ("down.0.act", "sign_bit", 4096), ("pool", "shape_only", 0), ("pool", "narrow_int", 1024)]
    # the block's one relu module runs twice; the second call's result is the pool's input
    assert [c.call for c in plan.compressed] == [1, None, None]
    assert plan.compressed[0].key == "aten.relu.default#0"
    assert Plan.from_dict(plan.to_dict()).compressed == plan.compressed
    apply_plan(model, plan)
    assert_bitwise_twin(model, twin, (x,))
    # (1, 2, 8, 8, 8) fp32 relu result: 1,024 bits, 128 B; (1, 2, 4, 4, 4) int64 indices into
    # an 8^3 plane (values < 512): int16, 256 B
    comp = compressor(model)
    assert (comp.raw_bytes, comp.packed_bytes, comp.geometry_saves) == (4096 + 1024, 128 + 256, 1)
