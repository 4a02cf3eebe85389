"""memfit.runtime.checkpoint: bitwise-equal to the plain step, policies, misuse errors."""

from __future__ import annotations

import copy
import functools
import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import CallCounter, GPTBlock, Residual, pair
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from memfit._torch import SAC_OP_OUTPUT
from memfit.errors import RecomputeMismatch
from memfit.runtime import policies as P
from memfit.runtime import region_policy as R
from memfit.runtime.checkpoint import checkpoint


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _compare(fn_ckpt, fn_plain, model, twin, x, seed=0):
    """fn_*(module, x) -> output; compares outputs, input grads and parameter grads bitwise."""
    xa, xb = x.detach().clone().requires_grad_(x.requires_grad), x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    ya = fn_ckpt(model, xa)
    ya.float().square().sum().backward()
    torch.manual_seed(seed)
    yb = fn_plain(twin, xb)
    yb.float().square().sum().backward()
    assert torch.equal(ya, yb)
    if x.requires_grad:
        assert torch.equal(xa.grad, xb.grad)
    ga, gb = _grads(model), _grads(twin)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def _save_mm_fn(ctx, op, *args, **kwargs):
    return op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


POLICIES = {
    "none": None,
    "recompute_all": P.recompute_all(),
    "save_matmuls": P.save_matmuls(),
    "names": {"aten.mm", "aten.addmm.default", torch.ops.aten.bmm},
    "callable": _save_mm_fn,
    "save_keys": P.save_keys(["aten.addmm.default#0", "aten.gelu.default#0"]),
    "either": P.save_ops("aten.gelu") | P.save_keys(["aten.addmm.default#1"]),
}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_gpt_block_bitwise_and_recomputed(policy):
    model, twin = pair(GPTBlock)
    counter = CallCounter(model.attn.qkv)
    x = torch.randn(2, 8, 32, requires_grad=True)
    _compare(lambda m, x, policy=policy: checkpoint(m, x, policy=policy), lambda m, x: m(x), model, twin, x)
    assert counter.count == 2  # forward + recomputation


def test_dropout_rng_restored_and_stream_continues():
    model, twin = pair(lambda: nn.Sequential(Residual(16, p=0.5), Residual(16, p=0.5)))
    x = torch.randn(4, 16, requires_grad=True)
    _compare(lambda m, x: checkpoint(m[1], checkpoint(m[0], x)), lambda m, x: m(x), model, twin, x)
    # The RNG after the checkpointed step continues as after the plain one.
    torch.manual_seed(3)
    checkpoint(model, x).sum().backward()
    after_ckpt = torch.rand(4)
    torch.manual_seed(3)
    twin(x).sum().backward()
    assert torch.equal(after_ckpt, torch.rand(4))


