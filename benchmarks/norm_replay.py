"""Batch norms in a replay: scratch statistics against the update skipper, beside torch's own
checkpoint, on the benchmark 3D UNet with its 7 blocks checkpointed (CPU).

Three steps, interleaved round by round (NOTE [interleaving] in ``benchmarks.harness``), from
one copy of the case's model each: torch's ``checkpoint(use_reentrant=False)`` on every block
(the peer; it updates each norm's statistics twice a step), memfit's plan of the same 7
regions as it runs now (NOTE [scratch statistics] in ``memfit.runtime.norm_statistics``), and
the same plan with the scratch let go, so that its replays run rule 2's update skipper as
before 2026-12-07. Gradients and buffers of the two memfit steps are compared bitwise after
the warm-up. Writes benchmarks/results/norm-replay.md.

    PYTHONPATH=src python -m benchmarks.norm_replay [--rounds 25] [--runs 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ensure_pinned_malloc
from benchmarks.models import build_case
from benchmarks.peers import every_block

OUT = Path(__file__).parent / "results" / "norm-replay.md"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    ensure_pinned_malloc("benchmarks.norm_replay", sys.argv[1:])
    from memfit.measuring import calibration
    from memfit.planning.plan import Plan, Region
    from memfit.planning.simulate import simulate
    from memfit.runtime import apply as runtime_apply
    from memfit.runtime import norm_statistics

    torch.set_num_threads(2)
    case = build_case("unet3d")
    prof = calibration.profile(copy.deepcopy(case.model).train(), case.inputs, loss_fn=case.loss_fn)
    regions = tuple(Region((b,)) for b in case.blocks)
    sim = simulate(prof, Plan(regions, 0, 0.0, None, "every_block", prof.signature))
    plan = Plan(regions, sim.peak_bytes, sim.recompute_s, None, "every_block", prof.signature)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# Batch norms in a replay (CPU, torch {torch.__version__}, UNet3D, 7 blocks checkpointed, "
             f"{args.rounds} interleaved rounds, commit {commit})", "",
             "| run | torch every block s | memfit, scratch statistics | memfit, update skipper | bitwise |",
             "| --- | ---: | ---: | ---: | --- |"]
    for run in range(args.runs):
        scratch = copy.deepcopy(case.model).train()
        runtime_apply.apply_plan(scratch, plan)
        skipper = copy.deepcopy(case.model).train()
        runtime_apply.apply_plan(skipper, plan)
        for m in skipper.modules():
            norm_statistics._SCRATCH.pop(m, None)
        peer = every_block(case)

        def memfit_step(model: torch.nn.Module) -> Callable[[], list[torch.Tensor]]:
            def step() -> list[torch.Tensor]:
                case.loss_fn(model(*case.inputs)).backward()
                grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
                for p in model.parameters():
                    p.grad = None
                return grads
            return step

        def peer_step(peer: Any = peer) -> list[torch.Tensor]:
            peer.step()
            peer.clear_grads()
            return []

        steps = {"peer": peer_step, "scratch": memfit_step(scratch), "skipper": memfit_step(skipper)}
        for _ in range(3):
            got = {k: f() for k, f in steps.items()}
        exact = (all(torch.equal(a, b) for a, b in zip(got["scratch"], got["skipper"], strict=True))
                 and all(torch.equal(a, b) for a, b in zip(scratch.buffers(), skipper.buffers(), strict=True)))
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds):
            for k, f in steps.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        lines.append(f"| {run + 1} | {med['peer']:.4f} | {med['scratch'] / med['peer']:.3f}x | "
                     f"{med['skipper'] / med['peer']:.3f}x | {exact} |")
        print(lines[-1], flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
