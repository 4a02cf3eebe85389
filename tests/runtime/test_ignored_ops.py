"""The planner's op keys skip exactly the ops the runtime's policy never sees."""

import torch

from memfit.planning.rules import unkeyed_ops
from memfit.runtime.divergence import IGNORED_OPS


def test_planner_and_runtime_ignore_the_same_ops():
    assert {str(op) for op in IGNORED_OPS} == set(unkeyed_ops())


def test_torch_ignores_what_we_ignore():
    # torch's selective checkpoint never consults a policy about these (torch 2.13 names them)
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    assert ignored is not None
    assert {str(op) for op in ignored} <= set(unkeyed_ops())
