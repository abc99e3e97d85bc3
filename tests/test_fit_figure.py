"""The fit figure's machinery on this host: the search for the smallest HBM size at which a step
compiles (`jgraph.memory.hbm`), against a brute-force scan, on stand-in compilers that answer as
TPU's does; what its failures say; and the figure cache (`jgraph.memory.compiled`), in the
process and on disk. The TPU's own compiler is exercised in `tests/test_tpu.py`."""

import dataclasses
import json
import os
import types

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jgraph as jg
from jgraph import config
from jgraph.memory import compiled as compiled_module
from jgraph.memory import hbm

MIB = 2**20
REPORT = ("Memory Space: default (color=0)\nTotal bytes: {} ({:.2f}MiB)\n"
          "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n")


class StandIn:
    """A `Lowered` whose compile answers as TPU's compiler does, for a need that depends on the
    HBM size N (MiB): buffers `buffers(N)` and code `code(N)` bytes; it fails after buffer
    assignment when the buffers alone exceed N, after code generation when both do."""

    def __init__(self, buffers, code, chip_mib=16128):
        self.buffers, self.code, self.chip_mib = buffers, code, chip_mib
        self.sizes = []

    def compile(self, compiler_options):
        n = compiler_options.get("xla_tpu_max_hbm_size_mib", self.chip_mib)
        self.sizes.append(n)
        buffers, code = self.buffers(n), self.code(n)
        if buffers > n * MIB:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                               f"required for HLO temporaries ({buffers / MIB:.2f}M) exceeds "
                               f"available HBM ({n:.2f}M)")
        if buffers + code > n * MIB:
            raise RuntimeError(f"E1000: CompileTimeHbmOom: Used {(buffers + code) / MIB:.2f}M "
                               f"of {n:.2f}M hbm. Exceeded hbm capacity by ...")
        name = "module_0001.jit_step.after_optimizations-memory-usage-report.txt"
        with open(os.path.join(compiler_options["xla_dump_to"], name), "w") as f:
            f.write(REPORT.format(buffers, buffers / MIB))
        stats = types.SimpleNamespace(generated_code_size_in_bytes=code)
        return types.SimpleNamespace(memory_analysis=lambda: stats)


def brute_force(lowered: StandIn) -> int:
    return next(n for n in range(1, 100_000)
                if lowered.buffers(n) + lowered.code(n) <= n * MIB)


@st.composite
def compilers(draw):
    """Needs that do not grow when HBM shrinks: a schedule tighter under pressure, code that
    shrinks to a floor (as TPU's does)."""
    base = draw(st.integers(1, 3000)) * MIB + draw(st.integers(0, MIB - 1))
    saved = min(draw(st.integers(0, 400)) * MIB, base // 2)  # what pressure takes off at most
    relief = draw(st.integers(1, 4000))  # MiB over which it takes it off
    code_floor, code_top = draw(st.integers(0, 20)) * MIB, draw(st.integers(0, 20)) * MIB

    def buffers(n):
        return base - saved + saved * min(n, relief) // relief

    def code(n):
        return code_floor + code_top * min(n, 2000) // 2000

    return StandIn(buffers, code)


@settings(max_examples=60, deadline=None)
@given(compilers())
def test_the_smallest_size_is_found_as_a_scan_finds_it(lowered):
    size, first = hbm.smallest_size(lowered, {})
    assert size == brute_force(lowered)
    assert first.fits and first.size_mib is None
    assert len(lowered.sizes) <= 2 + 2 * 14  # jumps, then halving: never a scan


def test_a_constant_need_takes_three_compiles():
    lowered = StandIn(lambda n: 89 * MIB + 12345, lambda n: 9 * MIB if n < 200 else 16 * MIB)
    assert hbm.smallest_size(lowered, {})[0] == 99 == brute_force(lowered)
    assert len(lowered.sizes) == 4  # the chip's size, at its use, at the need, a MiB under


def test_one_compile_at_a_size_says_which_side_it_lies_on():
    lowered = StandIn(lambda n: 50 * MIB, lambda n: 5 * MIB)
    assert hbm.at_size(lowered, {}, 60).fits
    over_code = hbm.at_size(lowered, {}, 54)  # fails after code generation
    assert not over_code.fits and 55 * MIB <= over_code.hbm_used <= 55.01 * MIB
    assert over_code.code_counted
    over_buffers = hbm.at_size(lowered, {}, 40)  # fails after buffer assignment: no code yet
    assert not over_buffers.fits and 50 * MIB <= over_buffers.hbm_used <= 50.01 * MIB
    assert not over_buffers.code_counted


def test_a_failure_before_code_exists_is_given_the_models_code():
    """A compile failing at buffer assignment names its buffers alone; the model's fit figure
    of it adds the code the unplanned step showed (and nothing to a figure that counts it)."""
    from jgraph.memory.compiled import CompiledMemory
    from jgraph.memory.model import Calibration
    from jgraph.target import resolve

    fitted = Calibration(resolve("cpu"), figure=70 * MIB, modelled=64 * MIB)  # code: 6 MiB
    failed = dict(temp_bytes=0, argument_bytes=0, output_bytes=0, alias_bytes=0, dots=0,
                  figure="hbm_bytes", hbm_mode="at 40 MiB", fits=False, hbm_bytes=50 * MIB)
    assert fitted.fit_of(CompiledMemory(**failed, code_counted=False)) == 56 * MIB
    assert fitted.fit_of(CompiledMemory(**failed)) == 50 * MIB


def test_another_failure_is_raised_as_it_is():
    class Broken:
        def compile(self, compiler_options):
            raise RuntimeError("INTERNAL: something else")

    with pytest.raises(RuntimeError, match="something else"):
        hbm.at_size(Broken(), {}, 10)


def test_a_step_over_the_chip_is_a_clear_error():
    over = StandIn(lambda n: 20_000 * MIB, lambda n: 0)
    for find in (hbm.smallest_size, hbm.at_chip):
        with pytest.raises(jg.JGraphError, match="does not fit the chip's HBM: it needs 20000"):
            find(over, {})


# -- the figure cache ------------------------------------------------------------------------------
def _graph():
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    ws = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 3
    return jg.backward(jg.trace(loss, ws, jax.ShapeDtypeStruct((32, 64), jnp.float32),
                                param_argnums=0))


def test_figures_are_kept_in_the_process_and_on_disk(tmp_path, monkeypatch):
    gb = _graph()
    monkeypatch.setattr(config, "figure_cache_dir", str(tmp_path))
    monkeypatch.setattr(compiled_module, "_CACHE", {})
    first = jg.compiled_memory(gb)
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(compiled_module, "_CACHE", {})  # a new process: read back from disk

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(compiled_module, "_measured", no_compile)
    again = jg.compiled_memory(gb)
    assert again == first and dataclasses.asdict(again) == dataclasses.asdict(first)
    assert first.exact and first.budget_bytes == first.temp_bytes


def test_a_damaged_cache_file_is_measured_again(tmp_path, monkeypatch):
    gb = _graph()
    monkeypatch.setattr(config, "figure_cache_dir", str(tmp_path))
    monkeypatch.setattr(compiled_module, "_CACHE", {})
    first = jg.compiled_memory(gb)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    monkeypatch.setattr(compiled_module, "_CACHE", {})
    assert jg.compiled_memory(gb) == first
    assert compiled_module.CompiledMemory.from_json(json.loads(path.read_text())) == first
