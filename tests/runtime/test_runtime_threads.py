"""Two threads running one planned model at once (NOTE [segments and threads] in
``memfit.runtime.segment``).

Each thread runs its own forward and backward on its own inputs, on the same model object;
gradients come from ``torch.autograd.grad`` (nothing accumulates into a shared ``.grad``) and
must equal, bitwise, those of the same input on an unplanned twin run alone. Dropout is off:
threads share torch's global generator, so random ops would make results depend on the
interleaving with or without memfit. The threads run in a subprocess, so that an abort in torch
(a corrupted saved-tensor hooks stack) fails the test instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import copy, sys, threading
    import torch
    from runtime_helpers import TinyGPT
    from memfit.planning.plan import Plan, Region
    from memfit.runtime.apply import apply_plan

    REGIONS = {
        "segment": (Region(("blocks.0", "blocks.1", "blocks.2")),),
        "segment_selective": (Region.saving(("blocks.0", "blocks.1"), ("aten.bmm.default#1",)),
                              Region(("blocks.2",))),
        "blocks": tuple(Region((f"blocks.{i}",)) for i in range(3)),
    }
    N_THREADS, N_STEPS = 2, 4
    sys.setswitchinterval(1e-5)  # switch threads often: interleave the two steps op by op
    torch.manual_seed(0)
    model = TinyGPT(p=0.0).train()
    twin = copy.deepcopy(model)
    apply_plan(model, Plan(regions=REGIONS[sys.argv[1]], predicted_peak_bytes=0, recompute_s=0.0,
                      budget_bytes=None, solver="test", profile_signature=""))

    def grads(m, ids):
        loss = m(ids).square().mean()
        return torch.autograd.grad(loss, list(m.parameters()))

    inputs = [[torch.randint(0, 64, (4, 16)) for _ in range(N_STEPS)] for _ in range(N_THREADS)]
    expected = [[grads(twin, x) for x in xs] for xs in inputs]  # plain, one at a time
    barrier = threading.Barrier(N_THREADS)
    problems = []

    def work(k):
        try:
            barrier.wait()
            for s, x in enumerate(inputs[k]):
                got = grads(model, x)
                if not all(torch.equal(a, b) for a, b in zip(got, expected[k][s], strict=True)):
                    problems.append(f"thread {k} step {s}: gradients differ from the plain twin")
        except BaseException as e:
            problems.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\\n".join(problems) or "ok")
''')


@pytest.mark.processes
@pytest.mark.parametrize("plan", ["segment", "segment_selective", "blocks"])
def test_two_threads_bitwise_equal_to_plain(plan):
    _assert_script_ok(SCRIPT, plan)


def _assert_script_ok(script: str, *args: str) -> None:
    """Run ``script`` in a fresh Python: it must exit 0 and print ``ok``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stdout}\n{run.stderr[-2000:]}"
    assert run.stdout.strip() == "ok", run.stdout + run.stderr[-2000:]


NORM_SCRIPT = textwrap.dedent('''
    import sys, threading
    import torch
    from torch import nn
    from memfit.planning.plan import Plan, Region
    from memfit.runtime.apply import apply_plan

    N_THREADS, N_STEPS = 2, 8
    sys.setswitchinterval(1e-5)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()) for _ in range(3)]
    model = nn.Sequential(*blocks).train()
    apply_plan(model, Plan(regions=tuple(Region((str(i),)) for i in range(3)),
                           predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                           solver="test", profile_signature=""), check=False)
    barrier = threading.Barrier(N_THREADS)
    problems = []

    def work(k):
        try:
            barrier.wait()
            for s in range(N_STEPS):
                x = torch.randn(8, 16)
                torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
        except BaseException as e:
            problems.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [int(b[1].num_batches_tracked) for b in model]
    if counts != [N_THREADS * N_STEPS] * 3:
        problems.append(f"statistics updated {counts} times, not {N_THREADS * N_STEPS} each")
    if any("forward" in b[1].__dict__ for b in model):
        problems.append("a norm's forward is still replaced")
    print("\\n".join(problems) or "ok")
''')


@pytest.mark.processes
def test_two_threads_replaying_batch_norms_update_every_statistic():
    """NOTE [a norm's forward in a replay]: one thread's replay skips the statistics' updates
    inside the norms, another thread's forward of the same norms makes them."""
    _assert_script_ok(NORM_SCRIPT)
