"""A JAX plan's budget checked against what XLA reports for the compiled step, in rounds.

NOTE [budgets checked against XLA]
    memfit plans a JAX step for its jaxpr-level peak (NOTE [a jaxpr as a Profile] in
    ``memfit.jax.profiler``), which is not XLA's: XLA fuses elementwise chains and schedules
    its own buffers. Measured on the models of ``memfit.jax.models`` (docs/jax.md): XLA's
    peak of a planned step was 0.74-0.90 of the budget on a GPT (memory the plan could have
    spent on less recompute) and up to 1.05 on a 3D conv net (over). So for a budget in
    bytes, ``fit`` compiles the planned step and reads ``memory_analysis()`` (temp + output
    - alias bytes, as the tests and benchmarks count XLA's peak) and plans again, up to
    ``rounds`` times: the model's budget scaled by ``budget / XLA peak`` until a step above
    and one within the budget are seen, then halved between their model budgets (XLA's
    ratio to the model differs from plan to plan); it stops within 2% below the budget.
    JAX's own policies on every child scope of the model (``policy_plans``: as ``nn.remat``
    on each block would) are checked too, as memfit plans: the jaxpr-level
    model ranks plans by peaks XLA does not keep, and on the 3D conv net XLA's peak of
    ``nothing_saveable`` on every stage (4,563,580 B) was below that of memfit's least-peak
    plan (5,087,804 B). Of the plans XLA reports within the budget it returns the one with
    the least FLOPs by XLA's own ``cost_analysis()`` (then the least predicted recompute):
    the jaxpr-level count differs from XLA's by what XLA fuses, and on the tiny GPT of the
    tests a plan predicted cheaper than ``dots_saveable`` on every block ran 4,046,145 FLOPs
    against its 3,943,745. Of those, only one whose outputs are the plain step's bits (NOTE
    [JAX plans verified on the batch] in ``memfit.jax.verify``; ``fit`` refuses the regions
    of one that is not and chooses again). None within: the least-peak plan if XLA reports it within, else
    ``InfeasibleBudget`` naming the smallest XLA peak seen. A budget under the model's least
    peak is checked the same way, on the least-peak plan and the policies' plans: the
    smallest XLA peak of those is the one named, and given it, that plan is returned.
    ``"min"`` is not re-planned (it asks for the least peak, not a budget): it returns the
    least XLA peak of the model's least-peak plan, the model's plans at 1.05, 1.1 and 1.2
    times its least peak (``near_least``: the model's ranking of peaks is not XLA's) and the
    policies' plans, the plan's ``budget_bytes`` that peak; steps within ``MIN_SLACK``
    (0.1%) of the least XLA peak count as equal, and of those the one of least XLA FLOPs is
    returned.
    Beside JAX's three policies, two-level ones (``NESTED``, ``NESTED_AT_DOTS``): every child
    scope checkpointed with its parts checkpointed inside it (NOTE [segments nested in a
    block] in ``memfit.planning.nesting``), the parts the blocks of its chain, or its
    sub-modules cut after each that runs a dot or a convolution (the replay of such a part
    reruns the elementwise ops after its dot, not the dot: a dot's backward reads only its
    inputs). A child scope whose nested plan changes the result where the scope alone does
    not is left whole by both (``memfit.planning.nesting.unnesting``; NOTE [JAX plans
    verified on the batch]). On the benchmark conv net (``memfit.jax.models.conv3d``):
    before nesting, ``"min"`` returned ``nothing_saveable`` on every stage (4,563,580 B at
    1.529 GFLOPs; the model's least-peak plan was at 5,087,804 B); with it, the model's
    least-peak plan (the chain DP's: the second stage with its blocks nested, the third's
    blocks alone) is the least on XLA too, 3,515,068 B at 1.677 GFLOPs, ``NESTED_AT_DOTS``
    3,515,580 B at 1.529, and the model's plan at 1.1 times its least peak 3,515,068 B at
    1.478, which ``"min"`` returns.
    And the nested prefixes (``PREFIXES``, ``PREFIXES_AT_DOTS``, ``PREFIXES_OF_CHILDREN``;
    NOTE [regions nested deeper] in ``memfit.planning.nesting``): the parts of every child
    scope in call order (those that drop nothing left out), each run of the first ``k`` a
    region around the run of ``k - 1`` and the ``k``-th part, over at most
    ``MAX_PREFIX_UNITS`` (8) parts (the first part reruns once per level). On the benchmark conv net
    ``"min"`` and a budget of 0.3 of the plain peak (2,871,327 B; infeasible before, the
    least named 3,515,068 B) now return ``PREFIXES``: 2,730,196 B at 1.819 GFLOPs, bitwise.
    The plan returned keeps the user's budget as ``budget_bytes``; its
    ``predicted_peak_bytes`` is the jaxpr-level model's (it may exceed the budget where XLA's
    peak is lower), and the step's ``xla_peak_bytes`` is XLA's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from memfit.errors import InfeasibleBudget
from memfit.jax.verify import Reference, Verification
from memfit.planning.candidates import PlanningContext
from memfit.planning.effects import ProfileArrays, RegionModel, resolve_span
from memfit.planning.nesting import nesting_refused, parts_after_dots
from memfit.planning.plan import Plan, Region
from memfit.planning.rules import contains_refused_span, is_matmul, op_keys
from memfit.planning.simulate import simulate
from memfit.profiling.profile import Profile
from memfit.units import format_bytes

__all__ = ["xla_peak_bytes", "xla_report", "OnXla", "measured_rounds", "least_on_xla", "least_peak_on_xla", "near_least", "policy_plans"]

NEAR = 0.98  # a round within 2% below the budget ends the search


def xla_peak_bytes(lowered: Any) -> int:
    """XLA's peak of a lowered step: temp + output - alias bytes of ``memory_analysis()``."""
    return xla_report(lowered)[0]


