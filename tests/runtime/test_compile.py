"""Planned models under torch.compile (NOTE [policies under torch.compile] in
memfit.runtime.checkpoint_compiled): they compile, train like the compiled plain model, and the compiled
graph saves what the policy says.

Compilation is slow on a small shared CPU: the models are tiny and each test compiles few.
"""

from __future__ import annotations

import copy
import functools
import logging
import pickle
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import memfit
from memfit.ops import MATMUL_PACKETS, is_view
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.runtime import checkpoint_compiled as ck
from memfit.runtime import policies as P
from memfit.runtime.apply import apply_plan
from memfit.runtime.wrap import wrap
from memfit.zoo import gpt

V, B, T = 64, 8, 64  # vocabulary, batch, tokens


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles from scratch: a recompilation of the same code with another dropout
    # p makes dynamo trace p as a symbolic float, which changes the traced op stream
    # (NOTE [op keys under torch.compile], limits in docs/compile.md).
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _model(dropout: float = 0.1, n_layer: int = 2) -> torch.nn.Module:
    return gpt(n_layer=n_layer, d_model=32, n_head=2, seq_len=T, vocab_size=V, dropout=dropout,
               seed=0)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _train(model: torch.nn.Module, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of the compiled ``model`` (aot_eager); the grads of each step."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout draws for both models
        opt.zero_grad()
        compiled(*_batch(step)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads

def _assert_bitwise(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]], plain_run) -> None:
    """Every step's gradients and the final weights equal the compiled plain run's (torch.equal)."""
    plain_grads, plain_weights = plain_run
    for step, (got, want) in enumerate(zip(grads, plain_grads, strict=True)):
        for name in want:
            assert torch.equal(got[name], want[name]), (step, name)
    for name, p in model.named_parameters():
        assert torch.equal(p, plain_weights[name]), name



@pytest.fixture(scope="module")
def plain_run() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    model = _model()
    grads = _train(model)
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


# "save-matmuls": every block saving its matmul outputs, whatever the calibrated time model
# chose at 50% (a measured profile's plan may save ops or not), so the saved-op path is always run
@pytest.mark.parametrize("budget, solver, nested", [(0.5, "auto", False), (1.0, "save_matmuls", False),
                                                    ("min", "auto", True)],
                         ids=["blocks-50%", "blocks-save-matmuls", "nested-min"])
def test_compiled_planned_gpt_trains_bitwise_like_compiled_plain(plain_run, budget, solver, nested,
                                                                caplog):
    model = memfit.fit(_model(), _batch(0), budget=budget, search=memfit.Search(solver=solver))
    regions = [r.name for r in model.memfit_plan.regions]
    inside = [a for a in regions for b in regions if a != b and a.startswith(b + ".")]
    assert bool(inside) == nested, regions  # "min" nests attention inside its block
    if solver == "save_matmuls":
        assert all(r.save for r in model.memfit_plan.regions), model.memfit_plan
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.checkpoint_compiled"):
        ck._said_unchecked.clear()
        grads = _train(model)
    said = [r for r in caplog.records if "divergence check" in r.getMessage()]
    assert len(said) == 1  # once, however many regions and traces

    # aot_eager runs the traced aten ops eagerly: bitwise equal, measured on torch 2.13 CPU
    _assert_bitwise(model, grads, plain_run)


def test_plan_with_compiled_costs_trains_bitwise_like_compiled_plain(plain_run):
    """``Search(compiled=True)`` (NOTE [compiled costs]): the plan says so and the compiled
    model trains bitwise like the compiled plain one (aot_eager)."""
    model = memfit.fit(_model(), _batch(0), budget=0.5, search=memfit.Search(compiled=True))
    assert any(n.startswith("costs as torch.compile runs the step") for n in model.memfit_plan.notes)
    assert model.memfit_plan.regions
    _assert_bitwise(model, _train(model), plain_run)


# ---- segments (NOTE [segments under torch.compile] in memfit.runtime.segment_compiled) ----
# One segment over both blocks saving block 0's first q@k (B*nh,T,T) and block 1's qkv
# projection (B*T,3C): the first addmm of block 1 is the segment's fifth. Had block 1 counted
# from 0, it would save its own q@k instead (other bytes) and no addmm.
SEGMENT_KEYS = ("aten.bmm.default#0", "aten.addmm.default#4")
BLOCK_KEYS = (("aten.bmm.default#0",), ("aten.addmm.default#0",))  # the same, block by block
BLOCK_INPUT_BYTES = B * T * 32 * 4  # (B,T,C) float32: block 1's input, kept by the graph


def _segmented(model: torch.nn.Module) -> torch.nn.Module:
    plan = Plan(regions=(Region.saving(("blocks.0", "blocks.1"), SEGMENT_KEYS),),
                predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None, solver="test",
                profile_signature="")
    return apply_plan(model, plan)


def test_compiled_segment_plan_trains_bitwise_like_compiled_plain(plain_run, caplog):
    model = _segmented(_model())
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.segment_compiled"):
        grads = _train(model)  # fullgraph=True
    said = [r.getMessage() for r in caplog.records if r.name == "memfit.runtime.segment_compiled"]
    assert len(said) == 1, said  # once per segment, however many traces and steps
    assert "blocks.0..blocks.1" in said[0] and f"{BLOCK_INPUT_BYTES:,} bytes" in said[0]

    _assert_bitwise(model, grads, plain_run)


