"""GPU-faithful fake mode: a GPU target traces the dropout and attention kernels CUDA runs.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1) count the bytes one GPT layer saves for backward in 16-bit precision, with
dropout on the attention probabilities and after the attention and MLP blocks (s sequence,
b micro-batch, h hidden, a heads):
    attention   11sbh + 5as^2b: the QKV input 2sbh, Q and K 4sbh, the softmax output 2as^2b,
                its dropout mask as^2b (1 byte), the dropout output 2as^2b and V 2sbh, the
                projection's input 2sbh, the attention dropout's mask sbh
    MLP         19sbh: the two linears' inputs 2sbh and 8sbh, GELU's input 8sbh, the mask sbh
    layer norms 4sbh: each LayerNorm's input 2sbh
    total       34sbh + 5as^2b
PyTorch's LayerNorm also keeps a float32 mean and rstd per token (2 x 2 x 4sb = 16sb): the
exact figure is 34sbh + 5as^2b + 16sb. CPU dropout (which fake mode took before GPU targets
traced CUDA's) keeps its masks in bf16 instead: 36sbh + 6as^2b + 16sb.

With flash attention (``F.scaled_dot_product_attention``, dropout inside, causal) the three
s^2 terms are gone: flash saves q, k, v (views of the QKV output: 6sbh, the Q, K, V of the
count), its output (the projection's input, 2sbh), a float32 logsumexp of (b, a, s) (4asb) and
its RNG state (a 2-element uint64 seed and a uint64 offset: 24 B): 34sbh + 4asb + 24 + 16sb.

"Saved bytes per layer" is the difference between the profiles of 2 and 1 layers: a layer's
input is saved by its first LayerNorm, and in a 1-layer stack that input is the example input
(not an activation), in a 2-layer stack the first layer's output. The difference is exactly one
layer with its input, as the count has it (attributing storages to modules would give the
input to the layer before). Fake mode only makes meta tensors, so these sizes (a 6144-wide
layer at sequence 2048 saves 7 GB) run in about a second each.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from profiling_models import TinyGPT, gpt_inputs
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import memfit
from memfit.planning.plan import OpPolicy
from memfit.profiling.profile import Profile
from memfit.profiling.sdpa_rules import (
    CUDA_ARCHS,
    CudaArch,
    SdpaCall,
    SdpSettings,
    problems,
    select_backend,
)
from memfit.profiling.sdpa_rules import SdpBackend as Backend
from memfit.profiling.tracer import check_profile_matches, trace

BF16 = torch.bfloat16
FLASH = "aten._scaled_dot_product_flash_attention.default"
EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
CUDNN = "aten._scaled_dot_product_cudnn_attention.default"


class MegatronLayer(nn.Module):
    """A pre-LN GPT layer as the count above has it (the attention written out, or SDPA)."""

    def __init__(self, h: int, a: int, s: int, attention: str = "eager", p: float = 0.1) -> None:
        super().__init__()
        self.a, self.attention, self.p = a, attention, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.attn_drop, self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)
        self.register_buffer("future", torch.ones(s, s, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.a
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)                  # (b, s, h) each
        q, k, v = (t.view(b, s, self.a, d).transpose(1, 2) for t in (q, k, v))  # (b, a, s, d)
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)   # (b, a, s, s)
            probs = torch.softmax(scores.masked_fill(self.future[:s, :s], -math.inf), dim=-1)
            o = torch.matmul(self.attn_drop(probs), v)                     # (b, a, s, d)
        x = x + self.drop1(self.proj(o.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def _stack(n: int, h: int, a: int, s: int, attention: str) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(MegatronLayer(h, a, s, attention) for _ in range(n))).to(BF16)


def _profiles(h: int, a: int, s: int, b: int, attention: str, target: str) -> tuple[Profile, Profile]:
    x = torch.zeros(b, s, h, dtype=BF16, device="meta")
    one, two = (trace(_stack(n, h, a, s, attention), x, mode="fake", target=target)
                for n in (1, 2))
    return one, two


SHAPES = [pytest.param(6144, 64, 2048, 4, id="h6144-a64-s2048-b4"),
          pytest.param(4096, 32, 8192, 1, id="h4096-a32-s8192-b1")]


@pytest.mark.parametrize(("h", "a", "s", "b"), SHAPES)
def test_megatron_layer_saves_what_korthikanti_counts(h: int, a: int, s: int, b: int) -> None:
    one, two = _profiles(h, a, s, b, "eager", "a100")
    per_layer = two.saved_bytes - one.saved_bytes
    formula = 34 * s * b * h + 5 * a * s * s * b
    assert per_layer == formula + 16 * s * b          # + LayerNorm's fp32 mean and rstd
    assert abs(per_layer / formula - 1) < 0.01        # 1.0000: 6144 -> +0.0062%, 4096 -> +0.0093%
    assert two.extra["cuda_kernels"] == {"native_dropout": 6}
    assert {o.name for o in two.ops} >= {"aten.native_dropout.default",
                                         "aten.native_dropout_backward.default"}
    assert not any(o.name.startswith("aten.bernoulli") for o in two.ops)
    # before GPU targets traced CUDA's dropout (and with target "cpu" still): masks in bf16
    cpu_one, cpu_two = _profiles(h, a, s, b, "eager", "cpu")
    cpu = cpu_two.saved_bytes - cpu_one.saved_bytes
    assert cpu == 36 * s * b * h + 6 * a * s * s * b + 16 * s * b
    assert cpu / formula == pytest.approx({6144: 1.1659, 4096: 1.1865}[h], abs=1e-4)
    assert "cuda_kernels" not in cpu_two.extra


@pytest.mark.parametrize(("h", "a", "s", "b"), SHAPES)
def test_megatron_layer_with_sdpa_saves_what_flash_saves(h: int, a: int, s: int, b: int) -> None:
    one, two = _profiles(h, a, s, b, "sdpa", "a100")
    per_layer = two.saved_bytes - one.saved_bytes
    flash = 34 * s * b * h - 0 * (a * s * s * b) + 4 * a * s * b  # no s^2 term; the logsumexp
    assert per_layer == flash + 24 + 16 * s * b                    # RNG state, LayerNorm stats
    assert abs(per_layer / flash - 1) < 0.02
    assert two.extra["cuda_kernels"] == {"native_dropout": 4, "sdpa:flash": 2}
    names = [o.name for o in two.ops]
    assert names.count(FLASH) == 2
    assert names.count("aten._scaled_dot_product_flash_attention_backward.default") == 2
    assert "aten._safe_softmax.default" not in names
    lse = [o.outputs[1] for o in two.ops if o.name == FLASH]
    assert [(m.shape, m.dtype) for m in lse] == [((b, a, s), "float32")] * 2
    # the math fallback fake mode took before: an fp32 softmax, fp32 dropout mask and output
    cpu_one, cpu_two = _profiles(h, a, s, b, "sdpa", "cpu")
    assert cpu_two.saved_bytes - cpu_one.saved_bytes > 12 * a * s * s * b


def _sdpa_profile(q_shape: tuple[int, ...], dtype: torch.dtype = BF16, *, kv_heads: int | None = None,
                  mask: bool = False, dropout: float = 0.0, causal: bool = False,
                  gqa: bool = False, target: str = "a100") -> Profile:
    b, n, s, d = q_shape
    kv = (b, kv_heads or n, s, d)

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            m = torch.ones(s, s, dtype=torch.bool, device=q.device).tril() if mask else None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout,
                                                  is_causal=causal, enable_gqa=gqa)

    qkv = tuple(torch.zeros(shape, dtype=dtype, device="meta", requires_grad=True)
                for shape in (q_shape, kv, kv))
    return trace(Attention(), qkv, mode="fake", target=target)


@pytest.mark.parametrize(("case", "kwargs", "op", "backend"), [
    ("bf16 causal", dict(q_shape=(2, 8, 256, 64), causal=True), FLASH, "flash"),
    ("fp16 dropout", dict(q_shape=(2, 8, 256, 64), dtype=torch.float16, dropout=0.1), FLASH, "flash"),
    ("fp32: not flash", dict(q_shape=(2, 8, 256, 64), dtype=torch.float32), EFFICIENT, "efficient"),
    ("attn_mask: efficient", dict(q_shape=(2, 8, 256, 64), mask=True), EFFICIENT, "efficient"),
    ("head dim 512: efficient", dict(q_shape=(1, 2, 64, 512)), EFFICIENT, "efficient"),
    ("head dim 260: math", dict(q_shape=(1, 2, 64, 260), dropout=0.1), "aten._safe_softmax.default",
     "math"),
    ("gqa", dict(q_shape=(2, 8, 128, 64), kv_heads=2, gqa=True, causal=True), FLASH, "flash"),
    ("fp32 gqa: math", dict(q_shape=(2, 8, 128, 64), dtype=torch.float32, kv_heads=2, gqa=True,
                            causal=True), "aten._safe_softmax.default", "math"),
    ("h100 bf16", dict(q_shape=(2, 8, 256, 128), target="h100"), FLASH, "flash"),
])
def test_sdpa_backend_follows_torchs_rules(case: str, kwargs: dict, op: str, backend: str) -> None:
    p = _sdpa_profile(**kwargs)
    names = [o.name for o in p.ops]
    assert op in names, case
    assert {k for k in p.extra["cuda_kernels"] if k.startswith("sdpa:")} == {f"sdpa:{backend}"}
    fused = {FLASH, EFFICIENT, CUDNN} - {op}
    assert not fused & set(names)


def test_math_fallback_keeps_a_bool_dropout_mask_and_an_fp32_softmax() -> None:
    b, n, s, d = 1, 2, 64, 260
    p = _sdpa_profile((b, n, s, d), dropout=0.1)
    assert p.extra["cuda_kernels"] == {"native_dropout": 1, "sdpa:math": 1}
    drop = next(o for o in p.ops if o.name == "aten.native_dropout.default")
    assert [(m.shape, m.dtype) for m in drop.outputs] == [((b, n, s, s), "float32"),
                                                          ((b, n, s, s), "bool")]
    softmax = next(o for o in p.ops if o.name == "aten._safe_softmax.default")
    assert p.storage(softmax.outputs[0].storage).saved
    # saved: the fp32 upcasts of q, k, v scaled (q and k^T; v), the fp32 softmax, its bool
    # mask and the fp32 dropout output
    fp32_qkv = 3 * 4 * b * n * s * d
    assert p.saved_bytes == fp32_qkv + (4 + 1 + 4) * b * n * s * s


def test_math_fallback_without_dropout_runs_torchs_own_composite() -> None:
    """The math kernel written out (for its dropout) dispatches what torch's
    ``_scaled_dot_product_attention_math`` dispatches on meta, where it takes an out-of-place
    ``add`` for the mask (fake tensors count as tensor subclasses); CUDA adds in place."""
    kw = dict(q_shape=(1, 2, 64, 260), causal=True)
    ours, torchs = _sdpa_profile(**kw), _sdpa_profile(**kw, target="cpu")
    assert ours.extra["cuda_kernels"] == {"sdpa:math": 1}
    rename = {"aten.add.Tensor": "aten.add_.Tensor"}
    assert [o.name for o in ours.forward_ops] == [rename.get(o.name, o.name)
                                                  for o in torchs.forward_ops]
    assert ours.saved_bytes == torchs.saved_bytes


def test_sdpa_kernel_settings_are_followed() -> None:
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        p = _sdpa_profile((2, 8, 256, 64), causal=True)
    assert p.extra["cuda_kernels"] == {"sdpa:efficient": 1}
    with sdpa_kernel([SDPBackend.MATH]):
        p = _sdpa_profile((2, 8, 256, 64), causal=True)
    assert p.extra["cuda_kernels"] == {"sdpa:math": 1}
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        cudnn = _sdpa_profile((2, 8, 256, 128), causal=True, target="h100")
        # cuDNN's dropout comes in steps of 1/16: 0.1 falls through to flash
        flash = _sdpa_profile((2, 8, 256, 128), causal=True, dropout=0.1, target="h100")
    assert cudnn.extra["cuda_kernels"] == {"sdpa:cudnn": 1}
    assert flash.extra["cuda_kernels"] == {"sdpa:flash": 1}  # flash drops out itself
    lse = next(o for o in cudnn.ops if o.name == CUDNN).outputs[1]
    assert (lse.shape, lse.dtype) == ((2, 8, 256, 1), "float32")
    with pytest.raises(RuntimeError, match="No available kernel"), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        _sdpa_profile((2, 8, 256, 64), mask=True)


def test_sdpa_kernel_inside_the_forward_is_followed() -> None:
    class Pinned(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([SDPBackend.MATH]):  # torch reads the flags at each call
                slow = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            return slow + F.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.zeros(2, 8, 128, 64, dtype=BF16, device="meta", requires_grad=True)
    p = trace(Pinned(), q, mode="fake", target="a100")
    assert p.extra["cuda_kernels"] == {"sdpa:flash": 1, "sdpa:math": 1}


def test_only_the_dropout_cuda_fuses_is_rewritten() -> None:
    """CUDA fuses out-of-place training dropout with 0 < p < 1 (``torch.dropout`` or
    ``F.dropout``); in-place, evaluation, p = 0 and feature dropout take the branch it shares
    with the CPU."""

    class Drops(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.dropout(x, 0.25, True) + F.dropout(x, p=0.5)           # fused: 2
            y = y + F.dropout(x, 0.1, training=False) + F.dropout(x, 0.0)    # no draw
            y = F.dropout(y * 1, 0.1, inplace=True)                          # bernoulli_
            return F.dropout2d(y.view(2, 4, 4, 4), 0.1).sum()                # bernoulli_

    x = torch.zeros(2, 64, device="meta", requires_grad=True)
    gpu = trace(Drops(), x, mode="fake", target="h200")
    names = [o.name for o in gpu.forward_ops]
    assert gpu.extra["cuda_kernels"] == {"native_dropout": 2}
    assert names.count("aten.native_dropout.default") == 2
    assert names.count("aten.bernoulli_.float") == 2
    cpu = trace(Drops(), x, mode="fake", target="cpu")
    assert [o.name for o in cpu.forward_ops].count("aten.bernoulli_.float") == 4


def _call(q: tuple[int, ...], dtype: torch.dtype = BF16, *, k: tuple[int, ...] | None = None,
          dropout: float = 0.0, causal: bool = False, gqa: bool = False,
          grad: bool = True) -> SdpaCall:
    t = torch.empty(q, dtype=dtype, device="meta", requires_grad=grad)
    kv = torch.empty(k or q, dtype=dtype, device="meta", requires_grad=grad)
    return SdpaCall.of(t, kv, kv, None, dropout, causal, gqa)


ALL = SdpSettings(enabled=frozenset(Backend))
SM86 = CudaArch("sm86", 8, 6)


@pytest.mark.parametrize(("case", "call", "arch", "backend", "flash_says"), [
    ("bf16", _call((1, 4, 128, 64)), "a100", Backend.FLASH, None),
    ("fp32", _call((1, 4, 128, 64), torch.float32), "a100", Backend.EFFICIENT, "dtype float32"),
    ("head dim 264", _call((1, 4, 128, 264)), "h100", Backend.EFFICIENT, "at most 256"),
    ("head dim 260", _call((1, 4, 128, 260)), "h100", Backend.MATH, "at most 256"),
    ("fp32 head dim 6", _call((1, 4, 128, 6), torch.float32), "a100", Backend.MATH, "dtype"),
    ("causal, fewer queries", _call((1, 4, 64, 64), k=(1, 4, 128, 64), causal=True), "a100",
     Backend.EFFICIENT, "as many queries as keys"),
    ("heads differ, no gqa", _call((1, 8, 128, 64), k=(1, 2, 128, 64)), "a100", Backend.MATH,
     "numbers of heads"),
    ("gqa", _call((1, 8, 128, 64), k=(1, 2, 128, 64), gqa=True), "a100", Backend.FLASH, None),
    ("gqa, 3 into 8", _call((1, 8, 128, 64), k=(1, 3, 128, 64), gqa=True), "a100", Backend.MATH,
     "divide"),
    ("fp32 gqa", _call((1, 8, 128, 64), torch.float32, k=(1, 2, 128, 64), gqa=True), "a100",
     Backend.MATH, "dtype"),
    ("sm86 training d 256 dropout", _call((1, 4, 128, 256), dropout=0.1), SM86, Backend.EFFICIENT,
     "training with head dim 256"),
    ("sm86 inference d 256", _call((1, 4, 128, 256), dropout=0.1, grad=False), SM86,
     Backend.FLASH, None),
    # a V100 (sm70): no flash, no cuDNN; memory-efficient in fp16 (head dims multiples of 8)
    # and fp32 (any head dim: no tensor cores), not in bf16
    ("v100 fp16", _call((1, 8, 128, 64), torch.float16), "v100", Backend.EFFICIENT, "sm70"),
    ("v100 fp16 d 60", _call((1, 8, 128, 60), torch.float16), "v100", Backend.MATH, "sm70"),
    ("v100 fp32 d 60", _call((1, 8, 128, 60), torch.float32), "v100", Backend.EFFICIENT, "sm70"),
    ("v100 bf16", _call((1, 8, 128, 64)), "v100", Backend.MATH, "sm70"),
])
def test_rule_table(case: str, call: SdpaCall, arch: str | CudaArch, backend: Backend,
                    flash_says: str | None) -> None:
    target = CUDA_ARCHS[arch] if isinstance(arch, str) else arch
    assert select_backend(call, target, ALL) is backend, case
    why = problems(call, target, ALL)[Backend.FLASH]
    assert (why is None) if flash_says is None else (flash_says in why), why


def test_cudnn_first_on_sm90_with_a_new_cudnn() -> None:
    new = CudaArch("h100-cudnn9.15.1", 9, 0, cudnn_version=91501)
    call = _call((1, 8, 128, 128))
    assert select_backend(call, new, ALL) is Backend.CUDNN
    assert select_backend(call, CUDA_ARCHS["h100"], ALL) is Backend.FLASH  # cuDNN 9.10.2
    assert select_backend(call, CudaArch("a100-new", 8, 0, cudnn_version=91501), ALL) is Backend.FLASH
    assert select_backend(_call((1, 8, 128, 128), dropout=0.1), new, ALL) is Backend.FLASH
    quiet = SdpSettings(enabled=frozenset(Backend), cudnn_deprioritized=True)
    assert select_backend(call, new, quiet) is Backend.FLASH
    strict = SdpSettings(enabled=frozenset(Backend), deterministic=True)
    assert problems(call, new, strict)[Backend.CUDNN] == "cuDNN attention is not deterministic"


def test_gpu_target_swaps_each_cpu_dropout_for_the_fused_one() -> None:
    """TinyGPT (fp32, dropout on the attention probabilities and the MLP output): the h100
    trace is the CPU one with each ``empty_like, bernoulli_, div_, mul`` made one
    ``native_dropout`` and its backward ``mul`` a ``native_dropout_backward``; each mask keeps
    1 byte per element instead of 4."""
    model, x = TinyGPT(), gpt_inputs()
    cpu = trace(model, x, loss_fn=lambda out: out, mode="fake", target="cpu")
    gpu = trace(model, x, loss_fn=lambda out: out, mode="fake", target="h100")
    cpu_names = " ".join(o.name for o in cpu.ops)
    fused = cpu_names.replace("aten.empty_like.default aten.bernoulli_.float aten.div_.Scalar "
                              "aten.mul.Tensor", "aten.native_dropout.default")
    assert fused.count("aten.native_dropout.default") == 4
    gpu_names = [o.name for o in gpu.ops]
    assert gpu_names[:gpu.n_forward] == fused.split()[:gpu.n_forward]
    assert gpu_names.count("aten.native_dropout_backward.default") == 4
    assert len(gpu.ops) == len(cpu.ops) - 3 * 4
    masks = [o.outputs[1] for o in gpu.ops if o.name == "aten.native_dropout.default"]
    assert all(m.dtype == "bool" and gpu.storage(m.storage).saved for m in masks)
    elements = sum(math.prod(m.shape) for m in masks)
    assert cpu.saved_bytes - gpu.saved_bytes == (4 - 1) * elements == 3 * 4096
    assert sum(o.random for o in gpu.ops) == 4 and gpu.extra["cuda_kernels"] == {"native_dropout": 4}
    check_profile_matches(gpu, model, x, loss_fn=lambda out: out)   # traced with h100's kernels


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_plans_on_a_gpu_profile_recompute_its_fused_ops(attention: str) -> None:
    h, a, s, b = 512, 8, 512, 4
    x = torch.zeros(b, s, h, dtype=BF16, device="meta")
    prof = trace(_stack(4, h, a, s, attention), x, mode="fake", target="a100")
    plan = memfit.plan(prof, budget="50%")
    assert plan.predicted_peak_bytes <= plan.budget_bytes == prof.peak_bytes // 2
    assert memfit.simulate(prof, plan).peak_bytes == plan.predicted_peak_bytes
    assert plan.regions and plan.recompute_s > 0
    saved = {key for r in plan.regions for key, pol in r.ops if pol is OpPolicy.SAVE}
    fused = ("aten.native_dropout.", FLASH)
    assert not any(key.startswith(fused) for key in saved)  # random: recomputed
    again = Profile.from_dict(prof.to_dict())
    assert again.extra["cuda_kernels"] == prof.extra["cuda_kernels"]
    assert memfit.plan(again, budget="50%").regions == plan.regions


def _no_plan(prof: Profile) -> memfit.Plan:
    return memfit.Plan(regions=(), predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                       solver="none", profile_signature=prof.signature)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_softmax_backward_holds_its_measured_cuda_temporary(dtype: torch.dtype) -> None:
    # NOTE [CUDA kernels in fake mode] (5): on an H200 _softmax_backward_data held a temporary
    # as large as its output while it ran; a GPU target's profile counts it, the CPU's does not
    h, a, s, b = 64, 4, 32, 2
    with torch.device("meta"):
        model = nn.Sequential(MegatronLayer(h, a, s), MegatronLayer(h, a, s)).to(dtype)
    x = torch.zeros(b, s, h, dtype=dtype, device="meta")
    gpu = trace(model, x, mode="fake", target="h200")
    cpu = trace(model, x, mode="fake", target="cpu")
    name = "aten._softmax_backward_data.default"
    ops = [o for o in gpu.ops if o.name == name]
    assert len(ops) == 2
    out_bytes = b * a * s * s * torch.empty((), dtype=dtype).element_size()
    assert [o.workspace_bytes for o in ops] == [out_bytes, out_bytes]
    assert all(o.workspace_bytes == 0 for o in cpu.ops if o.name == name)
    assert all(o.workspace_bytes == 0 for o in gpu.ops if o.name != name)
    # the live bytes at each of those ops carry it: without it they are lower by exactly that
    bare = dataclasses.replace(gpu, ops=tuple(dataclasses.replace(o, workspace_bytes=0) for o in gpu.ops))
    with_ws = memfit.simulate(gpu, _no_plan(gpu)).live_bytes
    without = memfit.simulate(bare, _no_plan(bare)).live_bytes
    assert with_ws == gpu.live_bytes
    assert [w - n for w, n in zip(with_ws, without, strict=True)] == [
        out_bytes if o.name == name else 0 for o in gpu.ops]


def test_hf_llama_without_position_ids_runs_flash_as_on_a_gpu() -> None:
    """NOTE [HF causal mask in fake mode]: on real tensors HF passes SDPA is_causal=True (an
    H200 ran flash/cuDNN); under fake tensors its packed-sequence check kept a (b, 1, s, s)
    mask and the trace took memory-efficient attention with a bias (11.7% over the H200's
    measured peak on an 8-layer Llama). Given position_ids the check is left to HF (a packed
    batch keeps its mask)."""
    transformers = pytest.importorskip("transformers")
    import transformers.masking_utils as mu

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=256, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(BF16)
    ids = torch.zeros(2, 256, dtype=torch.long, device="meta")
    before = (mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa)
    plain = trace(model, {"input_ids": ids, "labels": ids}, mode="fake", target="h100")
    given = trace(model, {"input_ids": ids, "labels": ids,
                            "position_ids": torch.zeros(2, 256, dtype=torch.long, device="meta")},
                    mode="fake", target="h100")
    assert (mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa) == before  # put back
    names = {o.name for o in plain.ops}
    assert FLASH in names and EFFICIENT not in names
    assert not names & {"aten.where.self", "aten.bitwise_and.Tensor"}  # no mask built
    assert EFFICIENT in {o.name for o in given.ops} and FLASH not in {o.name for o in given.ops}
    # the mask and the bias expanded per head cost the fake trace this much at s = 256:
    assert plain.peak_bytes < given.peak_bytes