def xla_report(lowered: Any) -> tuple[int, int]:
    """XLA's peak (as ``xla_peak_bytes``) and FLOPs (``cost_analysis()``) of a lowered step,
    from one compile."""
    return _report(lowered.compile())


def _report(c: Any) -> tuple[int, int]:
    m = c.memory_analysis()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return (int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes),
            int(ca.get("flops", 0)) if ca else 0)


class OnXla:
    """The planned steps ``fit`` compiles, one compile per plan (by its regions): XLA's peak
    and FLOPs of each and, where asked, its outputs against the plain step's on the batch
    (NOTE [JAX plans verified on the batch] in ``memfit.jax.verify``).

    Args:
        params, batch: what the steps are compiled for and run on.
        reference: the plain step's outputs; None: plans are not run (every one counts as
            exact).
    """

    def __init__(self, params: Any, batch: Any, reference: Reference | None = None) -> None:
        self.params, self.batch, self.reference = params, batch, reference
        self._compiled: dict[Any, tuple[int, int, Any]] = {}
        self._verified: dict[Any, Verification] = {}

    def peak(self, step: Any) -> int:
        """XLA's peak of ``step`` (its ``xla_peak_bytes``; ``xla_flops`` set too)."""
        key = step.plan.regions
        if key not in self._compiled:
            c = step.lower(self.params, self.batch).compile()
            self._compiled[key] = (*_report(c), c)
        step.xla_peak_bytes, step.xla_flops, _ = self._compiled[key]
        return int(step.xla_peak_bytes)

    def seen(self, step: Any) -> bool:
        return step.plan.regions in self._compiled

    def exact(self, step: Any) -> bool:
        """Whether ``step``'s outputs on the batch are the plain step's bits (its
        ``verification`` set); True without a reference."""
        if self.reference is None:
            return True
        key = step.plan.regions
        if key not in self._verified:
            self.peak(step)
            self._verified[key] = self.reference.check(self._compiled[key][2])
        step.verification = self._verified[key]
        return step.verification.bitwise

    def first_exact(self, ordered: Sequence[Any]) -> Any:
        """The first of ``ordered`` whose outputs are bitwise the plain step's, else the first
        (``fit`` then refuses its inexact regions or warns)."""
        return next((s for s in ordered if self.exact(s)), ordered[0])


def _cost(s: Any) -> tuple[int, float, int]:
    """The least XLA FLOPs, then the least predicted recompute (NOTE [budgets checked
    against XLA])."""
    return (s.xla_flops, s.plan.recompute_s, s.xla_peak_bytes)


def _cheapest(fitting: Sequence[Any], checks: OnXla) -> Any:
    """Of the steps within the budget, the cheapest (``_cost``) that is exact."""
    return checks.first_exact(sorted(fitting, key=_cost))


