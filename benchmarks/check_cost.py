"""What the divergence check costs: a step with the check off, ops only, ops and values, and
the default sampled check, on the every-block plan of the zoo GPT and 3D UNet.

Usage (from the repository root)::

    python -m benchmarks.check_cost [--model gpt unet3d] [--rounds 15] [--out benchmarks/results]

Each method is the same model (deep copies) with ``memfit.apply(model, plan, check=...)``:

- ``off``: ``check=False``, the baseline of every ratio;
- ``ops``: ``check="always-ops"`` (overloads, shapes, dtypes on every call: the check before
  values existed);
- ``ops+values``: ``check="always"`` (every call, ops and output fingerprints);
- ``sampled``: ``check=True``, the default, measured after its first checked calls (the
  warm-up runs them), so these steps are unchecked; ``sampled (amortized)`` adds one
  ``ops+values`` step in every ``DivergenceCheck.every``.

Methods are timed interleaved (NOTE [interleaving] in ``benchmarks.harness``), with the pinned
malloc (NOTE [pinned malloc]); the table gives medians and ratios to ``off``. The gradients
of every method are compared bitwise with ``off`` on one seeded step.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

log = logging.getLogger("benchmarks.check_cost")

SCHEMA_VERSION = 1
TARGET = 0.03  # the whole check, amortized, within 3% of a step
METHODS: tuple[tuple[str, Any], ...] = (
    ("off", False),
    ("ops", "always-ops"),
    ("ops+values", "always"),
    ("sampled", True),
)
MODELS = ("gpt", "unet3d")


def build(name: str) -> tuple[torch.nn.Module, tuple[Any, ...], Any, dict[str, Any]]:
    """The model, its step inputs, its loss and its sizes."""
    from memfit import zoo

    if name == "gpt":  # the README's quick-start size
        cfg: dict[str, Any] = dict(n_layer=4, d_model=128, n_head=4, seq_len=128, dropout=0.1)
        model = zoo.gpt(**cfg, seed=0)
        batch = 4
        idx = zoo.example_inputs(model, batch=batch, seed=0)
        targets = zoo.example_inputs(model, batch=batch, seed=1)
        return model, (idx, targets), None, {**cfg, "batch": batch}
    if name == "gpt-512":  # the trade-off benchmark's gradient-heavy GPT
        cfg = dict(n_layer=8, d_model=512, n_head=8, seq_len=256, dropout=0.1)
        model = zoo.gpt(**cfg, seed=0)
        batch = 2
        idx = zoo.example_inputs(model, batch=batch, seed=0)
        targets = zoo.example_inputs(model, batch=batch, seed=1)
        return model, (idx, targets), None, {**cfg, "batch": batch}
    if name == "unet3d":
        cfg = dict(base=8, depth=3)
        side, batch = 32, 2
        model = zoo.unet3d(**cfg, seed=0)
        x = zoo.example_inputs(model, batch=batch, size=side, seed=0)
        labels = torch.randint(0, 2, (batch, side, side, side),
                               generator=torch.Generator().manual_seed(1))
        return model, (x,), labels, {**cfg, "side": side, "batch": batch}
    raise ValueError(f"unknown model {name!r}; choose from {MODELS + ('gpt-512',)}")


def _loss(model: torch.nn.Module, inputs: tuple[Any, ...], labels: Any) -> torch.Tensor:
    out = model(*inputs)
    if labels is None:
        return out  # the zoo GPT returns its loss when given targets
    return torch.nn.functional.cross_entropy(out, labels)


def run_model(name: str, *, rounds: int, warmup: int) -> dict[str, Any]:
    """Time every method of ``METHODS`` on ``name``'s every-block plan."""
    import memfit
    from memfit.runtime.divergence import DivergenceCheck

    model, inputs, labels, cfg = build(name)
    model.train()
    prof = memfit.profile(model, inputs, loss_fn=(None if labels is None else
                                                   lambda out: torch.nn.functional.cross_entropy(out, labels)))
    plan = memfit.plan(prof, budget=1.0, solver="every_block")
    every = DivergenceCheck().every
    first = DivergenceCheck().first_calls
    if warmup < first + 1:
        raise ValueError(f"warmup {warmup} must exceed the sampled check's first {first} calls")
    if warmup + rounds >= every:
        raise ValueError(f"warmup + rounds ({warmup + rounds}) must stay below {every}, so "
                         "that the sampled method's timed steps are all unchecked")
    models = {}
    for method, check in METHODS:
        m = copy.deepcopy(model)
        memfit.apply(m, plan, check=check)
        models[method] = m

    ref = harness.seeded_step_grads(models["off"], lambda: _backward(models["off"], inputs, labels), seed=0)
    grads_equal = {}
    for method, m in models.items():
        got = harness.seeded_step_grads(m, lambda m=m: _backward(m, inputs, labels), seed=0)
        grads_equal[method] = harness.compare_grads(ref, got).grads_equal

    def before(method: str) -> None:
        for p in models[method].parameters():
            p.grad = None

    steps = {method: (lambda m=m: _backward(m, inputs, labels)) for method, m in models.items()}
    cpu: dict[str, list[float]] = {}
    times = harness.time_interleaved(steps, warmup=warmup, repeats=rounds, before=before, cpu_times=cpu)
    med = {k: harness.median(v) for k, v in times.items()}
    med_cpu = {k: harness.median(v) for k, v in cpu.items()}
    base, base_cpu = med["off"], med_cpu["off"]
    rows = [{"method": k, "median_s": v, "cpu_median_s": med_cpu[k], "ratio_to_off": v / base,
             "cpu_ratio_to_off": med_cpu[k] / base_cpu, "grads_equal_to_off": grads_equal[k],
             "times_s": times[k], "cpu_times_s": cpu[k]} for k, v in med.items()]
    # One checked (ops+values) step in every `every`, the others unchecked.
    amortized = ((every - 1) * med["sampled"] + med["ops+values"]) / every
    amortized_cpu = ((every - 1) * med_cpu["sampled"] + med_cpu["ops+values"]) / every
    rows.append({"method": f"sampled, amortized (1 checked step in {every})",
                 "median_s": amortized, "cpu_median_s": amortized_cpu,
                 "ratio_to_off": amortized / base, "cpu_ratio_to_off": amortized_cpu / base_cpu,
                 "grads_equal_to_off": grads_equal["sampled"], "times_s": [], "cpu_times_s": []})
    return {"model": name, "config": cfg, "regions": len(plan.regions),
            "every": every, "first_calls": first, "rounds": rounds, "warmup": warmup,
            "rows": rows}


