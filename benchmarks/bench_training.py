"""Training benchmarks: jgraph's Optimizer against hand-written JAX/optax steps.

Model: an MLP `tanh(h @ W + b)` x 4 (width 512) and a linear head, cross-entropy over 10 classes,
adam, micro-batch 128, f32. Rows:
- step time of `Optimizer.step` (period 1, and period 4: micro-steps + the optimizer step)
  vs a hand-written `jax.jit` step (value_and_grad + accumulate + optax update, donated);
- `Optimizer.step_period` (period 16) vs `optax.MultiSteps` inside `lax.scan` (donated);
- donated temp of `step_period` at period 16 vs period 1 (params, accumulators and optimizer
  state donated at every period), and vs MultiSteps in scan;
- compilations for 100 static steps (want 3, or 2 with period 1).

    python -m benchmarks.bench_training [--quick]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jgraph as jg
from benchmarks import interleaved_medians

WIDTH, DEPTH, CLASSES, MICRO, NIN = 512, 4, 10, 128, 256
TX = optax.adam(1e-3)
KIB = 1024


def model(p, x):
    for w, b in p["layers"]:
        x = jnp.tanh(x @ w + b)
    return x @ p["head"]


def init_params():
    keys = jax.random.split(jax.random.PRNGKey(0), DEPTH + 1)
    dims = [NIN] + [WIDTH] * DEPTH
    layers = [(jax.random.normal(k, (a, WIDTH), jnp.float32) * jnp.float32(a**-0.5),
               jnp.zeros(WIDTH, jnp.float32)) for k, a in zip(keys, dims, strict=False)]
    return {"layers": layers,
            "head": jax.random.normal(keys[-1], (WIDTH, CLASSES), jnp.float32) * jnp.float32(
                WIDTH**-0.5)}


def loss_fn(p, x, y):
    logits = model(p, x)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(y, CLASSES, dtype=logits.dtype)
                             * jax.nn.log_softmax(logits), axis=-1))


def data(n):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, MICRO, NIN)).astype(np.float32),
            rng.integers(0, CLASSES, size=(n, MICRO)).astype(np.int32))


def copy(tree):
    return jax.tree.map(lambda a: jnp.array(np.asarray(a)), tree)


class HandWritten:
    """The reference: value_and_grad + accumulate + optax update, jitted and donated."""

    def __init__(self, period):
        self.period, self.i = period, 0
        scale = 1.0 / period

        def micro(params, acc, x, y):
            loss, g = jax.value_and_grad(loss_fn)(params, x, y)
            return loss, jax.tree.map(lambda a, g: a + g * scale, acc, g)

        def last(params, acc, opt_state, x, y):
            loss, acc = micro(params, acc, x, y)
            updates, opt_state = TX.update(acc, opt_state, params)
            zero = jax.tree.map(jnp.zeros_like, acc)
            return loss, optax.apply_updates(params, updates), zero, opt_state

        self.micro = jax.jit(micro, donate_argnums=1)
        self.last = jax.jit(last, donate_argnums=(0, 1, 2))
        self.params = copy(init_params())
        self.acc = jax.tree.map(jnp.zeros_like, self.params)
        self.opt_state = TX.init(self.params)

    def step(self, x, y):
        self.i = (self.i + 1) % self.period
        if self.i:
            loss, self.acc = self.micro(self.params, self.acc, x, y)
        else:
            loss, self.params, self.acc, self.opt_state = self.last(
                self.params, self.acc, self.opt_state, x, y)
        return loss


def step_time_rows(quick):
    xs, ys = data(8)
    rows = []
    for period in (1, 4):
        opt = jg.Optimizer(model, TX, loss="cross_entropy", period=period)
        box = {"state": opt.init(copy(init_params()), xs[0], ys[0])}
        ref = HandWritten(period)
        n = 4 * period

        def run_jg():
            for i in range(n):
                box["state"], out = opt.step(box["state"], xs[i % 8], ys[i % 8])
            return out.loss

        def run_ref():
            for i in range(n):
                loss = ref.step(xs[i % 8], ys[i % 8])
            return loss

        t = interleaved_medians({"jg": run_jg, "ref": run_ref}, repeats=5 if quick else 25)
        rows.append({"benchmark": f"training step, period {period} (ms/step)",
                     "jgraph": 1e3 * t["jg"] / n, "reference": 1e3 * t["ref"] / n,
                     "ratio": t["jg"] / t["ref"], "note": "vs hand-written jax.jit step"})
    return rows


def multisteps_scan(period):
    ms = optax.MultiSteps(TX, every_k_schedule=period)

    def run(params, opt_state, xs, ys):
        def body(carry, batch):
            params, opt_state = carry
            loss, g = jax.value_and_grad(loss_fn)(params, *batch)
            updates, opt_state = ms.update(g, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = lax.scan(body, (params, opt_state), (xs, ys))
        return params, opt_state, losses

    params = copy(init_params())
    return jax.jit(run, donate_argnums=(0, 1)), params, ms.init(params)


def step_period_rows(quick):
    rows, temps = [], {}
    for period in (1, 16):
        xs, ys = data(period)
        opt = jg.Optimizer(model, TX, loss="cross_entropy", period=period)
        state = opt.init(copy(init_params()), xs[0], ys[0])
        state, _ = opt.step_period(state, xs, ys)
        fn = opt.executables["period"]
        stats = fn.lower(state.params, state.grad_acc, state.opt_state, xs, ys).compile() \
            .memory_analysis()
        temps[period] = stats.temp_size_in_bytes
        temps[-period] = _footprint(stats)
        if period == 1:  # also without the param copies XLA's CPU copy insertion adds here
            exact = jax.jit(fn.__wrapped__, donate_argnums=(0, 1, 2), compiler_options={
                "xla_cpu_copy_insertion_use_region_analysis": True})
            temps["exact"] = exact.lower(state.params, state.grad_acc, state.opt_state, xs,
                                         ys).compile().memory_analysis().temp_size_in_bytes
            continue
        ref, params, ms_state = multisteps_scan(period)
        ref_temp = ref.lower(params, ms_state, xs, ys).compile().memory_analysis()
        box = {"state": state, "ref": (params, ms_state)}

        def run_jg():
            box["state"], out = opt.step_period(box["state"], xs, ys)
            return out.loss

        def run_ref():
            p, s, losses = ref(*box["ref"], xs, ys)
            box["ref"] = (p, s)
            return losses

        t = interleaved_medians({"jg": run_jg, "ref": run_ref}, repeats=3 if quick else 11)
        rows.append({"benchmark": f"step_period, period {period} (ms/period)",
                     "jgraph": 1e3 * t["jg"], "reference": 1e3 * t["ref"],
                     "ratio": t["jg"] / t["ref"], "note": "vs optax.MultiSteps in lax.scan"})
        rows.append({"benchmark": f"step_period temp, period {period} (KiB)",
                     "jgraph": temps[period] / KIB, "reference": ref_temp.temp_size_in_bytes / KIB,
                     "ratio": temps[period] / ref_temp.temp_size_in_bytes,
                     "note": "vs optax.MultiSteps in lax.scan, donated"})
        rows.append({"benchmark": f"step_period temp+fresh outputs, period {period} (KiB)",
                     "jgraph": temps[-period] / KIB, "reference": _footprint(ref_temp) / KIB,
                     "ratio": temps[-period] / _footprint(ref_temp),
                     "note": "vs optax.MultiSteps in lax.scan, donated"})
    rows.append({"benchmark": "step_period temp, period 16 vs 1 (KiB)",
                 "jgraph": temps[16] / KIB, "reference": temps[1] / KIB,
                 "ratio": temps[16] / temps[1], "note": "jgraph at period 1 is the reference"})
    rows.append({"benchmark": "step_period temp+fresh outputs, period 16 vs 1 (KiB)",
                 "jgraph": temps[-16] / KIB, "reference": temps[-1] / KIB,
                 "ratio": temps[-16] / temps[-1],
                 "note": "params, accumulators, optimizer state donated"})
    rows.append({"benchmark": "step_period temp, period 16 vs 1 without XLA's copies (KiB)",
                 "jgraph": temps[16] / KIB, "reference": temps["exact"] / KIB,
                 "ratio": temps[16] / temps["exact"],
                 "note": "period 1 compiled with xla_cpu_copy_insertion_use_region_analysis"})
    return rows


def _footprint(stats):
    """Bytes a call adds to its arguments: temp plus outputs not aliased to donated inputs."""
    return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes


def compile_rows():
    rows = []
    xs, ys = data(8)
    for period, want in ((4, 3), (1, 2)):
        # A fresh transformation object: no executables shared with the rows above.
        compiles = []

        def listener(name, *args, **kwargs):
            if name == "/jax/core/compile/backend_compile_duration":
                compiles.append(name)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            opt = jg.Optimizer(model, optax.adam(1e-3), loss="cross_entropy", period=period)
            state = opt.init(copy(init_params()), xs[0], ys[0])
            for i in range(100):
                state, _ = opt.step(state, xs[i % 8], ys[i % 8])
            jax.block_until_ready(state.params)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        n = len(compiles)
        rows.append({"benchmark": f"executables for 100 static steps, period {period}",
                     "jgraph": n, "reference": want, "ratio": n / want,
                     "note": "XLA compilations seen by a jax.monitoring listener (reset, grad, "
                             "opt)"})
    return rows


def rows(quick: bool = False) -> list[dict]:
    return step_time_rows(quick) + step_period_rows(quick) + compile_rows()


if __name__ == "__main__":
    from benchmarks.run import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