def test_naive_sac_saving_dropout_div_is_wrong_memfit_is_right():
    """torch SAC saving dropout's in-place div_ gives wrong grads; memfit forces recompute."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def fn(x):
        return F.dropout(lin(x).relu(), 0.5, training=True).sin()

    def naive_policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.div_.Scalar else CheckpointPolicy.PREFER_RECOMPUTE

    def grads(run):
        x.grad = None
        lin.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        run().sum().backward()
        return x.grad.clone(), lin.weight.grad.clone()

    def naive(allow_mutation):
        return lambda: torch.utils.checkpoint.checkpoint(
            fn, x, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, naive_policy,
                                         allow_cache_entry_mutation=allow_mutation))

    plain = grads(lambda: fn(x))
    # The known torch pitfall: the saved div_ output is skipped in recomputation, and the
    # dropout mask the caller uses stays undivided. torch notices only through the cached
    # tensor's version counter; with that check relaxed the gradient is silently wrong.
    with pytest.raises(RuntimeError, match="mutated"):
        grads(naive(False))
    wrong = grads(naive(True))
    assert not torch.equal(wrong[0], plain[0])
    ours = grads(lambda: checkpoint(fn, x, policy={"aten.div_.Scalar"}))
    assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1])


def test_forced_recompute_rules():
    rp = R.RegionPolicy(P.save_ops("aten.div_", "aten.bernoulli_", "aten.native_dropout",
                                   "aten.mm", "aten.add_"))
    assert rp(None, torch.ops.aten.div_.Scalar) is CheckpointPolicy.MUST_RECOMPUTE
    assert rp(None, torch.ops.aten.bernoulli_.float) is CheckpointPolicy.MUST_RECOMPUTE
    assert rp(None, torch.ops.aten.native_dropout.default) is CheckpointPolicy.MUST_RECOMPUTE
    assert rp(None, torch.ops.aten.add_.Tensor) is CheckpointPolicy.MUST_RECOMPUTE
    assert rp(None, torch.ops.aten.rand.default) is CheckpointPolicy.MUST_RECOMPUTE
    assert rp(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert rp(None, torch.ops.aten.gelu.default) is CheckpointPolicy.PREFER_RECOMPUTE


def _ask(rp, op, out, *args):
    """The policy's answer for ``op`` whose output is ``out``, as torch asks: with the output
    in the context (torch 2.12 on), or before the op runs and then ``OutputTap``'s hand-over
    (NOTE [selective-checkpoint layouts])."""
    if SAC_OP_OUTPUT:
        return rp(SelectiveCheckpointContext(is_recompute=False, op_output=out), op, *args)
    answer = rp(SelectiveCheckpointContext(is_recompute=False), op, *args)
    rp.took_output(op, out)
    return answer


def test_a_write_into_a_later_storage_at_a_saved_address_forgets_nothing(monkeypatch):
    # An offloaded output's device storage dies at its last use in the forward and the
    # allocator may give its address to a later tensor: a write into that one must not turn
    # the saved entry back into recompute. numpy memory stands in for the reused address.
    forgotten = []
    monkeypatch.setattr(R, "sac_forget",
                        lambda mode, op, index, *position: forgotten.append((op, index)))
    rp = R.RegionPolicy(P.save_ops("aten.mm"))
    mode = type("Mode", (), {})()  # held weakly by the policy: kept alive here
    rp.caching_mode = mode
    mm, mul_ = torch.ops.aten.mm.default, torch.ops.aten.mul_.Tensor
    memory = np.zeros((2, 2), dtype=np.float32)
    out = torch.from_numpy(memory)  # the saved output
    assert _ask(rp, mm, out, out, out) is CheckpointPolicy.MUST_SAVE
    del out  # its storage is freed; the memory stays
    later = torch.from_numpy(memory)  # another storage at the same address
    assert _ask(rp, mul_, later, later, later) is CheckpointPolicy.MUST_RECOMPUTE
    assert forgotten == []
    saved = torch.ones(2, 2)  # a saved output itself written in place is forgotten
    assert _ask(rp, mm, saved, saved, saved) is CheckpointPolicy.MUST_SAVE
    _ask(rp, mul_, saved, saved, saved)
    assert forgotten == [(mm, 1)]


def test_op_keys_count_per_overload_from_zero_each_call():
    policy = P.save_keys(["aten.mm.default#1", "aten.add.Tensor#0"])
    seen = []
    for _call in range(2):
        rp = R.RegionPolicy(policy)  # one per checkpointed call
        ops = [torch.ops.aten.mm.default, torch.ops.aten.add.Tensor, torch.ops.aten.mm.default,
               torch.ops.aten.mm.default, torch.ops.aten.add.Tensor]
        seen.append([rp(None, op) is CheckpointPolicy.MUST_SAVE for op in ops])
    assert seen == [[False, True, True, False, False]] * 2


def test_save_keys_saves_exactly_those_occurrences():
    """Ops run in the recomputation are those not saved: count them with a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return (x @ w).tanh() @ w @ w

    def backward_mms(policy):
        y = checkpoint(fn, x, policy=policy, early_stop=False)  # recompute all of fn
        with Count() as c:
            y.sum().backward()
        return c.mm

    # Backward itself runs 2 mm per forward mm (6); recomputation adds the unsaved ones.
    assert backward_mms(P.save_keys([])) - backward_mms(P.save_keys(
        ["aten.mm.default#0", "aten.mm.default#2"])) == 2
    assert backward_mms(P.save_keys(["aten.mm.default#1"])) == 6 + 2