def _backward(model: torch.nn.Module, inputs: tuple[Any, ...], labels: Any) -> torch.Tensor:
    loss = _loss(model, inputs, labels)
    loss.backward()
    return loss


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = ["# Cost of the divergence check (every-block plan)", "",
             f"torch {env['torch_version']}, {env['cpu_model']}, {env['threads']} threads, "
             f"commit {env['git_commit'][:10]}{' (dirty)' if env['git_dirty'] else ''}, "
             f"load {env['extra'].get('load_average_1m')}. Medians of interleaved rounds; "
             "ratios to `check=False`. CPU time is this process's (all threads): on a shared "
             "machine it moves far less than wall time, which other processes inflate.", ""]
    for r in results:
        lines += [f"## {r['model']} {r['config']} ({r['regions']} regions, {r['rounds']} rounds)", "",
                  "| method | CPU time | CPU ratio to off | wall time | wall ratio to off "
                  "| grads bitwise = off |",
                  "|---|---:|---:|---:|---:|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['method']} | {row['cpu_median_s'] * 1e3:.1f} ms | "
                         f"{row['cpu_ratio_to_off']:.3f} | {row['median_s'] * 1e3:.1f} ms | "
                         f"{row['ratio_to_off']:.3f} | {row['grads_equal_to_off']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.check_cost",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", nargs="+", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-reexec", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_reexec:
        harness.ensure_pinned_malloc("benchmarks.check_cost", argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = harness.collect_environment(args.threads).to_dict()
    results = []
    for name in args.model:
        log.info("check cost: %s", name)
        results.append(run_model(name, rounds=args.rounds, warmup=args.warmup))
    md = markdown(results, env)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_cost.json").write_text(json.dumps(
        {"kind": "memfit.benchmark.check_cost", "schema_version": SCHEMA_VERSION,
         "target": TARGET, "environment": env, "results": results}, indent=1) + "\n")
    (args.out / "check_cost.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
