"""Hand-built, self-consistent Profiles for solver tests and benchmarks (no model).

:class:`StepBuilder` records forward ops with what autograd saves, then derives a backward
pass (one backward op per forward op, in reverse order), storage lifetimes and the live-bytes
timeline by the same rules the tracer follows (NOTE [storage lifetimes] in
``memfit.profiling.profile``):

- a forward storage is freed after its last forward read, or after the backward op of its
  earliest saver if autograd saved it (``first_unpack`` is the backward op of its latest saver);
- each backward op creates a gradient of its forward op's output size, freed after the next
  backward op; parameter gradients are created by the backward op of the first op reading the
  parameter and never freed (they pile up towards the end of backward).

Times default to multiples of ``2**-10`` s so that sums are exact in binary floating point.
"""

from __future__ import annotations

import contextlib
import math
import random as _random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from memfit.profiling.profile import (
    ModuleRecord,
    OpRecord,
    Phase,
    Profile,
    StorageKind,
    StorageRecord,
    TensorMeta,
    live_timeline,
    op_signature,
)

__all__ = ["StepBuilder", "OpSpec", "chain_profile", "residual_block", "unet_profile", "decoder_profile",
           "random_chain", "random_unet", "TICK"]

TICK = 2.0 ** -10  # one time unit, exact in binary
_WORKSPACES = (0, 0, 32, 256, 1024)  # random kernel workspaces, bytes


@dataclass
class _Op:
    name: str
    module: str
    inputs: list[int]
    outputs: list[int]       # storage ids (new, or aliased for views / in-place)
    saves: list[int]
    params: list[int]
    time_s: float
    inplace: bool
    random: bool
    grad_bytes: int
    keep_until_backward: bool
    workspace: int = 0
    backward_workspace: int = 0