def test_autocast_bf16_cpu():
    model, twin = pair(GPTBlock)
    x = torch.randn(2, 8, 32, requires_grad=True)

    def ck(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return checkpoint(m, x, policy=P.save_matmuls())

    def plain(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    _compare(ck, plain, model, twin, x)


class _Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, extra=None, *, scale: int = 1, cfg=None):
        h = self.lin(x) * scale
        if extra is not None:
            h = h + extra["bias"]
        return {"out": h.relu(), "pair": (h.sin(), None), "n": 3, "cfg": cfg}


def test_kwargs_and_non_tensor_args_and_outputs():
    model, twin = pair(_Structured)
    x = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)

    def loss(o):
        assert o["n"] == 3 and o["pair"][1] is None and o["cfg"] == {"k": 1}
        return o["out"].square().sum() + o["pair"][0].sum()

    torch.manual_seed(0)
    la = loss(checkpoint(model, x, {"bias": bias}, scale=2, cfg={"k": 1}))
    la.backward()
    ga = (x.grad.clone(), bias.grad.clone(), model.lin.weight.grad.clone())
    x.grad = bias.grad = None
    lb = loss(twin(x, {"bias": bias}, scale=2, cfg={"k": 1}))
    lb.backward()
    assert torch.equal(la, lb)
    assert all(torch.equal(a, b) for a, b in zip(ga, (x.grad, bias.grad, twin.lin.weight.grad), strict=True))


def test_nested_checkpoints():
    model, twin = pair(lambda: nn.Sequential(GPTBlock(), GPTBlock()))

    def ck(m, x):
        def outer(x):
            return checkpoint(m[1], checkpoint(m[0], x, policy=P.save_matmuls()))
        return checkpoint(outer, x)

    _compare(ck, lambda m, x: m(x), model, twin, torch.randn(2, 8, 32, requires_grad=True))


def test_input_without_grad_and_frozen_params():
    model, twin = pair(GPTBlock)
    for m in (model, twin):
        m.attn.qkv.weight.requires_grad_(False)
        m.ln1.requires_grad_(False)
    _compare(lambda m, x: checkpoint(m, x), lambda m, x: m(x), model, twin,
             torch.randn(2, 8, 32))
    assert model.attn.qkv.weight.grad is None


def test_inplace_ops_and_view_outputs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 16)

        def forward(self, x):
            h = self.lin(x)
            h.mul_(2).add_(1.0)        # in-place ops on a tensor nothing saved
            g = h.tanh() * 3.0
            g[:, :4] += 1.0            # in-place on a slice
            return g.relu_().view(4, 2, 8)[:, 1]  # a view of an intermediate

    model, twin = pair(M)
    for policy in (None, P.save_matmuls()):
        _compare(lambda m, x, policy=policy: checkpoint(m, x, policy=policy), lambda m, x: m(x), model, twin,
                 torch.randn(4, 8, requires_grad=True))
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)


def test_no_grad_runs_plainly():
    model = GPTBlock()
    counter = CallCounter(model.attn.qkv)
    with torch.no_grad():
        y = checkpoint(model, torch.randn(2, 8, 32), preserve_rng_state=False)
    assert not y.requires_grad and counter.count == 1


def test_no_grad_keeps_every_option_of_this_torchs_checkpoint_from_fn():
    # the keyword options of torch.utils.checkpoint.checkpoint, read from its signature
    # (torch 2.14 added respect_saved_tensors_hooks), never reach fn, with or without autograd
    params = inspect.signature(torch.utils.checkpoint.checkpoint).parameters.values()
    options = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY
               and p.name not in ("use_reentrant", "context_fn")}
    options["preserve_rng_state"] = True  # read from **kwargs by torch 2.13
    seen = []

    def fn(x, **kwargs):
        seen.append(kwargs)
        return (x * 2).sin()  # saves its input: backward recomputes it

    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        checkpoint(fn, x, scale=3, **options)
    checkpoint(fn, x, scale=3, **options).sum().backward()
    assert seen == [{"scale": 3}] * 3  # no grad; forward and its recomputation