def measured_rounds(first: Any, budget_bytes: int, replan: Callable[[int | str], Plan],
                    build: Callable[[Plan], Any], checks: OnXla, rounds: int,
                    alternatives: Sequence[Plan] = ()) -> Any:
    """The exact step of least XLA FLOPs whose XLA peak is within ``budget_bytes``, from
    ``first`` and up to ``rounds`` re-plans (NOTE [budgets checked against XLA]).

    Args:
        first: the planned step at ``budget_bytes`` (a ``PlannedStep``).
        replan: model budget in bytes (or ``"min"``) -> Plan (raises ``InfeasibleBudget``).
        build: Plan -> step.
        checks: compiles and runs the steps (``OnXla``).
        alternatives: plans checked too, after the rounds (JAX's own policies as plans).

    Raises:
        InfeasibleBudget: no step seen fits; ``min_feasible_bytes`` is the smallest XLA peak
            seen of an exact step (the budget that, given, plans at least that step).
    """
    step, model_budget = first, budget_bytes
    fitting: list[Any] = []
    seen: list[Any] = []
    lo: int | None = None  # the largest model budget whose step XLA reports within the budget
    hi: int | None = None  # the smallest whose step it reports above
    for k in range(rounds + 1):
        new = not checks.seen(step)
        peak = checks.peak(step)
        if new:
            seen.append(step)
            if peak <= budget_bytes:
                fitting.append(step)
        if peak <= budget_bytes:
            lo = model_budget if lo is None else max(lo, model_budget)
        else:
            hi = model_budget if hi is None else min(hi, model_budget)
        if k == rounds or NEAR * budget_bytes <= peak <= budget_bytes or peak == 0:
            break
        # scaled by XLA's ratio until both sides are seen, then halved between them
        if lo is not None and hi is not None:
            if hi - lo <= 0.005 * budget_bytes:
                break
            nxt = (lo + hi) // 2
        else:
            nxt = int(model_budget * budget_bytes / peak)
        try:
            plan = replan(nxt)
        except InfeasibleBudget:
            break  # under the model's least peak: the least-peak plan is tried below
        model_budget = nxt
        note = (f"budget checked against XLA's memory_analysis(): planned for {format_bytes(nxt)} "
                f"of jaxpr-level peak (NOTE [budgets checked against XLA])")
        step = build(dataclasses.replace(plan, budget_bytes=budget_bytes, notes=(*plan.notes, note)))
    for alt in alternatives:  # JAX's policies as plans (NOTE [budgets checked against XLA])
        step = build(dataclasses.replace(alt, budget_bytes=budget_bytes))
        if checks.seen(step):
            continue
        seen.append(step)
        if checks.peak(step) <= budget_bytes:
            fitting.append(step)
    if not fitting:  # the least-peak plan is the last to try
        return least_on_xla([build(replan("min"))], budget_bytes, checks, seen)
    return _cheapest(fitting, checks)


def least_on_xla(steps: Sequence[Any], budget_bytes: int, checks: OnXla, seen: Sequence[Any] = ()) -> Any:
    """Of ``steps``, the exact one of least XLA FLOPs (then predicted recompute) whose XLA
    peak is within ``budget_bytes``.

    Raises:
        InfeasibleBudget: none is; ``min_feasible_bytes`` is the smallest XLA peak of an
            exact step among ``steps`` and ``seen`` (steps checked before; of any step where
            none is exact).
    """
    fitting = [s for s in steps if checks.peak(s) <= budget_bytes]
    if fitting:
        return _cheapest(fitting, checks)
    tried = sorted({id(s): s for s in (*seen, *steps)}.values(), key=lambda s: checks.peak(s))
    least = checks.peak(next((s for s in tried if checks.exact(s)), tried[0]))
    raise InfeasibleBudget(
        f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes): XLA reports every planned "
        f"step above it, the smallest at {format_bytes(least)} ({least} bytes; NOTE [budgets "
        f"checked against XLA] in memfit.jax.measured). Give a budget of at least {least} "
        "bytes, or budget='min'",
        budget_bytes=budget_bytes, min_feasible_bytes=least, fits_with=(f"a budget of at least {least} bytes",))


