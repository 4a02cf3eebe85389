import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

# test_fit.py: the fits its tests share (``_fit``), by model and budget
SHARED_FITS = {
    "test_planned_step_gradients_match_plain": None,       # its budget
    "test_planned_step_peaks_as_planned_on_xla_cpu": None,  # its budget
    "test_an_infeasible_budget_names_the_smallest_peak": "min",
    "test_rounds_spend_the_budget_xla_leaves_and_never_pass_it": 0.7,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests here are ``xla`` too: each fit compiles and runs some twenty plans (about
    16 of the slow tier's 26 minutes of test time), so they are a CI step of their own
    (``./run test-xla``) and ``./run test`` stays under 10 minutes. Tests sharing a fit run on
    one xdist worker (``--dist loadgroup``); a policy whose plan is another's on a model is not
    run twice (the conv net runs no dot: dots_with_no_batch_dims_saveable is nothing_saveable
    there)."""
    kept, dropped = [], []
    for item in items:
        if item.nodeid.startswith("tests/jax_frontend/") and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xla)
        spec = getattr(item, "callspec", None)
        name = getattr(item, "originalname", item.name)
        if spec is None or not item.nodeid.startswith("tests/jax_frontend/test_fit.py"):
            kept.append(item)
            continue
        model = spec.params.get("model")
        if model == "conv3d" and spec.params.get("policy") == "dots_with_no_batch_dims_saveable":
            dropped.append(item)
            continue
        if name in SHARED_FITS:
            budget = SHARED_FITS[name] or spec.params.get("budget")
            item.add_marker(pytest.mark.xdist_group(f"jax-fit-{model}-{budget}"))
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
