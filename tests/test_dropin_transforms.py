"""The drop-ins under JAX's transforms: inlined into the user's `jit` (no nested executable),
`vmap` (per-example gradients), `lax.scan` bodies, sharded `jit` and `shard_map`, and nested
(second derivatives). References: the same program with JAX's own transforms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jgraph as jg
from tests.test_dropin import assert_trees_close, tree_args, tree_loss

f32 = jnp.float32


def per_example_loss(p, x, y):
    h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.sum((h - y) ** 2)


def per_example_args(n=6):
    k = jax.random.split(jax.random.PRNGKey(2), 4)
    p = {"w": jax.random.normal(k[0], (3, 4), f32), "b": jax.random.normal(k[1], (4,), f32)}
    return p, jax.random.normal(k[2], (n, 3), f32), jax.random.normal(k[3], (n, 4), f32)


# -- inside the user's jit: inlined ---------------------------------------------------------------
def test_inlined_into_the_users_jit():
    args = tree_args()

    @jax.jit
    def step(params, batch, scale):
        value, grads = jg.value_and_grad(tree_loss)(params, batch, scale)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    want_value, want_grads = jax.value_and_grad(tree_loss)(*args)
    value, new = step(*args)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert_trees_close(new, jax.tree.map(lambda p, g: p - 0.1 * g, args[0], want_grads))
    # One program: the step's jaxpr holds jgraph's eqns themselves, no nested call ...
    inner = jax.make_jaxpr(step)(*args).jaxpr.eqns[0].params["jaxpr"].jaxpr
    assert not [e.primitive.name for e in inner.eqns
                if e.primitive.name in ("jit", "pjit", "closed_call", "core_call")]
    assert any(e.primitive.name == "tanh" for e in inner.eqns)
    # ... and one function in its StableHLO, calling nothing compiled separately.
    text = step.lower(*args).as_text()
    assert text.count("func.func") == 1 and "call @" not in text


def test_jit_of_the_transform_itself():
    args = tree_args()
    assert_trees_close(jax.jit(jg.value_and_grad(tree_loss))(*args),
                       jax.value_and_grad(tree_loss)(*args))
    assert_trees_close(jax.jit(jg.grad(tree_loss, (0, 2)))(*args),
                       jax.grad(tree_loss, (0, 2))(*args))


# -- vmap: per-example gradients ------------------------------------------------------------------
def test_vmap_gives_per_example_gradients():
    p, x, y = per_example_args()
    got = jax.jit(jax.vmap(jg.grad(per_example_loss), in_axes=(None, 0, 0)))(p, x, y)
    want = jax.jit(jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0, 0)))(p, x, y)
    assert jax.tree.leaves(got)[0].shape == (6, 4)
    assert_trees_close(got, want)
    # Batched params too, and value_and_grad inside a jitted vmap.
    ps = jax.tree.map(lambda a: jnp.stack([a, 2 * a, -a]), p)
    vmapped = jax.jit(jax.vmap(jg.value_and_grad(per_example_loss), in_axes=(0, None, None)))
    reference = jax.jit(jax.vmap(jax.value_and_grad(per_example_loss), (0, None, None)))
    assert_trees_close(vmapped(ps, x, y), reference(ps, x, y))


def test_vmap_with_remat_keeps_values():
    def loss(w, x):
        h = jax.checkpoint(lambda w, x: jnp.sin(jnp.sin(x * w) * w))(w, x)
        return jnp.sum(h ** 2)

    w, xs = jnp.linspace(0.5, 1.5, 4, dtype=f32), jnp.ones((5, 4), f32)
    got = jax.jit(jax.vmap(jg.grad(loss), in_axes=(None, 0)))(w, xs * jnp.arange(5)[:, None])
    want = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, xs * jnp.arange(5)[:, None])
    assert_trees_close(got, want, rtol=1e-5)


# -- lax.scan bodies ------------------------------------------------------------------------------
def test_inside_a_scan_body():
    p, x, y = per_example_args(8)

    def train(grad_fn):
        def body(params, batch):
            value, grads = grad_fn(per_example_loss)(params, *batch)
            return jax.tree.map(lambda a, g: a - 0.05 * g, params, grads), value

        return jax.jit(lambda p, x, y: lax.scan(body, p, (x, y)))(p, x, y)

    assert_trees_close(train(jg.value_and_grad), train(jax.value_and_grad), rtol=1e-5)


# -- sharding -------------------------------------------------------------------------------------
def test_sharded_jit_and_shard_map():
    """On this process's devices (one CPU device in the suite: the sharding code paths; the
    child test below, opt-in with -m slow, runs the same on 4 devices)."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    p, x, y = per_example_args(4 * len(jax.devices()))
    check_sharded(mesh, p, x, y)


