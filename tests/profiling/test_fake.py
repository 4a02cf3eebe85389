"""Fake mode: memory exact on the meta device; a 7B Llama profiled on a CPU-only machine.

Llama activation bytes per decoder layer, eager attention, batch 1, training, no KV cache,
bf16 weights (b = 1, s = sequence, h = hidden, i = intermediate, n = heads). What autograd
saves, read off the Hugging Face LlamaDecoderLayer (RMSNorm computes in fp32):
  each of the 2 RMSNorms: the fp32 upcast of its input (4sh), rsqrt (4s), the bf16 downcast
      (2sh, saved by the weight multiply) and its output (2sh, saved by the next matmuls)
      -> 2 * (8sh + 4s)
  attention: v (2sh), q and k after rotary (2sh each), softmax output in fp32 (4ns^2),
      its bf16 cast (2ns^2, saved by probs @ v), the transposed attention output made
      contiguous (2sh, saved by o_proj)                          -> 8sh + 6ns^2
  MLP: gate_proj out, silu out, up_proj out, their product (2si each) -> 8si
  total per layer = 24sh + 8s + 6ns^2 + 8si   (residual adds save nothing)
Outside the layers: rotary cos and sin in bf16 (2 * 2 * s * 128), the final norm (8sh + 4s),
the labels padded by one (8(s+1), int64), log_softmax of the fp32 logits (4sV) and
nll_loss's total_weight (4).
Parameters: 2Vh (embeddings + untied lm_head) + L(4h^2 + 3hi + 2h) + h, times 2 bytes.
"""

from __future__ import annotations

import pytest
import torch
from profiling_models import TinyGPT, gpt_inputs

from memfit.profiling.cpu_rates import calibrate_cpu
from memfit.profiling.profile import StorageKind
from memfit.profiling.tracer import trace
from memfit.timemodel.devices import PRESETS, op_time_s, preset


def test_fake_mode_matches_measure_mode_byte_for_byte() -> None:
    # target "cpu": the CPU's kernels, as measured here (a GPU target traces a GPU's dropout:
    # test_fake_gpu.py)
    model, x = TinyGPT(), gpt_inputs()
    real = trace(model, x, loss_fn=lambda out: out, repeats=1)
    fake = trace(model, x, loss_fn=lambda out: out, mode="fake", target="cpu")
    assert [o.name for o in fake.ops] == [o.name for o in real.ops]
    assert fake.signature == real.signature
    key = lambda s: (s.nbytes, s.kind, s.created_by, s.freed_after, s.saved,  # noqa: E731
                     s.first_unpack, s.last_forward_use)
    assert [key(s) for s in fake.storages] == [key(s) for s in real.storages]
    # fake mode models no kernel workspace (NOTE [kernel workspaces]): the tensors, exactly
    tensors = tuple(v - o.workspace_bytes for v, o in zip(real.live_bytes, real.ops, strict=True))
    assert fake.live_bytes == tensors and fake.peak_bytes == max(tensors)
    assert fake.cost_model == "roofline:cpu" and fake.mode == "fake"
    assert all(p.grad is None for p in model.parameters())   # the model was not touched


def test_fake_mode_under_autocast_matches_measure_mode_byte_for_byte() -> None:
    """NOTE [fake mode under autocast]: on meta tensors autocast did nothing (this model
    profiled 22% over in fake mode, in float32 and 52 ops short)."""
    model, x = TinyGPT(), gpt_inputs()
    with torch.autocast("cpu", torch.bfloat16):
        real = trace(model, x, loss_fn=lambda out: out.float(), repeats=1)
        fake = trace(model, x, loss_fn=lambda out: out.float(), mode="fake", target="h100")
    assert [o.name for o in fake.ops] == [o.name for o in real.ops]
    assert sum(o.name == "aten._to_copy.default" for o in fake.ops) > 0
    key = lambda s: (s.nbytes, s.kind, s.created_by, s.freed_after, s.saved,  # noqa: E731
                     s.first_unpack, s.last_forward_use, s.autocast_cached)
    assert [key(s) for s in fake.storages] == [key(s) for s in real.storages]
    assert any(s.autocast_cached for s in fake.storages)
    # the real profile adds the kernel workspaces it measures (bfloat16 matrix products pack
    # their operands on a CPU with AMX; NOTE [workspace measurement]), the h100 profile the
    # CUDA temporaries measured on a GPU (NOTE [CUDA kernels in fake mode], 5): the tensors
    # are the same, byte for byte
    tensors = [b - op.workspace_bytes for b, op in zip(real.live_bytes, real.ops, strict=True)]
    fake_tensors = [b - op.workspace_bytes for b, op in zip(fake.live_bytes, fake.ops, strict=True)]
    assert fake_tensors == tensors
    assert sum(op.workspace_bytes > 0 for op in fake.ops) == 2  # the two softmax backwards
    assert fake.peak_bytes == max(fake.live_bytes)
    plain = trace(model, x, loss_fn=lambda out: out, mode="fake", target="h100")
    assert plain.peak_bytes > fake.peak_bytes  # float32 activations, as before the fix


