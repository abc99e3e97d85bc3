"""Fused updates (issue 28, item 1): `jg.fuse_updates` against the unfused step and JAX's.

Model: a 64-layer `lax.scan` MLP `tanh(h @ W[i])` (width 256, batch 128, f32; params 16 MiB),
trained by adam (and adamw; `clip_by_global_norm` + adam, which needs every gradient first and
stays unfused). Per optimizer, the donated step's `temp_size_in_bytes` (params and optimizer state
donated; the step returns the loss, new params and state, no gradients) of:
- the unfused step (`jg.optimizer_step(jg.backward(g), tx)` without its grad outputs),
- the fused step (`jg.fuse_updates(go, keep_grads=False)`): the update runs inside the backward
  scan, slice by slice, and the stacked gradient (16 MiB) is never made,
- JAX's own step (`jax.value_and_grad` + `tx.update` + `optax.apply_updates`, jitted, donated),
and the fused step's time against the unfused one (interleaved, median); for adam also the step
as `jg.optimizer_step` returns it, with the gradients among its outputs (`keep_grads=True`).

`--budgets` (issue 28's first bar, minutes): the whole adam step under a budget, as
`jg.remat(without_grads(go), budget=...)` and as `jg.Optimizer(remat={"budget": ...})` (period
1), each against the same step's no-remat temp, for this MLP (25 %, 50 %) and the 4-layer
transformer LM of `bench_planner` (d 128, seq 128, batch 8, vocab 512; 25 %).

    python -m benchmarks.bench_fuse [--quick] [--budgets]
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import optax

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_planner import transformer, transformer_args
from jgraph.fuse import without_grads
from jgraph.memory import donated_step
from jgraph.planner.search import xla_temp

MIB = 2**20


def mlp_args(layers=64, width=256, batch=128):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    ws = jax.random.normal(k1, (layers, width, width), jnp.float32) * width**-0.5
    return ws, jax.random.normal(k2, (batch, width), jnp.float32)


def scanned_mlp(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(h * h)


def jax_temp(fn, tx, ws, x) -> int:
    """JAX's donated adam step: value_and_grad, then optax's update."""
    def step(state, x):
        params, opt_state = state
        loss, grads = jax.value_and_grad(fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    compiled = jax.jit(step, donate_argnums=0).lower((ws, tx.init(ws)), x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def compare(name, tx, args, time_steps=True, repeats=7) -> list[dict]:
    ws, x = args
    go = without_grads(jg.optimizer_step(jg.backward(jg.trace(scanned_mlp, ws, x,
                                                               param_argnums=0)), tx))
    gu = jg.fuse_updates(go)
    state = tx.init(ws)
    unfused = jg.compiled_memory(go, ws, x, state).temp_bytes
    fused = jg.compiled_memory(gu, ws, x, state).temp_bytes
    reference = jax_temp(scanned_mlp, tx, ws, x)
    where = sorted({r["where"] for r in gu.info["fuse_updates"].values()})
    rows = [
        {"benchmark": f"fuse {name}: donated temp, fused vs unfused",
         "jgraph": f"{fused / MIB:.2f} MiB", "reference": f"{unfused / MIB:.2f} MiB",
         "ratio": fused / unfused, "note": f"update {'/'.join(where)}; stacked gradient "
                                           f"{ws.size * 4 / MIB:.0f} MiB"},
        {"benchmark": f"fuse {name}: donated temp, fused vs JAX",
         "jgraph": f"{fused / MIB:.2f} MiB", "reference": f"{reference / MIB:.2f} MiB",
         "ratio": fused / reference, "note": "jax.value_and_grad + optax, donated"},
    ]
    if time_steps:
        runs = {}
        for label, graph in (("fused", gu), ("unfused", go)):
            step, split = donated_step(graph)
            first, rest = split(ws, x, state)
            holder = {"state": jax.tree.map(jnp.copy, first)}  # donated: never the caller's

            def run(step=step, rest=rest, holder=holder, graph=graph):
                outs = step(holder["state"], rest)
                # the state outputs, in the order of the state inputs (params, then opt state)
                holder["state"] = [o for o, r in zip(outs, graph.output_roles, strict=True)
                                   if r.startswith("new_")]
                return outs[0]

            runs[label] = run
        times = interleaved_medians(runs, repeats)
        rows.append({"benchmark": f"fuse {name}: step time, fused vs unfused",
                     "jgraph": f"{times['fused'] * 1e3:.1f} ms",
                     "reference": f"{times['unfused'] * 1e3:.1f} ms",
                     "ratio": times["fused"] / times["unfused"], "note": "interleaved, median"})
    return rows


def with_grads_row(name, tx, args) -> dict:
    """The step as `jg.optimizer_step` returns it, gradients among its outputs (`keep_grads`)."""
    ws, x = args
    go = jg.optimizer_step(jg.backward(jg.trace(scanned_mlp, ws, x, param_argnums=0)), tx)
    state = tx.init(ws)
    unfused = jg.compiled_memory(go, ws, x, state).temp_bytes
    fused = jg.compiled_memory(jg.fuse_updates(go), ws, x, state).temp_bytes
    return {"benchmark": f"fuse {name}: donated temp with grad outputs, fused vs unfused",
            "jgraph": f"{fused / MIB:.2f} MiB", "reference": f"{unfused / MIB:.2f} MiB",
            "ratio": fused / unfused, "note": "keep_grads=True: the grads stay outputs"}


def rows(quick: bool = False) -> list[dict]:
    args = mlp_args(16 if quick else 64)
    out = compare("scanned MLP x64, adam" if not quick else "scanned MLP x16, adam",
                  optax.adam(1e-3), args, time_steps=not quick)
    if not quick:
        out.append(with_grads_row("scanned MLP x64, adam", optax.adam(1e-3), args))
        out += compare("scanned MLP x64, adamw", optax.adamw(1e-3), args, time_steps=False)
        out += compare("scanned MLP x64, clip_by_global_norm + adam",
                       optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), args,
                       time_steps=False)
    return out


def optimizer_temp(fn, tx, params, x, remat) -> int:
    """The donated temp of `jg.Optimizer(fn, tx, loss="sum", remat=remat)`'s step (period 1)."""
    opt = jg.Optimizer(fn, tx, loss="sum", remat=remat)
    state = opt.init(params, x)
    return jg.compiled_memory(opt.graphs["opt"], params, x, state.opt_state).temp_bytes


