"""Unit-test collection: the measured-slow tests get the `slow` marker, so that the fast
command (README, "Development": `pytest tests/unit -m "not slow"`) stays under a minute while
`make test` still runs everything. Marked here, in one list with the measurement, rather than
in each file. A name that no longer exists fails the run (tests/unit/test_test_layout.py).

Measured with `pytest tests/unit -v` piped through a timestamper (2 shared cores under load,
load average 8-20): seconds per test or per file, setup included.

Also the one fixture several files share: `restore_logging`, for tests that reconfigure the
process's logging (root handlers, level, structlog) and must leave it as they found it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

# file -> None (every test in it) or the test functions (all their parameters)
SLOW: dict[str, tuple[str, ...] | None] = {
    "test_model_vs_transformers.py": None,  # 307 s: transformers vs ours, 4 families x dtypes
    "test_engine_greedy.py": None,  # 106 s: greedy vs transformers, 8 checkpoints
    "test_engine_batching.py": (
        "test_batched_equals_solo",  # 41 s
        "test_batched_equals_solo_under_preemption",  # 36 s
    ),
    "test_model_loader.py": ("test_make_tiny_is_byte_deterministic",),  # 27 s
    "test_cli_generate.py": ("test_json_with_prompt_ids_matches_engine",),  # 26 s
    "test_engine_resume.py": None,  # 18 s
    "test_bench_cache_plots.py": ("test_plots_are_png", "test_capacity_curve_cli"),  # 13 s
    "test_model_cpu_linear.py": None,  # 11 s
    "test_engine_bench.py": None,  # 13 s
    "test_engine_disagg.py": ("test_prefill_then_decode_equals_single_engine_greedy",),  # 7 s
    "test_plan_search.py": (  # two small plans and the sequential reference: 79 s at load 9
        "test_plan_is_the_same_with_more_processes_and_as_the_sequential_search",
    ),
    "test_slo_map.py": ("test_map_of_real_runs_equals_plan_under_each_cells_slos",),  # 17 s
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = SLOW.get(item.path.name, ())
        if names is None or getattr(item, "originalname", item.name) in (names or ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    config = structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)