class _Flaky(nn.Module):
    """Takes another branch with the same shapes on its second call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return (h.sin() if self.calls % 2 else h.cos()).exp()  # exp saves its output


def test_divergence_torch_silent_memfit_raises():
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(0)
    flaky, twin = _Flaky(), None
    twin = copy.deepcopy(flaky)
    # torch: no error, wrong gradient.
    torch.utils.checkpoint.checkpoint(flaky, x, use_reentrant=False).sum().backward()
    wrong = flaky.lin.weight.grad.clone()
    twin(x).sum().backward()
    assert not torch.equal(wrong, twin.lin.weight.grad)
    # memfit: raises, naming the module and the first differing op.
    flaky.calls = 0
    y = checkpoint(flaky, x)
    with pytest.raises(RecomputeMismatch, match=r"_Flaky.*op 2: the forward ran aten.sin.default.*recomputation ran aten.cos.default"):
        y.sum().backward()
    # check=False: torch's behaviour.
    flaky.calls = 0
    checkpoint(flaky, x, check=False).sum().backward()


def test_divergence_fewer_ops_in_recompute():
    state = {"extra": True}
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        h = x @ w
        if state["extra"]:
            h = h * 1.0  # saves nothing (scalar multiply), so torch does not notice
        return h.tanh()

    y = checkpoint(fn, torch.randn(2, 8, requires_grad=True), early_stop=False)
    state["extra"] = False
    with pytest.raises(RecomputeMismatch, match="fn"):
        y.sum().backward()


def test_misuse_errors():
    with pytest.raises(TypeError, match="function or module"):
        checkpoint(3, torch.randn(2))
    with pytest.raises(ValueError, match="aten.nosuchop"):
        checkpoint(torch.sin, torch.randn(2), policy={"aten.nosuchop"})
    with pytest.raises(ValueError, match="aten.mm.nosuchoverload"):
        P.save_ops("aten.mm.nosuchoverload")
    with pytest.raises(ValueError, match="'mm#1'"):
        P.save_keys(["mm#1"])
    with pytest.raises(ValueError, match="overload"):
        P.save_keys(["aten.mm#1"])
    with pytest.raises(TypeError, match="collection"):
        checkpoint(torch.sin, torch.randn(2), policy="aten.mm")
    with pytest.raises(ValueError, match="use_reentrant"):
        checkpoint(torch.sin, torch.randn(2), use_reentrant=True)


@pytest.mark.parametrize("policy", [P.save_matmuls(), P.save_keys(["aten.addmm.default#0"])],
                         ids=["save_matmuls", "save_keys"])
def test_divergence_detected_when_the_policy_feeds_the_recorder(policy):
    # With a policy the recorder is fed by the SAC policy function, not a dispatch mode.
    x = torch.randn(4, 8, requires_grad=True)
    flaky = _Flaky()
    y = checkpoint(flaky, x, policy=policy)
    with pytest.raises(RecomputeMismatch, match=r"op 2: the forward ran aten.sin.default.*"
                                                r"recomputation ran aten.cos.default"):
        y.sum().backward()


class _RangedOnReplay(nn.Module):
    """Opens a profiler range on every other call: the replay runs profiler ops the forward
    did not (as FSDP2's hooks under record_function may: NOTE [profiler ops in a replay])."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 2 == 0:
            with torch.profiler.record_function("replay-only"):
                pass
        return torch.tanh(self.lin(x)) @ self.lin.weight


@pytest.mark.parametrize("policy", [None, {"aten.addmm", "aten.mm"}], ids=["all", "save-matmuls"])
def test_a_profiler_range_only_the_replay_opens_is_bitwise(policy):
    torch.manual_seed(0)
    module, x = _RangedOnReplay(), torch.randn(4, 8, requires_grad=True)
    plain = copy.deepcopy(module)
    plain.calls = 1  # its single call is the odd one, as the forward's
    checkpoint(module, x, policy=policy).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    plain(x).sum().backward()
    assert module.calls == 2  # forward + replay
    assert torch.equal(gx, x.grad)
    assert torch.equal(module.lin.weight.grad, plain.lin.weight.grad)


def test_a_selective_region_inside_saved_tensor_hooks_says_nothing(recwarn):
    """torch 2.14+ warns (FutureWarning) unless respect_saved_tensors_hooks is passed; memfit
    passes False (NOTE [saved-tensor hooks around selective regions]), as its plans assume."""
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint(lambda t: torch.relu(lin(t)) * 2, x, policy={"aten.addmm"})
    out.sum().backward()
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []
    assert packed  # the hooks were in effect around the region
    with pytest.raises(ValueError, match="respect_saved_tensors_hooks=True"):
        checkpoint(lin, x, policy={"aten.addmm"}, respect_saved_tensors_hooks=True)