def least_peak_on_xla(steps: Sequence[Any], checks: OnXla) -> Any:
    """Of ``steps``, the exact one of least XLA peak (within ``MIN_SLACK``, the one of least
    XLA FLOPs), its plan's budget that peak: ``budget="min"`` checked against XLA (NOTE
    [budgets checked against XLA])."""
    ordered = sorted(steps, key=lambda s: (checks.peak(s), s.xla_flops, s.plan.recompute_s))
    best = checks.first_exact(ordered)
    # within MIN_SLACK of that peak, the least FLOPs (bytes XLA's scheduling moves do not
    # buy a quarter more compute)
    near = [s for s in ordered if checks.peak(s) <= best.xla_peak_bytes * (1 + MIN_SLACK)]
    best = checks.first_exact(sorted(near, key=lambda s: (s.xla_flops, checks.peak(s), s.plan.recompute_s)))
    note = (f"budget='min' checked against XLA's memory_analysis(): the least XLA peak of the "
            f"model's plans at and near its least peak and JAX's policies ({best.plan.solver})")
    best.plan = dataclasses.replace(best.plan, budget_bytes=best.xla_peak_bytes, notes=(*best.plan.notes, note))
    return best


def near_least(replan: Callable[[int | str], Plan], least: Plan) -> list[Plan]:
    """The model's plans for ``NEAR_LEAST`` times its least peak (``least``'s), distinct from
    it and from each other: ``"min"`` checks them on XLA too (NOTE [budgets checked against
    XLA])."""
    out: list[Plan] = []
    seen = {least.regions}
    for f in NEAR_LEAST:
        try:
            q = replan(int(least.predicted_peak_bytes * f))
        except InfeasibleBudget:
            continue
        if q.regions not in seen:
            seen.add(q.regions)
            out.append(q)
    return out


# "min": the model's plans at these multiples of its least peak are checked on XLA too
NEAR_LEAST = (1.05, 1.1, 1.2)

MIN_SLACK = 0.001  # "min": steps this close to the least XLA peak count as equal (then the least FLOPs)

POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


def policy_plans(profile: Profile, budget_bytes: int) -> list[Plan]:
    """JAX's ``nothing_saveable``, ``dots_saveable`` and ``dots_with_no_batch_dims_saveable``
    on every child scope of the model (as ``nn.remat`` on each would), as memfit plans: each
    child a region saving nothing, its dots and convolutions, or its dots without batch
    dimensions (``extra["unbatched_dots"]``); ``nothing_saveable`` with each child's parts
    nested in it, where a child has parts (``_nested_regions``); and the nested prefixes of
    the children's parts (``_prefix_regions``). None where the model has no child
    scope; a child whose span the profile refuses (NOTE [refused spans]) is left out of each."""
    recs = {m.path: m for m in profile.modules}
    root = next((m for m in profile.modules if m.path and m.parent == ""), None)
    if root is None:
        return []
    kids = [recs[c] for c in root.children if recs[c].calls == 1 and recs[c].first_op is not None
            and not contains_refused_span(profile, int(recs[c].first_op), int(recs[c].last_op))]  # type: ignore[arg-type]
    unbatched = set(profile.extra.get("unbatched_dots", ()))
    out = []
    for name in POLICIES:
        regions = []
        for m in kids:
            keys = op_keys(profile, int(m.first_op), int(m.last_op))  # type: ignore[arg-type]
            take = [k for i, k in keys.items() if profile.ops[i].saveable and is_matmul(profile.ops[i])
                    and (name == "dots_saveable" or (name != "nothing_saveable" and i in unbatched))]
            regions.append(Region.saving((m.path,), take))
        if regions:
            out.append(_priced(profile, regions, name, budget_bytes))
    chains = {ch.parent: ch.blocks for ch in reversed(PlanningContext(profile).chains)}
    for name, parts in ((NESTED, chains.get), (NESTED_AT_DOTS, lambda p: parts_after_dots(profile, p))):
        nested = _nested_regions(profile, kids, parts)
        if nested:
            out.append(_priced(profile, nested, name, budget_bytes))
    by_rule: tuple[tuple[str, Callable[[str], Sequence[tuple[str, ...]] | None]], ...] = (
        (PREFIXES, chains.get), (PREFIXES_AT_DOTS, lambda p: parts_after_dots(profile, p)),
        (PREFIXES_OF_CHILDREN, lambda p: None))
    for name, rule in by_rule:
        units = [u for m in kids for u in (rule(m.path) or [(m.path,)])]
        prefixed = _prefix_regions(profile, units)
        if prefixed and all(tuple(x.modules for x in r.regions) != tuple(x.modules for x in prefixed) for r in out):
            out.append(_priced(profile, prefixed, name, budget_bytes,
                               note=f"{name}: every run of the first parts a region around the run before it "
                                    "and the next part (NOTE [regions nested deeper] in memfit.planning.nesting)"))
    return out


