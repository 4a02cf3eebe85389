"""``memfit demo``: the whole product on a zoo model in about a minute.

Profile a GPT, sweep a few budgets against the baselines (measured, not predicted), tune one
budget (time the best few plans on the model, keep the fastest), verify the gradients of one
plan against the un-checkpointed step, then print the table and write the plot and JSON files.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from memfit.cli.exits import EXIT_OK, EXIT_VERIFY_FAILED, error_object
from memfit.cli.models import UsageError
from memfit.cli.output import emit, say
from memfit.units import format_bytes, format_seconds
from memfit.zoo.specs import load_model

__all__ = ["add_parser", "run", "DEMO_MODELS"]

# Sized for about 0.3-0.5 s per step on 2 CPU cores, so that the demo takes about a minute.
DEMO_MODELS = {
    "gpt": "gpt:n_layer=6,d_model=256,n_head=4,seq_len=256,vocab_size=512,batch=4",
    "resnet": "resnet:blocks_per_stage=(2,2,2),width=32,batch=16,size=32",
    "unet3d": "unet3d:base=8,depth=3,batch=1,size=32",
}
DEMO_BUDGETS: tuple[Any, ...] = (0.7, 0.5, 0.3, "min")
DEMO_BASELINES = ("every_block", "sqrt", "save_matmuls")
DEMO_TUNE_BUDGET = 0.5  # one budget tuned: its candidates are timed within the default limit


def add_parser(subs: Any, common: argparse.ArgumentParser) -> None:
    p = subs.add_parser("demo", parents=[common], help="profile, plan, verify and report on a zoo model",
                        description="The whole of memfit on a zoo model: profile one step, plan it for "
                                    "several budgets, measure each plan against the baselines, tune one "
                                    "budget, verify one plan's gradients bitwise, print the table "
                                    "and write sweep.png, sweep.json, tuned-plan.json, plan.json "
                                    "and verify.json to --out.")
    p.add_argument("--model", default="gpt",
                   help=f"a zoo model ({', '.join(DEMO_MODELS)}: demo sizes) or any MODEL spec (default gpt)")
    p.add_argument("--out", default="memfit-demo", metavar="DIR", help="output folder (default ./memfit-demo)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per configuration, interleaved (default 5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _pick(rows: Any) -> Any:
    """The plan to verify: the tightest memfit budget that measured, i.e. the most recompute."""
    ok = [r for r in rows if r.plan is not None and r.plan.regions]
    return min(ok, key=lambda r: r.measured_peak_bytes) if ok else None


def _tune(args: argparse.Namespace, lm: Any) -> Any:
    """Step 2: the fastest measured plan for ``DEMO_TUNE_BUDGET`` (None if none fits)."""
    from memfit.errors import InfeasibleBudget
    from memfit.measuring.tuning import tune
    from memfit.profiling.tracer import trace
    from memfit.step.harness import Step

    say(args, f"\n2/4 tune: time the solver's best plans for {DEMO_TUNE_BUDGET:.0%} and the baselines "
              "that fit on the model, interleaved, and keep the fastest")
    step = Step.of(lm.model, lm.example_inputs, loss_fn=lm.loss_fn)
    try:
        tuned = tune(step, trace(step), DEMO_TUNE_BUDGET, progress=not args.no_progress and not args.json)
    except InfeasibleBudget as e:
        say(args, f"  no plan fits {DEMO_TUNE_BUDGET:.0%}: {e}")
        return None
    if tuned.tuning is not None:
        say(args, "\n".join(tuned.tuning.lines()))
    return tuned


def run(args: argparse.Namespace) -> int:
    from memfit.cli.sweep import write_outputs
    from memfit.cli.verify import verification_failed
    from memfit.measuring.tradeoff import sweep
    from memfit.measuring.verification import verify
    from memfit.runtime.apply import apply_plan

    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    t0 = time.perf_counter()
    spec = DEMO_MODELS.get(args.model, args.model)
    lm = load_model(spec)
    if lm.on_meta:
        raise UsageError("the demo runs real steps; give a zoo model or a module:factory")
    n_params = sum(p.numel() for p in lm.model.parameters())
    shapes = [tuple(t.shape) for t in ([lm.example_inputs] if hasattr(lm.example_inputs, "shape")
                                       else lm.example_inputs)]
    say(args, f"memfit demo: {lm.name} ({n_params / 1e6:.1f}M parameters, inputs {shapes})")
    say(args, "1/4 sweep: profile one step, plan for budgets "
              f"{', '.join(str(b) for b in DEMO_BUDGETS)} and baselines, measure each plan")
    s = sweep(lm.model, lm.example_inputs, DEMO_BUDGETS, loss_fn=lm.loss_fn, baselines=DEMO_BASELINES,
              repeats=args.repeats, progress=not args.no_progress and not args.json, name=lm.name)
    out = Path(args.out)
    files = write_outputs(s, out)
    say(args, "")
    say(args, s.summary())
    say(args, "")
    say(args, s.table())

    tuned = _tune(args, lm)
    if tuned is not None:
        tuned.save(out / "tuned-plan.json")
        files.append(str(out / "tuned-plan.json"))

    row = _pick(s.memfit_rows)
    report = None
    if row is not None:
        say(args, f"\n3/4 verify the {row.label} plan against the un-checkpointed step (same seed)")
        apply_plan(lm.model, row.plan)
        report = verify(lm.model, lm.example_inputs, loss_fn=lm.loss_fn)
        say(args, str(report))
        row.plan.save(out / "plan.json")
        (out / "verify.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
        files += [str(out / "plan.json"), str(out / "verify.json")]
    wall = time.perf_counter() - t0

    say(args, "\n4/4 result")
    if row is not None and report is not None:
        verdict = ("gradients, loss and BatchNorm statistics bitwise identical" if report.bitwise
                   else f"max gradient difference {report.max_abs_diff:.3g}")
        say(args, f"  it fits: peak {format_bytes(s.plain_peak_bytes)} -> {format_bytes(row.measured_peak_bytes)} "
                  f"({row.measured_peak_bytes / s.plain_peak_bytes:.0%} of plain) at "
                  f"{row.overhead:+.1%} step time; {verdict}; verification {'PASSED' if report.ok else 'FAILED'}")
    else:
        say(args, "  no memfit plan could be measured (see the table)")
    for f in files:
        say(args, f"  wrote {f}")
    say(args, f"  demo took {format_seconds(wall)}")
    ok = report is not None and report.ok
    if args.json:
        data = {"kind": "memfit.Demo", "model": lm.name, "sweep": s.to_dict(),
                "tuned": tuned.to_dict() if tuned is not None else None,
                "verify": report.to_dict() if report else None, "files": files, "wall_s": wall}
        if report is not None and not report.ok:
            data["error"] = verification_failed(report.checks)
        elif report is None:
            data["error"] = error_object("VerificationFailed", "no memfit plan could be measured, "
                                         "so none was verified", EXIT_VERIFY_FAILED)["error"]
        emit(args, "", data)
    return EXIT_OK if ok else EXIT_VERIFY_FAILED
