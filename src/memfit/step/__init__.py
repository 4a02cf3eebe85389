"""The step harness, below profiling: what one training step is (``Step``: a model and its
example inputs, or a callable; the loss; autocast), running it with the model left as found
(``ModelState``), and the inputs' edge (``inputs``: normalizing, signatures, the default loss)."""

from __future__ import annotations

from memfit.step.harness import Autocast, ModelState, Step, model_device

__all__ = ["Autocast", "ModelState", "Step", "model_device"]