PREFIXES = "nothing_saveable, nested prefixes"
PREFIXES_AT_DOTS = "nothing_saveable, nested prefixes at dots"
PREFIXES_OF_CHILDREN = "nothing_saveable, nested prefixes of child scopes"
# the nested prefixes rerun the first of n parts n - 1 times (about n^2 / 2 parts' forwards in
# all) and nest n - 1 deep: offered over at most this many parts (the benchmark GPT has 8)
MAX_PREFIX_UNITS = 8


def _prefix_regions(profile: Profile, units: Sequence[tuple[str, ...]]) -> list[Region]:
    """The units ``u1..un`` (runs of modules in call order) as nested prefixes (NOTE [regions
    nested deeper] in ``memfit.planning.nesting``): each unit a region, and for ``k`` in
    ``2..n-1`` the run ``u1..uk`` a region around the run ``u1..u(k-1)`` and ``uk``; [] where
    fewer than three units, or more than ``MAX_PREFIX_UNITS``, drop something (the others are
    left out), or a region would contain a refused span (NOTE [refused spans]) or nest where
    the profile refuses it (``nesting_refused``)."""
    arrs = ProfileArrays(profile)
    resolved = [(u, resolve_span(profile, u, arrs.module_index)) for u in units]
    kept = [(u, (s.first_op, s.last_op)) for u, s in resolved if RegionModel(arrs, s).useful]
    if not 3 <= len(kept) <= MAX_PREFIX_UNITS:
        return []
    first = kept[0][1][0]
    if any(contains_refused_span(profile, a, b) for a, b in (*(sp for _, sp in kept), (first, kept[-2][1][1]))):
        return []
    regions = [(sp, Region(u)) for u, sp in kept]
    for k in range(1, len(kept) - 1):
        if nesting_refused(profile, first, kept[k][1][1]):
            return []
        regions.append(((first, kept[k][1][1]), Region(tuple(m for u, _ in kept[: k + 1] for m in u))))
    return [r for _, r in sorted(regions, key=lambda x: (x[0][0], -x[0][1]))]


NESTED = "nothing_saveable, nested"
NESTED_AT_DOTS = "nothing_saveable, nested at dots"


def _nested_regions(profile: Profile, kids: Sequence[Any],
                    parts: Callable[[str], Sequence[tuple[str, ...]] | None]) -> list[Region]:
    """``nothing_saveable`` on every child scope with each of its parts (``parts(path)``: runs
    of its sub-modules, joined by its own code between them) checkpointed inside it (NOTE
    [segments nested in a block] in ``memfit.planning.nesting``); [] where no child has two
    parts. Parts whose span the profile refuses are left out."""
    recs = {m.path: m for m in profile.modules}
    regions: list[Region] = []
    inner = 0
    for m in kids:
        regions.append(Region((m.path,)))
        if nesting_refused(profile, int(m.first_op), int(m.last_op)):  # type: ignore[arg-type]
            continue
        blocks = parts(m.path) or ()
        if len(blocks) < 2:
            continue
        for blk in blocks:
            first, last = recs[blk[0]].first_op, recs[blk[-1]].last_op
            if not contains_refused_span(profile, int(first), int(last)):  # type: ignore[arg-type]
                regions.append(Region(blk))
                inner += 1
    return regions if inner else []


def _priced(profile: Profile, regions: list[Region], name: str, budget_bytes: int, note: str = "") -> Plan:
    """A plan of ``regions`` with its simulated peak and recompute."""
    sim = simulate(profile, Plan(tuple(regions), 0, 0.0, None, name, ""))
    regions = [dataclasses.replace(r, recompute_s=float(t), saved_bytes=int(b))
               for r, t, b in zip(regions, sim.region_recompute_s, sim.region_saved_bytes, strict=True)]
    return Plan(
        regions=tuple(regions), predicted_peak_bytes=sim.peak_bytes, recompute_s=sim.recompute_s,
        budget_bytes=budget_bytes, solver=name, profile_signature=profile.signature,
        plain_peak_bytes=profile.peak_bytes, plain_step_s=profile.step_time_s, model=profile.model,
        notes=(note or f"JAX's {name} on every child scope of the model, as a memfit plan",),
        input_signature=profile.input_signature, extra_flops=int(sim.recompute_flops),
        profile_device=profile.device)