def budget_rows() -> list[dict]:
    """The whole adam step planned under a budget: temp against the step's own no-remat temp."""
    tx, out = optax.adam(1e-3), []
    models = (("scanned MLP x64", scanned_mlp, mlp_args(), ("25%", "50%")),
              ("transformer x4 d128", transformer(), transformer_args(layers=4, d=128), ("25%",)))
    for name, fn, (params, x), budgets in models:
        step = without_grads(jg.optimizer_step(jg.backward(jg.trace(fn, params, x,
                                                                    param_argnums=0)), tx))
        plain, opt_plain = xla_temp(step), optimizer_temp(fn, tx, params, x, None)
        for budget in budgets:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", jg.BudgetWarning)
                planned = jg.remat(step, budget=budget)
                temp = xla_temp(planned)
                opt_temp = optimizer_temp(fn, tx, params, x, {"budget": budget})
            unmet = "; BudgetWarning" if caught else ""
            report = planned.info["remat"]
            out += [
                {"benchmark": f"budget {name}, jg.remat(step, {budget!r})",
                 "jgraph": f"{temp / MIB:.2f} MiB", "reference": f"{plain / MIB:.2f} MiB",
                 "ratio": temp / plain, "note": f"plan: {report['plan'][:60]}; fused "
                 f"{len(report.get('fused') or [])}, chunked {bool(report.get('chunked'))}"
                 f"{unmet}"},
                {"benchmark": f"budget {name}, Optimizer(remat={{'budget': {budget!r}}})",
                 "jgraph": f"{opt_temp / MIB:.2f} MiB", "reference": f"{opt_plain / MIB:.2f} MiB",
                 "ratio": opt_temp / opt_plain, "note": "against Optimizer(remat=None)"}]
    return out


if __name__ == "__main__":
    for row in budget_rows() if "--budgets" in sys.argv else rows(quick="--quick" in sys.argv):
        print(" | ".join(str(row[k]) if not isinstance(row[k], float) else f"{row[k]:.3f}"
                         for k in ("benchmark", "jgraph", "reference", "ratio", "note")),
              flush=True)
