"""How deep a JAX plan must nest to fit the 3D conv net in 30% of its plain peak: region
structures built by hand, as ``memfit.jax`` runs its plans, with XLA's reported peak.

The benchmark conv net (``memfit.jax.models.conv3d``: three stages of ``conv0, bn0, relu,
conv1, bn1, relu``, 16^3, batch 2) at 0.3 of its jaxpr-level plain peak is 2,871,327 B; with
regions nested one level ``memfit.jax.fit`` named 3,515,068 B as the least peak it found. Each row here is a set of ``RegionSpec``s (``memfit.jax.program``: a run of primal
equations under one ``jax.checkpoint`` saving nothing, its inner runs nested in it), compiled
with the barriers kept as ``fit`` compiles on the CPU; per row XLA's temp + output - alias bytes
of ``memory_analysis()`` and whether the loss, gradients and batch statistics are the plain
step's bits. Names: ``sK`` stage K, ``sK.p1`` its ``conv0..relu``, ``sK.p2`` its ``conv1..relu``,
``>`` nests, ``[...]`` one region holding those. The last row is ``memfit.jax.fit(budget=0.3)``
(its plan: the nested prefixes of NOTE [regions nested deeper] in ``memfit.planning.nesting``).
Writes benchmarks/results/jax-nesting-depth.md.

    PYTHONPATH=src python -m benchmarks.jax_nesting_depth
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jax

from memfit.jax.fit import fit
from memfit.jax.measured import xla_report
from memfit.jax.models import conv3d
from memfit.jax.profiler import profile_program
from memfit.jax.program import RegionSpec, trace_program
from memfit.jax.step import PlannedStep, plain_step
from memfit.planning.plan import Plan

OUT = Path(__file__).parent / "results" / "jax-nesting-depth.md"


def _stage_spans(program: Any) -> list[tuple[int, int, int]]:
    """Per stage: its first and last primal equation and the one making its middle relu
    (the stage's own code between ``bn0`` and ``conv1``)."""
    spans = []
    for i in range(3):
        ks = [k for k, s in enumerate(program.scopes) if s == f"ConvNet3D.stage_{i}"
              or s.startswith(f"ConvNet3D.stage_{i}.")]
        mid = next(k for k in ks if program.scopes[k] == f"ConvNet3D.stage_{i}")
        spans.append((min(ks), max(ks), mid))
    return spans


def main() -> None:
    loss_fn, params, batch, aux = conv3d(batch=2, size=16)
    program = trace_program(loss_fn, params, batch)
    prof = profile_program(program, has_aux=aux, model="conv3d")
    spans = _stage_spans(program)

    def part(i: int, k: int) -> RegionSpec:
        a, b, mid = spans[i]
        return RegionSpec(a, mid) if k == 1 else RegionSpec(mid + 1, b)

    def stage(i: int, parts: bool = True) -> RegionSpec:
        a, b, _ = spans[i]
        return RegionSpec(a, b, frozenset(), [part(i, 1), part(i, 2)] if parts else [])

    def joined(*inner: RegionSpec) -> RegionSpec:
        return RegionSpec(inner[0].start, inner[-1].end, frozenset(), list(inner))

    rows: list[tuple[str, int, list[RegionSpec]]] = [
        ("s0, s1, s2 (nothing_saveable on every stage)", 1, [stage(i, False) for i in range(3)]),
        ("s0 > parts, s1 > parts, s2 > parts (memfit's least, one level)", 2, [stage(i) for i in range(3)]),
        ("[s0 > parts, s1 > parts, s2 > parts]", 3, [joined(*(stage(i) for i in range(3)))]),
        ("[s0 > parts, s1 > parts], s2 > parts", 3, [joined(stage(0), stage(1)), stage(2)]),
        ("[s0, s1, s2.p1], s2.p2", 2, [joined(stage(0, False), stage(1, False), part(2, 1)), part(2, 2)]),
        ("[s0 > parts, s1 > parts, s2.p1], s2.p2", 3, [joined(stage(0), stage(1), part(2, 1)), part(2, 2)]),
        ("[[s0 > parts, s1 > parts], s2.p1], s2.p2", 4,
         [joined(joined(stage(0), stage(1)), part(2, 1)), part(2, 2)]),
        ("[[s0 > parts, s1.p1], s1.p2], [s2.p1], s2.p2", 4,
         [joined(joined(stage(0), part(1, 1)), part(1, 2)), part(2, 1), part(2, 2)]),
        ("[[[s0 > parts, s1.p1], s1.p2], s2.p1], s2.p2", 5,
         [joined(joined(joined(stage(0), part(1, 1)), part(1, 2)), part(2, 1)), part(2, 2)]),
    ]
    plain = plain_step(loss_fn, has_aux=aux)
    ref = jax.tree_util.tree_leaves(plain(params, batch))
    plain_peak = _xla_peak(plain.lower(params, batch))
    budget = int(0.3 * prof.peak_bytes)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# Nesting depth on the 3D conv net (CPU, jax {jax.__version__}, commit {commit})", "",
             f"jaxpr-level plain peak {prof.peak_bytes} B; 0.3 of it {budget} B, with the issue's 5% "
             f"{int(budget * 1.05)} B; XLA's plain step {plain_peak} B.", "",
             "| regions | levels | XLA temp+out | / 0.3 budget | XLA FLOPs | bitwise |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    steps = []
    for name, levels, specs in rows:
        step = PlannedStep(program, Plan((), 0, 0.0, None, name, ""), prof, has_aux=aux, keep_barriers=True)
        step.regions = specs
        steps.append((name, levels, step))
    fitted = fit(loss_fn, params, batch, budget=0.3, has_aux=aux, time_limit_s=5.0)
    depth = max(len(fitted.plan.outers_of(r)) for r in fitted.plan.regions) + 1
    steps.append((f"memfit.jax.fit(budget=0.3): {fitted.plan.solver}", depth, fitted))
    for name, levels, step in steps:
        got = jax.tree_util.tree_leaves(step(params, batch))
        exact = all(bool((a == b).all()) for a, b in zip(got, ref, strict=True))
        peak, flops = xla_report(step.lower(params, batch))
        lines.append(f"| {name} | {levels} | {peak} | {peak / budget:.3f} | {flops} | {exact} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _xla_peak(lowered: Any) -> int:
    return xla_report(lowered)[0]


if __name__ == "__main__":
    main()