def sharded_programs(transform):
    """Per-device gradients inside shard_map, two ways: summed after the transform, or a mean
    across devices inside the loss (then `lax.psum` is differentiated)."""
    def summed_after(p, x, y):
        value, grads = transform(per_example_loss)(p, x, y)
        n = lax.psum(x.shape[0], "data")
        return lax.psum(value, "data") / n, jax.tree.map(lambda g: lax.psum(g, "data") / n, grads)

    def mean_inside(p, x, y):
        n = lax.psum(x.shape[0], "data")
        return transform(lambda p: lax.psum(per_example_loss(p, x, y), "data") / n)(p)

    return {"summed after": summed_after, "mean inside": mean_inside}


def check_sharded(mesh, p, x, y):
    data = NamedSharding(mesh, P("data"))
    x, y = jax.device_put(x, data), jax.device_put(y, data)
    loss = lambda p, x, y: per_example_loss(p, x, y) / x.shape[0]
    want = jax.value_and_grad(loss)(p, x, y)
    step = jax.jit(jg.value_and_grad(loss), out_shardings=NamedSharding(mesh, P()))
    assert_trees_close(step(p, x, y), want, rtol=1e-5)

    ours, theirs = sharded_programs(jg.value_and_grad), sharded_programs(jax.value_and_grad)
    for check_vma in (True, False):
        for name in ours:
            if name == "mean inside" and not check_vma:
                continue  # an untyped psum has no rule: see test_untyped_psum_is_an_error
            mapped = [jax.jit(jax.shard_map(fn[name], mesh=mesh, out_specs=P(),
                                            in_specs=(P(), P("data"), P("data")),
                                            check_vma=check_vma)) for fn in (ours, theirs)]
            assert_trees_close(mapped[0](p, x, y), mapped[1](p, x, y), rtol=1e-5)
            if check_vma == (name == "mean inside"):  # the programs computing the global mean
                assert_trees_close(mapped[0](p, x, y), want, rtol=1e-5)


def test_untyped_psum_is_an_error():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    mapped = jax.shard_map(sharded_programs(jg.value_and_grad)["mean inside"], mesh=mesh,
                           in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=False)
    with pytest.raises(jg.TransformError, match="no VJP rule for op 'psum'.*check_vma=True"):
        mapped(*per_example_args(4))