def _llama(n_layer: int, seq: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=n_layer,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=seq, attn_implementation="eager", tie_word_embeddings=False,
        use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def _check_llama(n_layer: int, seq: int) -> None:
    """The saved bytes of a fake-mode Llama by formula. How long the trace takes is a benchmark
    (``python -m benchmarks.fake_speed``), not asserted: a unit test's wall clock moves with
    the machine's load."""
    model, inputs = _llama(n_layer, seq)
    p = trace(model, inputs, mode="fake", target="h100")
    s, h, i, n, V, L = seq, 4096, 11008, 32, 32000, n_layer
    param_bytes = 2 * (2 * V * h + L * (4 * h * h + 3 * h * i + 2 * h) + h)
    assert sum(r.nbytes for r in p.storages if r.kind == StorageKind.PARAMETER) == param_bytes
    per_layer = 24 * s * h + 8 * s + 6 * n * s * s + 8 * s * i
    by_layer: dict[str, int] = {}
    for r in p.storages:
        if r.saved and r.kind == StorageKind.ACTIVATION:
            mod = p.ops[r.created_by].module
            key = ".".join(mod.split(".")[:3]) if mod.startswith("model.layers.") else "outside"
            by_layer[key] = by_layer.get(key, 0) + r.nbytes
    assert {k: v for k, v in by_layer.items() if k != "outside"} == {
        f"model.layers.{k}": per_layer for k in range(L)}
    outside = 2 * 2 * s * 128 + (8 * s * h + 4 * s) + 8 * (s + 1) + 4 * s * V + 4
    assert by_layer["outside"] == outside
    assert p.saved_bytes == L * per_layer + outside
    assert p.peak_bytes > p.saved_bytes and p.step_time_s > 0


def test_llama_two_layers_fake_bytes_by_formula() -> None:
    _check_llama(2, 4096)


@pytest.mark.slow
def test_llama_7b_fake_bytes_by_formula() -> None:
    # The full 7B (32 layers, seq 4096): ~2-3 s here (benchmarks/fake_speed.py; target 60 s).
    _check_llama(32, 4096)


def test_roofline_cost_model() -> None:
    h100 = preset("h100")
    # A 4096^3 bf16 matmul is compute bound: 2*4096^3 / 989.5e12 s + 4 us overhead.
    flops = 2 * 4096**3
    moved = 3 * 4096 * 4096 * 2
    assert op_time_s(flops, moved, "bfloat16", h100) == pytest.approx(flops / 989.5e12 + 4e-6, rel=1e-12)
    # An elementwise op is memory bound.
    assert op_time_s(0, moved, "bfloat16", h100) == pytest.approx(moved / 3350e9 + 4e-6, rel=1e-12)
    # fp32 math uses the fp32 peak; a view is free.
    assert op_time_s(flops, 0, "float32", h100) == pytest.approx(flops / 67e12 + 4e-6, rel=1e-12)
    assert op_time_s(0, 0, "float32", h100) == 0.0
    assert set(PRESETS) == {"cpu", "v100", "a100", "h100", "h200"}
    with pytest.raises(ValueError, match="known device presets"):
        preset("tpu")


def test_calibrate_cpu_measures_positive_rates() -> None:
    c = calibrate_cpu(n=128, copy_bytes=2**20, repeats=1)
    assert c.fp32_flops_per_s > 1e8 and c.bandwidth_bytes_per_s > 1e8
