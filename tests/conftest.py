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