SHARDED_CHILD = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import Mesh
from tests.test_dropin_transforms import check_sharded, per_example_args
assert len(jax.devices()) == 4
check_sharded(Mesh(np.array(jax.devices()), ("data",)), *per_example_args(16))
print("OK")
"""


@pytest.mark.slow  # a child process with 4 host devices; the default suite runs the same on 1
def test_sharded_on_four_devices():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    proc = subprocess.run([sys.executable, "-c", SHARDED_CHILD], capture_output=True, text=True,
                          cwd=root, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


# -- nested: second derivatives -----------------------------------------------------------------
def scalar_fn(x):
    return jnp.sin(x) * jnp.exp(0.3 * x) + x ** 3 / (1.0 + x ** 2)


def vector_fn(v):
    return jnp.sum(jnp.tanh(v) * jnp.roll(v, 1)) + jnp.sum(jnp.cos(v)) ** 2


@pytest.mark.f64
def test_second_derivatives_equal_jaxs():
    x = 0.7
    want = jax.jit(jax.grad(jax.grad(scalar_fn)))(x)
    for got in (jg.grad(jg.grad(scalar_fn))(x), jax.grad(jg.grad(scalar_fn))(x),
                jg.grad(jax.grad(scalar_fn))(x), jax.jit(jg.grad(jg.grad(scalar_fn)))(x)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    v = jnp.linspace(-1.0, 1.2, 5)
    hessian = jax.jit(jax.hessian(vector_fn))(v)  # jitted: op-by-op dispatch is slow here
    hvp = jg.grad(lambda v, e: jnp.vdot(jg.grad(vector_fn)(v), e))
    for got in (jax.jit(jax.jacfwd(jg.grad(vector_fn)))(v),
                jax.jit(jax.jacrev(jg.grad(vector_fn)))(v),
                jax.jit(jax.vmap(hvp, in_axes=(None, 0)))(v, jnp.eye(5))):
        np.testing.assert_allclose(got, hessian, rtol=1e-11, atol=1e-12)
    # value_and_grad of a value_and_grad's gradient, with pytrees
    args = tree_args()
    inner = lambda p, b, s: jnp.sum(jg.grad(tree_loss)(p, b, s)["dense"].w ** 2)
    reference = lambda p, b, s: jnp.sum(jax.grad(tree_loss)(p, b, s)["dense"].w ** 2)
    assert_trees_close(jax.jit(jg.value_and_grad(inner))(*args),
                       jax.jit(jax.value_and_grad(reference))(*args), rtol=1e-5)


@jax.custom_jvp
def scaled_sin(x):
    return jnp.sin(x)


# A rule that is not the body's derivative, so that a result which ignores it shows.
scaled_sin.defjvp(lambda primals, tangents: (jnp.sin(primals[0]),
                                             2.0 * jnp.cos(primals[0]) * tangents[0]))


@jax.custom_vjp
def clipped_square(x):
    return x ** 2


clipped_square.defvjp(lambda x: (x ** 2, x), lambda x, ct: (jnp.clip(3.0 * x * ct, -2.0, 2.0),))


def with_custom_rules(x):
    return jnp.sum(jnp.exp(0.5 * scaled_sin(x)) + clipped_square(jnp.tanh(x)) * x)


@pytest.mark.f64
def test_second_derivatives_with_custom_rules_equal_jaxs():
    """Both rules are used at the inner level, and their own code (a JVP rule's primal output,
    fwd's residuals, bwd) is differentiated at the outer level, as JAX does."""
    x = jnp.linspace(-0.8, 0.9, 4)
    want = jax.jit(jax.hessian(with_custom_rules))(x)
    plain = jax.jit(jax.hessian(lambda x: jnp.sum(jnp.exp(0.5 * jnp.sin(x))
                                                  + jnp.tanh(x) ** 2 * x)))(x)
    assert np.max(np.abs(want - plain)) > 0.1  # the rules matter here
    hvp = jg.grad(lambda x, e: jnp.vdot(jg.grad(with_custom_rules)(x), e))
    for got in (jax.jit(jax.jacrev(jg.grad(with_custom_rules)))(x),
                jax.jit(jax.jacfwd(jg.grad(with_custom_rules)))(x),
                jax.jit(jax.vmap(hvp, in_axes=(None, 0)))(x, jnp.eye(4))):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.f64
def test_jax_grad_of_the_value_keeps_custom_rules():
    x = jnp.linspace(-0.8, 0.9, 4)
    got = jax.grad(lambda x: jg.value_and_grad(with_custom_rules)(x)[0])(x)
    # JAX's reference is the same composition: differentiating the value of a value_and_grad
    # differentiates the code that computed it (a custom_jvp rule's primal part, a custom_vjp's
    # fwd), as JAX does, not `jax.grad(with_custom_rules)`.
    want = jax.grad(lambda x: jax.value_and_grad(with_custom_rules)(x)[0])(x)
    np.testing.assert_allclose(got, want, rtol=1e-12)
