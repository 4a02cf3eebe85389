"""Start a per-rank script of this folder on gloo ranks and read what every rank wrote.

``python -m torch.distributed.run --nproc_per_node N --standalone`` (``--standalone``: a free
port per launch, so pytest-xdist may run several at once); each rank writes
``rank<r>.json`` into ``MEMFIT_DIST_OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TIMEOUT_S = 300  # a launch takes 10-40 s here (imports, 2 ranks on 2 shared cores)


def launch(script: str, *args: str, tmp_path: Path, ranks: int = 2) -> list[dict[str, Any]]:
    """Run ``script`` with ``args`` on ``ranks`` ranks; every rank's JSON result, in rank order."""
    env = {**os.environ, "MEMFIT_DIST_OUT": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--standalone", str(HERE / script), *args]
    try:
        done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} {' '.join(args)} hung for {TIMEOUT_S} s:\n{(e.stderr or '')[-4000:]}")
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stderr[-6000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
