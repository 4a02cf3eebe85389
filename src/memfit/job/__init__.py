"""The job around the step: the device it must fit (``Job``), the largest batch that fits
(``largest_batch``), the plans for other input shapes, and the argument combinations ``fit``
refuses. Above the three stages and measuring; ``memfit.api`` composes it."""
