"""Test configuration: JAX's defaults (x64 off), float64 scoped by a marker, hypothesis profiles.

Users run JAX with `jax_enable_x64=False`, so the suite does too. `jgraph.config.check_graphs` is
on: every traced graph and every transform's input gets the full `jg.check`. A test that needs
float64 (finite differences, exact references) is marked `@pytest.mark.f64`: it runs inside
`jax.enable_x64(True)`.
Hypothesis profiles: `ci` (small, the default) and `thorough` (`HYPOTHESIS_PROFILE=thorough`).
"""

import os
import signal

import jax
import pytest
from hypothesis import HealthCheck, settings

import jgraph

# Every graph the suite traces, and every graph a transform is given, gets the full `jg.check`.
jgraph.config.check_graphs = True

settings.register_profile(
    "ci", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(  # the old name of `thorough`'s smaller sibling
    "full", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "f64: run the test with jax_enable_x64 on (scoped)")


@pytest.fixture(autouse=True)
def _x64_scope(request):
    """x64 off (JAX's default) unless the test is marked `f64`; restored after every test."""
    with jax.enable_x64(request.node.get_closest_marker("f64") is not None):
        yield


@pytest.fixture
def sigint_handler():
    """Python's default SIGINT handler in this process for the test, however pytest was started
    (under `nohup` or in a background job SIGINT starts ignored, and a test that sends itself
    Ctrl-C must not depend on that)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


# The files that take longest (minutes each on a loaded 2-core machine) start first: with
# `-n 2 --dist loadfile` each worker takes the next file when it is done, so the short files then
# fill in at the end and the two workers end together, not one running a long file alone.
LONGEST_FIRST = ("test_sharding.py", "test_remat_step.py", "test_planner.py",
                 "test_planner_step.py", "test_properties.py", "test_properties_training.py",
                 "test_planner_hand.py", "test_fusion_cuts.py", "test_interrupts.py",
                 "test_fused_interrupts.py", "test_real_models.py", "test_sweep_issue19.py",
                 "test_properties_programs.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