# ---- what the compiled graph saves --------------------------------------------------------
def _saved(model: torch.nn.Module) -> tuple[int, int]:
    """(tensors, bytes) the compiled step saves for backward, storages counted once."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, y = _batch(0)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x, y)
    loss.backward()
    return len(seen), sum(seen.values())


class _TorchSAC(torch.nn.Module):
    """A block checkpointed by torch's own selective checkpoint (the reference)."""

    def __init__(self, block: torch.nn.Module, ops: list | None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = (None if ops is None
                           else functools.partial(create_selective_checkpoint_contexts, ops))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context_fn is None:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False,
                                                 context_fn=self.context_fn)


_MATMULS = [getattr(torch.ops.aten, name.split(".")[1]).default for name in MATMUL_PACKETS
            if hasattr(getattr(torch.ops.aten, name.split(".")[1]), "default")]


@pytest.mark.slow
def test_compiled_graph_saves_what_the_policy_says():
    saved = {}
    for name, memfit_policy, torch_ops in [("recompute_all", P.recompute_all(), None),
                                           ("save_matmuls", P.save_matmuls(), _MATMULS)]:
        ours, theirs = _model(dropout=0.0), _model(dropout=0.0)
        for block in ours.blocks:
            wrap(block, memfit_policy, check=False)
        theirs.blocks = torch.nn.ModuleList(_TorchSAC(b, torch_ops) for b in theirs.blocks)
        saved[name] = _saved(ours)
        assert saved[name] == _saved(theirs), name  # as torch's own selective checkpoint
    plain = _saved(_model(dropout=0.0))
    # each block's matmul outputs: qkv (B,T,3C), scores (B,nh,T,T), att@v (B,nh,T,hs),
    # proj (B,T,C), fc (B,T,4C), proj (B,T,C) in float32 = 917504 bytes per block at C=32
    assert saved["recompute_all"][1] + 2 * 917504 - 2 * 65536 <= saved["save_matmuls"][1]
    assert saved["recompute_all"][1] < saved["save_matmuls"][1] < plain[1]


def test_compiled_segment_saves_its_plan_block_by_block():
    blocks = _model(dropout=0.0)
    for block, keys in zip(blocks.blocks, BLOCK_KEYS, strict=True):
        wrap(block, P.save_keys(keys), check=False)
    segment = _saved(_segmented(_model(dropout=0.0)))
    assert segment == _saved(blocks)  # count and bytes: block 1's keys continue block 0's
    plain = _saved(_model(dropout=0.0))
    # q@k and qkv outputs kept, the rest of both blocks recomputed
    assert segment[1] + 2 * (B * 2 * T * T * 4) < plain[1]


# ---- op keys (NOTE [op keys under torch.compile]) ------------------------------------------
@dataclass(frozen=True)
class _Spy(P.Policy):
    """Saves nothing; records the (op, key) of every op the runtime asks it about."""

    seen: list = field(default_factory=list)

    def decide(self, op, name, k, args, kwargs) -> OpPolicy:
        self.seen.append(f"{name}#{k}")
        return OpPolicy.RECOMPUTE


def _saveable(keys: list[str]) -> list[str]:
    # a plan never saves an alias of an earlier storage (NOTE [saveable ops]): views, and
    # _unsafe_view, which eager matmul runs where the traced one runs view
    def alias(key: str) -> bool:
        op = key.rpartition("#")[0]
        ns, packet, overload = op.split(".")
        return op == "aten._unsafe_view.default" or is_view(
            getattr(getattr(getattr(torch.ops, ns), packet), overload))
    return [k for k in keys if not alias(k)]


def _calls(keys: list[str]) -> list[list[str]]:
    """Split recorded keys into checkpointed calls (each starts again at the first key)."""
    starts = [i for i, k in enumerate(keys) if k == keys[0]] + [len(keys)]
    return [keys[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def _without_dropout_internals(keys: list[str]) -> list[str]:
    # eager CPU dropout runs empty_like, bernoulli_, div_, mul; the policy is asked about
    # empty_like and mul (the others are in-place); traced dropout is one native_dropout,
    # random, which it is not asked about
    out, in_dropout = [], False
    for k in keys:
        if k.startswith("aten.empty_like."):
            in_dropout = True
        elif in_dropout and k.startswith("aten.mul.Tensor#"):
            in_dropout = False
        else:
            out.append(k)
    return out


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
def test_traced_ops_get_the_eager_op_keys(dropout):
    # the whole model as one region: ops after the embedding's dropout get keys shifted
    # by it unless the traced stream is counted in eager ops
    model = _model(dropout=dropout, n_layer=1)
    spy = _Spy()
    wrap(model, spy, check=False)
    x, y = _batch(0)
    model(x, y).backward()
    eager = _saveable(list(spy.seen))
    spy.seen.clear()
    torch.compile(model, backend="aot_eager", fullgraph=True)(x, y).backward()
    traced = _calls(list(spy.seen))
    assert len(traced) >= 2  # AOTAutograd traces the region more than once
    want = _without_dropout_internals(eager)
    assert ("aten.mul.Tensor#1" in want) == (dropout > 0)  # the score scaling, after a dropout
    assert "aten.clone.default#0" in want  # .contiguous(), after dropouts that trace as clones
    for call in traced:
        assert _saveable(call) == want


def test_policies_pickle_and_copy_with_their_compiled_form():
    policy = P.save_ops("aten.mm") | P.save_keys(["aten.addmm.default#1"])
    for copied in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy)):
        assert copied == policy
        assert copied.itself() is copied  # its own, not the original's
    assert policy.itself() is policy