class StepBuilder:
    """Record a forward pass op by op; :meth:`build` derives backward and lifetimes.

    Example:
        >>> b = StepBuilder()
        >>> x = b.input(64)
        >>> with b.module("lin", "Linear"):
        ...     w = b.param(256)
        ...     (y,) = b.op("aten.mm.default", [x, w], 64, saves=[x, w], params=[w])
        >>> (loss,) = b.op("aten.sum.default", [y], 4, keep_until_backward=True)
        >>> prof = b.build()
        >>> prof.n_forward, len(prof.ops)
        (2, 4)
    """

    def __init__(self, model: str = "toy") -> None:
        self.model = model
        self._nbytes: list[int] = []
        self._kind: list[StorageKind] = []
        self._creator: list[int | None] = []
        self._ops: list[_Op] = []
        self._stack: list[str] = [""]
        self._mods: dict[str, dict] = {"": {"type": "Model", "parent": None, "children": [],
                                            "called": True}}

    # -- storages ----------------------------------------------------------------------------
    def _new(self, nbytes: int, kind: StorageKind, creator: int | None) -> int:
        self._nbytes.append(int(nbytes))
        self._kind.append(kind)
        self._creator.append(creator)
        return len(self._nbytes) - 1

    def param(self, nbytes: int) -> int:
        return self._new(nbytes, StorageKind.PARAMETER, None)

    def input(self, nbytes: int) -> int:
        return self._new(nbytes, StorageKind.INPUT, None)

    # -- modules -----------------------------------------------------------------------------
    def container(self, path: str, type: str = "ModuleList") -> None:
        """Register a module that is never called itself (an ``nn.ModuleList``)."""
        parent = self._stack[-1]
        self._mods[path] = {"type": type, "parent": parent, "children": [], "called": False}
        self._mods[parent]["children"].append(path)

    @contextlib.contextmanager
    def module(self, path: str, type: str = "Block", parent: str | None = None) -> Iterator[None]:
        par = self._stack[-1] if parent is None else parent
        if path not in self._mods:
            self._mods[path] = {"type": type, "parent": par, "children": [], "called": True}
            self._mods[par]["children"].append(path)
        self._stack.append(path)
        try:
            yield
        finally:
            self._stack.pop()

    # -- ops ---------------------------------------------------------------------------------
    def op(self, name: str, inputs: Sequence[int], out: int | Sequence[int] = (), *,
           time_s: float = TICK, saves: Sequence[int] = (), params: Sequence[int] = (),
           inplace: bool = False, random: bool = False, view: bool = False,
           keep_until_backward: bool = False, workspace_bytes: int = 0,
           backward_workspace_bytes: int | None = None) -> list[int]:
        """Record one forward op; returns its output storage ids.

        ``out``: bytes of each new output storage. ``view``/``inplace``: the op returns its
        first input's storage instead. ``saves``: storages (inputs or outputs) autograd saves.
        ``workspace_bytes``: the op's kernel workspace (NOTE [kernel workspaces]);
        ``backward_workspace_bytes`` its backward op's (default: the same).
        """
        idx = len(self._ops)
        if view or inplace:
            outs = [inputs[0]]
            grad = 0
        else:
            sizes = [out] if isinstance(out, int) else list(out)
            outs = [self._new(s, StorageKind.ACTIVATION, idx) for s in sizes]
            grad = sum(sizes)
        self._ops.append(_Op(name, self._stack[-1], list(inputs) + list(params), outs, list(saves),
                             list(params), float(time_s), inplace, random, grad, keep_until_backward,
                             int(workspace_bytes),
                             int(workspace_bytes if backward_workspace_bytes is None else backward_workspace_bytes)))
        return outs

    # -- build -------------------------------------------------------------------------------
    def build(self, *, backward_time_factor: float = 2.0) -> Profile:
        fwd = self._ops
        nf = len(fwd)
        n = 2 * nf
        m = len(self._nbytes)
        lfu: list[int | None] = [None] * m
        for i, op in enumerate(fwd):
            for s in op.inputs + op.outputs:
                if self._creator[s] is not None or self._kind[s] == StorageKind.ACTIVATION:
                    lfu[s] = i if lfu[s] is None else max(lfu[s], i)  # type: ignore[type-var]
        bwd_of = {i: n - 1 - i for i in range(nf)}  # backward op of forward op i
        unpack: list[int | None] = [None] * m
        last_saver_b: list[int] = [-1] * m
        for i, op in enumerate(fwd):
            for s in op.saves:
                b = bwd_of[i]
                unpack[s] = b if unpack[s] is None else min(unpack[s], b)  # type: ignore[type-var]
                last_saver_b[s] = max(last_saver_b[s], b)
        freed: list[int | None] = [None] * m
        for s in range(m):
            c = self._creator[s]
            if c is None:
                continue
            used = lfu[s]
            freed[s] = max(used if used is not None else c, last_saver_b[s])
        for op in fwd:
            if op.keep_until_backward:
                for s in op.outputs:
                    freed[s] = max(freed[s] or 0, nf)  # held by the caller until backward starts
        # backward ops
        ops: list[OpRecord] = []
        for i, op in enumerate(fwd):
            ops.append(OpRecord(
                index=i, name=op.name, module=op.module, phase=Phase.FORWARD,
                inputs=tuple(dict.fromkeys(op.inputs)),
                outputs=tuple(TensorMeta(s, (self._nbytes[s] // 4,), "float32") for s in op.outputs),
                time_s=op.time_s, inplace=op.inplace, random=op.random,
                workspace_bytes=op.workspace,
            ))
        grad_of_param: dict[int, int] = {}
        prev_grad: int | None = None
        for k in range(nf):
            i = nf - 1 - k
            op = fwd[i]
            b = nf + k
            outs: list[int] = []
            reads = list(dict.fromkeys(op.saves))
            if prev_grad is not None:
                reads.append(prev_grad)
            if prev_grad is not None:
                freed[prev_grad] = b  # a gradient is freed after the next backward op
            g = None
            if op.grad_bytes:
                g = self._new(op.grad_bytes, StorageKind.GRADIENT, b)
                freed.append(b)
                lfu.append(None)
                unpack.append(None)
                outs.append(g)
            for p in op.params:
                if p not in grad_of_param:
                    gp = self._new(self._nbytes[p], StorageKind.GRADIENT, b)
                    freed.append(None)
                    lfu.append(None)
                    unpack.append(None)
                    grad_of_param[p] = gp
                    outs.append(gp)
            prev_grad = g if g is not None else prev_grad
            ops.append(OpRecord(
                index=b, name=f"{op.name}_backward",
                module=op.module, phase=Phase.BACKWARD, inputs=tuple(reads),
                outputs=tuple(TensorMeta(s, (self._nbytes[s] // 4,), "float32") for s in outs),
                time_s=op.time_s * backward_time_factor, workspace_bytes=op.backward_workspace,
            ))
        storages = tuple(
            StorageRecord(
                id=s, nbytes=self._nbytes[s], kind=self._kind[s], created_by=self._creator[s],
                freed_after=freed[s],
                saved=unpack[s] is not None, first_unpack=unpack[s],
                last_forward_use=lfu[s] if (cr := self._creator[s]) is not None and cr < nf else None,
            )
            for s in range(len(self._nbytes))
        )
        live = tuple(live_timeline(storages, n, [o.workspace_bytes for o in ops]))
        modules = self._module_records(fwd, nf)
        baseline = sum(s.nbytes for s in storages if s.created_by is None)
        return Profile(
            ops=tuple(ops), storages=storages, modules=modules, n_forward=nf,
            live_bytes=live, peak_bytes=max(live, default=0), baseline_bytes=baseline,
            step_time_s=sum(o.time_s for o in ops), model=self.model, mode="synthetic",
            cost_model="synthetic", signature=op_signature(ops, nf),
        )

    def _module_records(self, fwd: list[_Op], nf: int) -> tuple[ModuleRecord, ...]:
        span: dict[str, list[int]] = {}
        for i, op in enumerate(fwd):
            path: str | None = op.module
            while path is not None:
                if self._mods[path]["called"]:
                    rng_ = span.setdefault(path, [i, i])
                    rng_[1] = i
                path = self._mods[path]["parent"]
        out: list[ModuleRecord] = []
        for path, info in self._mods.items():
            r = span.get(path)
            pbytes = sum(self._nbytes[p] for i in range(r[0], r[1] + 1) for p in fwd[i].params) if r else 0
            out.append(ModuleRecord(
                path=path, type=info["type"], parent=info["parent"], children=tuple(info["children"]),
                first_op=r[0] if r else None, last_op=r[1] if r else None, calls=1 if r else 0,
                parameter_bytes=pbytes,
            ))
        return tuple(out)


@dataclass(frozen=True)
class OpSpec:
    """One op of a block. ``inputs`` index the block's values: 0 is the block input, ``k`` the
    output of op ``k - 1``, ``-1`` the latest value. ``save``: ``"in"`` (its first input),
    ``"out"``, ``"both"`` or ``""``."""

    name: str
    out_bytes: int = 0
    time_s: float = TICK
    inputs: tuple[int, ...] = (-1,)
    save: str = ""
    param_bytes: int = 0
    inplace: bool = False
    random: bool = False
    view: bool = False
    workspace_bytes: int = 0


def _run_block(b: StepBuilder, x: int, specs: Sequence[OpSpec]) -> int:
    vals = [x]
    for sp in specs:
        ins = [vals[k] for k in sp.inputs]
        params = [b.param(sp.param_bytes)] if sp.param_bytes else []
        saves_in = ins[:1] if sp.save in ("in", "both") else []
        (out,) = b.op(sp.name, ins, sp.out_bytes, time_s=sp.time_s, params=params,
                      inplace=sp.inplace, random=sp.random, view=sp.view,
                      saves=saves_in + params, workspace_bytes=sp.workspace_bytes)
        if sp.save in ("out", "both"):
            b._ops[-1].saves.append(out)
        vals.append(out)
    return vals[-1]


def chain_profile(blocks: Sequence[Sequence[OpSpec]], *, act_bytes: int = 64,
                  head_bytes: int = 64, head_param_bytes: int = 0, model: str = "chain") -> Profile:
    """A chain: embed -> blocks ``layers.0..n-1`` (an ``nn.ModuleList``) -> head -> loss."""
    b = StepBuilder(model)
    tokens = b.input(16)
    with b.module("embed", "Embedding"):
        (x,) = b.op("aten.embedding.default", [tokens], act_bytes, saves=[tokens])
    b.container("layers", "ModuleList")
    for k, specs in enumerate(blocks):
        with b.module(f"layers.{k}", "Block", parent="layers"):
            x = _run_block(b, x, specs)
    with b.module("head", "Linear"):
        params = [b.param(head_param_bytes)] if head_param_bytes else []
        (logits,) = b.op("aten.mm.default", [x], head_bytes, saves=[x] + params, params=params)
    b.op("aten.nll_loss.default", [logits], 4, saves=[logits], keep_until_backward=True)
    return b.build()


def residual_block(sizes: Sequence[int], *, saves: Sequence[str] | None = None,
                   times: Sequence[float] | None = None, param_bytes: int = 0,
                   names: Sequence[str] | None = None, act_bytes: int = 64,
                   workspaces: Sequence[int] | None = None) -> list[OpSpec]:
    """A path of ops ``h = op_k(...op_1(x))`` followed by the residual ``x + h``;
    ``workspaces[j]``: op j's kernel workspace (default none)."""
    specs = []
    for j, sz in enumerate(sizes):
        specs.append(OpSpec(
            name=names[j] if names else ("aten.mm.default" if j % 2 == 0 else "aten.gelu.default"),
            out_bytes=sz, time_s=(times[j] if times else TICK),
            save=(saves[j] if saves else "in"),
            param_bytes=param_bytes if j == 0 else 0,
            workspace_bytes=workspaces[j] if workspaces else 0,
        ))
    specs.append(OpSpec("aten.add.Tensor", act_bytes, inputs=(0, -1)))
    return specs


def dropout_ops(nbytes: int, *, time_s: float = TICK) -> list[OpSpec]:
    """Dropout as CPU eager runs it on the previous value ``h`` (``nbytes``): ``empty_like``,
    ``bernoulli_`` and ``div_`` into the mask (in place), then ``mask * h``, saving the mask."""
    return [
        OpSpec("aten.empty_like.default", nbytes, inputs=(-1,)),
        OpSpec("aten.bernoulli_.float", time_s=time_s, inputs=(-1,), inplace=True, random=True),
        OpSpec("aten.div_.Scalar", inputs=(-1,), inplace=True),
        OpSpec("aten.mul.Tensor", nbytes, inputs=(-1, -4), save="in"),
    ]


def random_chain(rng: _random.Random, *, max_blocks: int = 4, max_ops: int = 3,
                 workspace: bool = False, dropout: bool = False) -> Profile:
    """A random small chain: block sizes, saves, times, parameter sizes (and with
    ``workspace``, kernel workspaces; with ``dropout``, a dropout after some blocks' path:
    :func:`dropout_ops`) all drawn from rng."""
    n = rng.randint(1, max_blocks)
    act = rng.choice([32, 64, 128])
    blocks = []
    for _ in range(n):
        k = rng.randint(1, max_ops)
        block = residual_block(
            [rng.choice([16, 64, 128, 256]) for _ in range(k)],
            saves=[rng.choice(["in", "in", "out", "both", ""]) for _ in range(k)],
            times=[rng.randint(1, 8) * TICK for _ in range(k)],
            param_bytes=rng.choice([0, 64, 512, 2048]), act_bytes=act,
            workspaces=[rng.choice(_WORKSPACES) for _ in range(k)] if workspace else None,
        )
        if dropout and rng.random() < 0.7:  # before the residual add, on the path's output
            block[-1:-1] = dropout_ops(block[-2].out_bytes, time_s=rng.randint(1, 8) * TICK)
        blocks.append(block)
    return chain_profile(blocks, act_bytes=act, head_bytes=rng.choice([64, 512]),
                         head_param_bytes=rng.choice([0, 256]))


def unet_profile(levels: Sequence[tuple[int, int]], *, model: str = "unet",
                 conv_workspaces: Sequence[int] | None = None) -> Profile:
    """A UNet-like DAG: ``down.k`` blocks, a bottleneck, ``up.k`` blocks reading skip k.

    ``levels[k] = (activation bytes, inner bytes)`` of level k. Each down block is
    (conv (saves input) -> relu (saves output)) twice; each up block concatenates (saves nothing) the
    previous output with skip k, then conv (saves input) -> relu (saves output).
    ``conv_workspaces[k]``: kernel workspace of level k's convolutions (and their backward ops;
    the bottleneck's is the last level's).
    """
    ws = list(conv_workspaces) if conv_workspaces is not None else [0] * len(levels)
    b = StepBuilder(model)
    x = b.input(levels[0][0])
    b.container("down", "ModuleList")
    b.container("up", "ModuleList")
    skips = []
    for k, (act, inner) in enumerate(levels):
        with b.module(f"down.{k}", "Down", parent="down"):
            w = b.param(64)
            (h,) = b.op("aten.convolution.default", [x, w], inner, saves=[x, w], params=[w], time_s=2 * TICK,
                        workspace_bytes=ws[k])
            (h,) = b.op("aten.relu.default", [h], inner)
            b._ops[-1].saves.append(h)
            w = b.param(64)
            (h,) = b.op("aten.convolution.default", [h, w], act, saves=[h, w], params=[w], time_s=2 * TICK,
                        workspace_bytes=ws[k])
            (x,) = b.op("aten.relu.default", [h], act)
            b._ops[-1].saves.append(x)
        skips.append(x)
    with b.module("mid", "Mid"):
        w = b.param(64)
        (x,) = b.op("aten.convolution.default", [x, w], levels[-1][0], saves=[x, w], params=[w],
                    workspace_bytes=ws[-1])
    for k in reversed(range(len(levels))):
        act, inner = levels[k]
        with b.module(f"up.{k}", "Up", parent="up"):
            (cat,) = b.op("aten.cat.default", [x, skips[k]], 2 * act)
            w = b.param(64)
            (h,) = b.op("aten.convolution.default", [cat, w], inner, saves=[cat, w], params=[w], time_s=2 * TICK,
                        workspace_bytes=ws[k])
            (x,) = b.op("aten.relu.default", [h], act)
            b._ops[-1].saves.append(x)
    b.op("aten.mse_loss.default", [x], 4, saves=[x], keep_until_backward=True)
    return b.build()


def random_unet(rng: _random.Random, *, max_levels: int = 3, workspace: bool = False) -> Profile:
    """A random small UNet; with ``workspace``, random convolution workspaces (drawn last)."""
    n = rng.randint(1, max_levels)
    levels = [(rng.choice([32, 64, 128]), rng.choice([64, 128, 256])) for _ in range(n)]
    ws = [rng.choice(_WORKSPACES) for _ in range(n)] if workspace else None
    return unet_profile(levels, conv_workspaces=ws)


def decoder_profile(n_layers: int, *, d: int = 1024, seq_factor: int = 4,
                    param_bytes: int = 4096, model: str = "decoder") -> Profile:
    """A GPT-like decoder: ``layers.k`` blocks of about 30 ops (attention + MLP, dropouts,
    views), one tied parameter per matmul. Sizes in bytes are multiples of ``d``."""
    s = seq_factor
    T = TICK
    att = [
        OpSpec("aten.native_layer_norm.default", d, T, save="both"),
        OpSpec("aten.mm.default", 3 * d, 4 * T, save="in", param_bytes=param_bytes),
        OpSpec("aten.view.default", view=True),
        OpSpec("aten.split.Tensor", view=True),
        OpSpec("aten.transpose.int", view=True),
        OpSpec("aten.clone.default", d, T),
        OpSpec("aten.bmm.default", s * d, 4 * T, inputs=(-1, -2), save="both"),
        OpSpec("aten.div.Tensor", s * d, T),
        OpSpec("aten.masked_fill.Scalar", s * d, T),
        OpSpec("aten._softmax.default", s * d, 2 * T, save="out"),
        OpSpec("aten.native_dropout.default", s * d, T, random=True, save="out"),
        OpSpec("aten.bmm.default", d, 4 * T, inputs=(-1, 6), save="both"),
        OpSpec("aten.transpose.int", view=True),
        OpSpec("aten.clone.default", d, T),
        OpSpec("aten.view.default", view=True),
        OpSpec("aten.mm.default", d, 2 * T, save="in", param_bytes=param_bytes),
        OpSpec("aten.native_dropout.default", d, T, random=True, save="out"),
        OpSpec("aten.add.Tensor", d, T, inputs=(0, -1)),
    ]
    mlp = [
        OpSpec("aten.native_layer_norm.default", d, T, save="both"),
        OpSpec("aten.mm.default", 4 * d, 8 * T, save="in", param_bytes=param_bytes),
        OpSpec("aten.view.default", view=True),
        OpSpec("aten.gelu.default", 4 * d, 2 * T, save="in"),
        OpSpec("aten.view.default", view=True),
        OpSpec("aten.mm.default", d, 8 * T, save="in", param_bytes=param_bytes),
        OpSpec("aten.view.default", view=True),
        OpSpec("aten.native_dropout.default", d, T, random=True, save="out"),
        OpSpec("aten.view.default", view=True),
        OpSpec("aten.add.Tensor", d, T, inputs=(len(att), -1)),
    ]
    block = att + mlp
    return chain_profile([block] * n_layers, act_bytes=d, head_bytes=8 * d,
                         head_param_bytes=param_bytes, model=model)


def sqrt_ceil(n: int) -> int:
    return math.isqrt(n - 1) + 1 if n > 0 else 0


def gpt_like(n_blocks: int, *, d: int = 1024, seq_factor: int = 4, seed: int = 0):
    """A decoder whose blocks have the sub-modules of the zoo GPT (ln1, attn with its dropout,
    resid_drop, ln2, mlp with its dropout), op times drawn from ``seed``: sub-module regions
    are candidates, as on real profiles (``profile_builders.decoder_profile`` has blocks only)."""
    rng = _random.Random(seed)

    def t(k: int) -> float:
        return k * rng.randint(1, 4) * TICK

    b = StepBuilder("gpt_like")
    tokens = b.input(16)
    with b.module("embed", "Embedding"):
        (x,) = b.op("aten.embedding.default", [tokens], d, saves=[tokens])
    b.container("layers", "ModuleList")

    def op(name, inputs, nbytes, k, *, saves=(), save_out=False, param=False, random_=False):
        params = [b.param(256)] if param else []
        (out,) = b.op(name, list(inputs) + params, nbytes, time_s=t(k), saves=[*saves, *params],
                      params=params, random=random_)
        if save_out:
            b._ops[-1].saves.append(out)
        return out

    for k in range(n_blocks):
        p = f"layers.{k}"
        with b.module(p, "Block", parent="layers"):
            with b.module(f"{p}.ln1", "LayerNorm"):
                h = op("aten.native_layer_norm.default", [x], d, 1, saves=[x], save_out=True)
            with b.module(f"{p}.attn", "Attention"):
                qkv = op("aten.mm.default", [h], 3 * d, 4, saves=[h], param=True)
                att = op("aten.bmm.default", [qkv], seq_factor * d, 4, saves=[qkv])
                sm = op("aten._softmax.default", [att], seq_factor * d, 2, save_out=True)
                with b.module(f"{p}.attn.drop", "Dropout"):
                    dr = op("aten.native_dropout.default", [sm], seq_factor * d, 1, save_out=True, random_=True)
                y = op("aten.bmm.default", [dr, qkv], d, 4, saves=[dr, qkv])
                o = op("aten.mm.default", [y], d, 2, saves=[y], param=True)
            with b.module(f"{p}.resid_drop", "Dropout"):
                o = op("aten.native_dropout.default", [o], d, 1, save_out=True, random_=True)
            x = op("aten.add.Tensor", [x, o], d, 1)
            with b.module(f"{p}.ln2", "LayerNorm"):
                h = op("aten.native_layer_norm.default", [x], d, 1, saves=[x], save_out=True)
            with b.module(f"{p}.mlp", "MLP"):
                f = op("aten.mm.default", [h], 4 * d, 8, saves=[h], param=True)
                g = op("aten.gelu.default", [f], 4 * d, 2, saves=[f])
                o = op("aten.mm.default", [g], d, 8, saves=[g], param=True)
                with b.module(f"{p}.mlp.drop", "Dropout"):
                    o = op("aten.native_dropout.default", [o], d, 1, save_out=True, random_=True)
            x = op("aten.add.Tensor", [x, o], d, 1)
    with b.module("head", "Linear"):
        logits = op("aten.mm.default", [x], 8 * d, 4, saves=[x])
    b.op("aten.nll_loss.default", [logits], 4, saves=[logits], keep_until_backward=True)
    return b.build()
