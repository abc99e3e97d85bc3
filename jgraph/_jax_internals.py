"""Every use of JAX internals, in one place: what jgraph needs and JAX has no public API for.

jgraph reads jaxprs made by the public `jax.make_jaxpr`, but the params of some higher-order
primitives are internal layouts (a custom_vjp's fwd/bwd thunks, a checkpoint's policy), and a few
transposes have no public op. Each is named here with why; `check()` verifies them all and names the
symbol that moved, so a JAX upgrade fails loudly in one test (`tests/test_jax_internals.py`) instead
of deep inside a trace. `pyproject.toml` pins JAX to the minor release these were checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import ad_util, custom_derivatives, hijax, xla_bridge
from jax._src import core as jax_core
from jax._src.core import NamedAxisEffect
from jax._src.interpreters import ad, batching
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import windowed_reductions
from jax._src.lax.control_flow import loops
from jax.ad_checkpoint import checkpoint_name

# A cotangent the user's custom_vjp bwd declares zero (`jax.custom_vjp` passes symbolic zeros as
# this type; there is no public name for it).
SymbolicZero = ad_util.Zero

# Windowed max/min transposes: XLA's select-and-scatter and its transpose, which jax.lax does not
# export (JAX's own reduce_window_max VJP is built from them).
select_and_scatter_add = windowed_reductions._select_and_scatter_add
select_and_gather_add = windowed_reductions._select_and_gather_add



def shard_map_typed(aval):
    """`aval` if it varies over some mesh axes (inside `shard_map`), else None. JAX types that
    (`ShapedArray.mat`, undocumented) and inserts `pvary` where such values meet invariant ones,
    so a function traced on it must see the whole aval (its abstract mesh included)."""
    mat = getattr(aval, "mat", None)
    return aval if mat is not None and mat.varying else None


def harmless_effects(effects) -> bool:
    """Effects that only name the mesh axes a collective reduces over (`psum` inside
    `shard_map`): no side effect, nothing to order."""
    return all(isinstance(e, NamedAxisEffect) for e in effects)


def compile_platform() -> str:
    """The lowering name of the default backend ("cpu", "cuda", "rocm", "tpu", ...), as
    `lax.platform_dependent` names its branches (JAX's alias table is internal)."""
    return xla_bridge.canonicalize_platform(jax.default_backend())


# -- param layouts of higher-order primitives (jaxpr eqn params are not a public API) -------------
def call_body(params):
    """The body of a call-like eqn (`jit`, `pjit`, `closed_call`, `checkpoint`): (jaxpr, consts)."""
    sub = params.get("jaxpr") or params.get("call_jaxpr")
    if hasattr(sub, "consts"):
        return sub.jaxpr, sub.consts
    return sub, ()


def checkpoint_params(params):
    """(policy, prevent_cse) of a `jax.checkpoint` eqn (primitive `remat2`)."""
    return params.get("policy"), bool(params.get("prevent_cse", True))


def custom_jvp_params(params):
    """(primal body (ClosedJaxpr), jvp thunk, num_consts, symbolic_zeros) of `custom_jvp_call`.

    The thunk, called with one 'tangent is zero' flag per primal input, returns (jaxpr, consts,
    out_zeros): the jaxpr maps (primals, non-zero tangents) to (primal outs, non-zero tangent
    outs)."""
    return (params["call_jaxpr"], params["jvp_jaxpr_fun"], params["num_consts"],
            params["symbolic_zeros"])


def custom_vjp_params(params):
    """The parts of a `custom_vjp_call` eqn: (primal body, fwd(*float flags) -> (jaxpr, consts),
    bwd, residuals() -> (residual treedef, input forwarding), num_consts, symbolic_zeros).
    `residuals()` is known only once fwd has been traced: call it after `fwd`."""
    def residuals():
        _, res_tree, input_fwds = params["out_trees"]()
        return res_tree, input_fwds

    return (params["call_jaxpr"], params["fwd_jaxpr_thunk"].call_wrapped, params["bwd"],
            residuals, params["num_consts"], params["symbolic_zeros"])


def trace_custom_vjp_fwd(fwd, floats):
    """A custom_vjp_call's fwd (`custom_vjp_params`) traced with one 'tangent may be nonzero' flag
    per primal input (`floats`): (jaxpr, consts, n_lifted). A custom_vjp that vmap bound again
    from a jaxpr takes the closed-over values of the original call as its leading primal inputs,
    and its fwd refuses a nonzero tangent for them (`lift_fwd`'s `CustomVJPException`):
    `n_lifted` counts those, flagged zero."""
    for n_lifted in range(len(floats) + 1):
        try:
            jaxpr, consts = fwd(*[False] * n_lifted, *floats[n_lifted:])
        except ad.CustomVJPException:
            if n_lifted == len(floats):
                raise
            continue
        return jaxpr, consts, n_lifted


def remat_opt_fwd(params):
    """The fwd of a `remat_opt` eqn (`jax.custom_vjp(..., optimize_remat=True)`): a ClosedJaxpr
    of (consts, primals) -> (residuals, primal outputs)."""
    return params["fwd_jaxpr"]


def remat_opt_split(params):
    """A `remat_opt` eqn as JAX runs it under a remat that does not save its outputs
    (`_remat_opt_dce`): (residuals, primal), each a (jaxpr, consts). residuals: fwd cut to its
    residual outputs, of (consts, primals); primal: the custom function itself, of the primals,
    traced now. None if that function closes over values of the trace that bound the eqn (JAX
    traces it within that trace; jgraph, after it, has only their tracers)."""
    fwd, n_res = params["fwd_jaxpr"], params["num_res"]
    used = [k < n_res for k in range(len(fwd.jaxpr.outvars))]
    residuals, _ = pe.dce_jaxpr(fwd.jaxpr, used, instantiate=True)
    primal = params["fun_jaxpr_thunk"]()
    if any(isinstance(c, jax.core.Tracer) for c in primal[1]):
        return None
    return (residuals, fwd.consts), primal


def remat_opt_saved(policy, eqn) -> bool:
    """Whether JAX's remat with `policy` (None: nothing_saveable) saves the outputs of `remat_opt`
    eqn `eqn`, so that the custom_vjp's fwd runs in the forward pass. Otherwise the forward needs
    only fwd's primal outputs, and JAX computes them with the custom function instead; a fwd with
    no residuals of its own (only its inputs) always leaves them to the function."""
    if policy is None or not eqn.params["num_res"]:
        return False
    answer = policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
    if isinstance(answer, (bool, jnp.bool_)):
        return bool(answer)
    markers = jax.ad_checkpoint  # JAX's answers besides a bool (partial_eval's ensure_enum)
    return answer is markers.Saveable or isinstance(answer, markers.Offloadable)


# -- JAX's next remat and custom_vjp (the `jax_remat3`, `jax_custom_vjp3` flags) -----------------
# Under these flags `jax.checkpoint`, `checkpoint_name` and `jax.custom_vjp` bind one primitive,
# `call_hi_primitive`, whose param `_prim` is an object of JAX's internal classes.
def hi_primitive(params):
    """(kind, parts) of a `call_hi_primitive` eqn: "remat": (ClosedJaxpr, policy or None for
    nothing_saveable); "name": the checkpoint name; "vjp": a `HiVJP` (a custom_vjp, or any such
    primitive with a fwd and a bwd); otherwise (its class name, None)."""
    prim = params["_prim"]
    kind = type(prim).__name__
    if kind == "RematTraced":
        return "remat", (prim.jaxpr, prim.policy)
    if kind == "CheckpointName":
        return "name", prim.name
    base = hijax.VJPHiPrimitive
    if isinstance(prim, base) and type(prim).vjp_bwd_retval is not base.vjp_bwd_retval:
        return "vjp", HiVJP(prim)
    return kind, None


class HiVJP:
    """A `call_hi_primitive` with a fwd and a bwd, in the shapes jgraph's custom_vjp ops take."""

    def __init__(self, prim):
        self.prim = prim
        traced = getattr(prim, "traced", None)
        self.name = getattr(traced, "fun_name", None) or type(prim).__name__
        self.res_tree = None  # known once `fwd` is traced
        # custom_vjp(..., optimize_remat=True): under any remat, JAX computes the primal outputs
        # with the function itself and runs fwd for the residuals only (`OptRemat`).
        self.opt_remat = bool(getattr(prim, "opt_remat", False))

    def body(self, avals):
        """The primal function, a ClosedJaxpr of the flat inputs."""
        prim = self.prim
        return jax.make_jaxpr(lambda *flat: prim.out_tree.flatten_up_to(
            prim.expand(*jax.tree.unflatten(prim.in_tree, flat))))(*avals)

    def fwd(self, avals, floats):
        """fwd as a ClosedJaxpr of the flat inputs -> (residual leaves, primal outputs)."""
        prim, trees = self.prim, []

        def flat_fwd(*flat):
            nzs = jax.tree.unflatten(prim.in_tree, list(floats))
            out, res, *_ = prim.vjp_fwd(nzs, *jax.tree.unflatten(prim.in_tree, flat))
            leaves, tree = jax.tree.flatten(res)
            trees.append(tree)
            return [*leaves, *prim.out_tree.flatten_up_to(out)]

        closed = jax.make_jaxpr(flat_fwd)(*avals)
        self.res_tree = trees[-1]
        return closed

    def call_wrapped(self, *args):
        """bwd on (residual leaves, output cotangents) -> one cotangent (or a zero) per input."""
        prim, n_res = self.prim, self.res_tree.num_leaves
        res = jax.tree.unflatten(self.res_tree, args[:n_res])
        cts = jax.tree.unflatten(prim.out_tree, args[n_res:])
        return prim.in_tree.flatten_up_to(prim.vjp_bwd_retval(res, cts))


def call_user_bwd(bwd, *args):
    """Call the user's (flattened, linear_util-wrapped) custom_vjp bwd."""
    return bwd.call_wrapped(*args)


# The rules of a primitive of jgraph's own (`jg.jit`'s gradient call, `jgraph.dropin.jit`) under
# `jax.vmap` and `jax.jvp`: JAX has no public way to give a primitive its batching and JVP rules.
def define_batching(primitive, rule) -> None:
    batching.primitive_batchers[primitive] = rule


def define_jvp(primitive, rule) -> None:
    ad.primitive_jvps[primitive] = rule


instantiate_zeros = ad.instantiate_zeros


def check() -> None:
    """Raise ImportError naming any internal symbol jgraph relies on that this JAX lacks."""
    needed = {
        "jax._src.ad_util.Zero": (ad_util, "Zero"),
        "jax._src.lax.windowed_reductions._select_and_scatter_add":
            (windowed_reductions, "_select_and_scatter_add"),
        "jax._src.lax.windowed_reductions._select_and_gather_add":
            (windowed_reductions, "_select_and_gather_add"),
        "jax._src.xla_bridge.canonicalize_platform": (xla_bridge, "canonicalize_platform"),
        "jax._src.core.NamedAxisEffect": (jax_core, "NamedAxisEffect"),
        "jax._src.custom_derivatives.custom_jvp_call_p": (custom_derivatives, "custom_jvp_call_p"),
        "jax._src.custom_derivatives.custom_vjp_call_p": (custom_derivatives, "custom_vjp_call_p"),
        "jax._src.lax.control_flow.loops.scan_p": (loops, "scan_p"),
        "jax._src.hijax.VJPHiPrimitive": (hijax, "VJPHiPrimitive"),
        "jax._src.interpreters.partial_eval.dce_jaxpr": (pe, "dce_jaxpr"),
        "jax._src.interpreters.ad.CustomVJPException": (getattr(custom_derivatives, "ad", None),
                                                        "CustomVJPException"),
        "jax._src.interpreters.batching.primitive_batchers": (batching, "primitive_batchers"),
        "jax._src.interpreters.ad.primitive_jvps": (ad, "primitive_jvps"),
        "jax.ad_checkpoint.Saveable": (jax.ad_checkpoint, "Saveable"),
        "jax.ad_checkpoint.Offloadable": (jax.ad_checkpoint, "Offloadable"),
    }
    missing = [name for name, (module, attr) in needed.items() if not hasattr(module, attr)]
    missing += _missing_params()
    if missing:
        raise ImportError(f"jgraph needs JAX internals this JAX does not have: {missing}")


def _missing_params() -> list[str]:
    """Param names of higher-order primitives read above, checked on tiny traced examples."""
    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda p, t: (p[0], t[0]))

    @jax.custom_vjp
    def g(x):
        return x

    g.defvjp(lambda x: (x, None), lambda _, ct: (ct,))

    @jax.custom_vjp
    def h(x):
        return x

    h.defvjp(lambda x: (x, None), lambda _, ct: (ct,), optimize_remat=True)
    expected = {
        "custom_jvp_call": (f, {"call_jaxpr", "jvp_jaxpr_fun", "num_consts", "symbolic_zeros"}),
        "custom_vjp_call": (g, {"call_jaxpr", "fwd_jaxpr_thunk", "bwd", "out_trees",
                                "num_consts", "symbolic_zeros"}),
        "remat2": (jax.checkpoint(jnp.sin), {"jaxpr", "policy", "prevent_cse"}),
        "remat_opt": (jax.grad(h), {"fwd_jaxpr", "num_res", "fun_jaxpr_thunk"}),
    }
    missing = []
    for name, (fn, keys) in expected.items():
        eqn = jax.make_jaxpr(fn)(1.0).jaxpr.eqns[0]
        if eqn.primitive.name != name:
            missing.append(f"primitive {name!r} (JAX now binds {eqn.primitive.name!r})")
        missing += [f"{name} param {k!r}" for k in sorted(keys - set(eqn.params))]
    return missing + _missing_hi_primitives()


