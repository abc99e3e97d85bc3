"""Test configuration: JAX's defaults (x64 off), float64 scoped by a marker, hypothesis profiles.

Users run JAX with `jax_enable_x64=False`, so the suite does too. `jgraph.config.check_graphs` is
on: every traced graph and every transform's input gets the full `jg.check`. A test that needs
float64 (finite differences, exact references) is marked `@pytest.mark.f64`: it runs inside
`jax.enable_x64(True)`.
Hypothesis profiles: `ci` (small, the default) and `thorough` (`HYPOTHESIS_PROFILE=thorough`).
"""

import atexit
import os
import shutil
import signal
import tempfile

# XLA's executables cached on disk for this run of the suite (JAX's persistent compilation cache,
# every program however short its compile): the suite compiles the same programs again and again
# (each model's step under several transforms and tests; a child process the same steps as its
# parent). The folder is made by the first process (pytest, or its controller with `-n`): its
# workers and children inherit it by the environment, and it is removed when that process ends,
# so no run reads another's. Set JAX_COMPILATION_CACHE_DIR to choose one yourself.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jgraph-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import jgraph  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

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
    if "tpu" in (config.option.markexpr or ""):  # TPU programs compiled ahead of time for a
        jax.config.update("jax_enable_compilation_cache", False)  # topology: none to load


@pytest.fixture(autouse=True)
def _plans_planned_afresh():
    """Each test plans its budgets itself: the plans an earlier test made are forgotten
    (`jgraph.planner.cache`; `tests/test_plan_cache.py` tests the cache)."""
    from jgraph.planner import cache

    cache.clear()
    yield


@pytest.fixture(autouse=True)
def _x64_scope(request):
    """x64 off (JAX's default) unless the test is marked `f64`; restored after every test."""
    with jax.enable_x64(request.node.get_closest_marker("f64") is not None):
        yield


@pytest.fixture
def count_compiles(monkeypatch):
    """`count_compiles()`: from then on, a list holding one entry per compile jgraph makes
    (`jgraph.memory.compiled`), its figure cache emptied so none is served from it."""
    def start() -> list:
        from jgraph.memory import compiled

        measured, made = compiled._measured, []
        monkeypatch.setattr(compiled, "_measured", lambda *a: made.append(a) or measured(*a))
        monkeypatch.setattr(compiled, "_CACHE", {})
        return made

    return start


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
LONGEST_FIRST = ("test_remat_step.py", "test_planner.py",
                 "test_planner_step.py", "test_properties.py", "test_properties_training.py",
                 "test_planner_hand.py", "test_fusion_cuts.py", "test_interrupts.py",
                 "test_fused_interrupts.py", "test_real_models.py", "test_sweep_issue19.py",
                 "test_properties_programs.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
