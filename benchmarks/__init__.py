"""memfit's benchmarks: memfit against every alternative, on the same model, in one run.

Entry points (run from the repository root):

- ``python -m benchmarks.tradeoff --model gpt|gpt-act|unet3d|resnet|llama|all [--quick]``:
  memory vs step time for no checkpointing, torch's checkpointing tools, ``torch.compile``'s
  activation memory budget and memfit's plans; JSON, markdown tables and a PNG per model.
- ``python -m benchmarks.accuracy``: memfit's predicted peak vs the measured one.

Benchmarks are not tests; ``tests/benchmarks/`` checks only the harness logic.
"""