def _missing_hi_primitives() -> list[str]:
    """What `hi_primitive` reads, on jax.checkpoint, checkpoint_name and a custom_vjp traced
    under the `jax_remat3` and `jax_custom_vjp3` flags."""
    flags = ("jax_remat3", "jax_custom_vjp3")
    missing = [f"config flag {f!r}" for f in flags if not hasattr(jax.config, f)]
    if missing:
        return missing
    saved = {f: getattr(jax.config, f) for f in flags}
    try:
        for f in flags:
            jax.config.update(f, True)
        vjp = jax.custom_vjp(lambda x: x)
        vjp.defvjp(lambda x: (x, None), lambda _, ct: (ct,))
        fns = {"remat": jax.checkpoint(jnp.sin), "name": lambda x: checkpoint_name(x, "n"),
               "vjp": vjp}
        for kind, fn in fns.items():
            eqn = jax.make_jaxpr(fn)(1.0).jaxpr.eqns[0]
            try:
                got = hi_primitive(eqn.params)[0]
            except (KeyError, AttributeError) as e:
                got = f"{type(e).__name__}: {e}"
            if eqn.primitive.name != "call_hi_primitive" or got != kind:
                missing.append(f"call_hi_primitive of kind {kind!r} (JAX binds "
                               f"{eqn.primitive.name!r}, read as {got!r})")
    finally:
        for f, value in saved.items():
            jax.config.update(f, value)
    return missing
