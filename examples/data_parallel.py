"""Train the demo MLP (`python -m jgraph demo`'s model) data-parallel on 8 host devices.

    python examples/data_parallel.py [--devices 8] [--epochs 5]

The CPU is split into `--devices` XLA host devices (`--xla_force_host_platform_device_count`,
set before JAX starts), which stand in for accelerators: the same code runs on GPUs or TPUs, or
on many hosts under `jax.distributed.initialize()`. The batch is split along the mesh's "data"
axis; with gradient accumulation (logical batch 64 = 4 micro-batches of 16) each device
accumulates its own gradients, and they cross devices once per logical batch. It prints, per
device count, the memory of one device (XLA's figures for the donated steps, and the training
state it holds) and the collectives in each step, then trains and prints the accuracy.
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8, choices=(1, 2, 4, 8))
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={args.devices}")

import jax  # noqa: E402 - after XLA_FLAGS
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jgraph as jg  # noqa: E402
from jgraph.training import demo  # noqa: E402
from jgraph.training.mesh import count_collectives  # noqa: E402

BATCH, MICRO = 64, 16
PERIOD = BATCH // MICRO


def mesh_of(k: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:k]), ("data",))


def state_bytes_on(device, state) -> int:
    """Bytes of the training state that live on `device`."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "sharding")
               for shard in leaf.addressable_shards if shard.device == device)


def fsdp(leaf):
    """FSDP-style: split a param's first axis over the devices when it divides evenly."""
    return P("data") if leaf.shape and leaf.shape[0] % args.devices == 0 else None


def optimizer(k: int, param_sharding=None):
    return jg.Optimizer(demo.model, optax.adam(1e-3), loss="cross_entropy", period=PERIOD,
                        remat=True, mesh=mesh_of(k), param_sharding=param_sharding)


def memory_row(k: int, params, x, y):
    sharded = state_bytes_on(jax.devices()[0], optimizer(k, fsdp).init(params, x, y))
    opt = optimizer(k)
    state = opt.init(params, x, y)
    data = opt._data(x, y)
    grad = opt.executables["grad"].lower(state.params, *data, state.grad_acc,
                                         opt._counter(0)).compile()
    step = opt.executables["opt"].lower(state.params, *data, state.grad_acc,
                                        opt._counter(PERIOD - 1), state.opt_state).compile()
    return (k, grad.memory_analysis().temp_size_in_bytes,
            step.memory_analysis().temp_size_in_bytes, state_bytes_on(jax.devices()[0], state),
            sharded, count_collectives(grad.as_text()), count_collectives(step.as_text()))


def main() -> None:
    ds, n_in = demo.load_digits_dataset()
    params = demo.init_params(jax.random.PRNGKey(0), n_in)
    x, y = ds.batch(0, MICRO)
    print(f"{len(jax.devices())} host devices; demo MLP, logical batch {BATCH} = {PERIOD} "
          f"micro-batches of {MICRO}, remat of every block, adam")
    print("\nmemory of device 0 (KiB): XLA's temp of the donated steps, the training state it "
          "holds (params replicated, or FSDP-sharded); collectives per step")
    print(f"  {'devices':>7s} {'grad temp':>10s} {'opt temp':>9s} {'state':>8s} {'FSDP':>8s}"
          f"   collectives")
    for k in (1, 2, 4, 8):
        if k > args.devices:
            break
        k, grad_temp, opt_temp, state, sharded, in_grad, in_opt = memory_row(k, params, x, y)
        counts = lambda c: ", ".join(f"{n} {v}" for n, v in c.items() if v) or "none"  # noqa
        print(f"  {k:7d} {grad_temp / 1024:10.1f} {opt_temp / 1024:9.1f} {state / 1024:8.1f}"
              f" {sharded / 1024:8.1f}   grad: {counts(in_grad)}; opt: {counts(in_opt)}")

    mesh = mesh_of(args.devices)
    print(f"\ntraining on {args.devices} devices for {args.epochs} epochs")
    trained, history = jg.fit(demo.model, params, jg.Dataset(ds.data, ds.labels, mesh=mesh),
                              loss="cross_entropy", tx=optax.adam(1e-3), epochs=args.epochs,
                              batch_size=BATCH, physical_batch_size=MICRO, val_split=0.2,
                              remat=True, key=jax.random.PRNGKey(1), progress=False)
    w = trained["head"]["w"]
    print(f"params stay on the mesh: head.w on {len(w.sharding.device_set)} devices, "
          f"{w.sharding.spec}")
    print(f"validation accuracy {100 * history.val_accuracy[-1]:.2f} % "
          f"(± {100 * history.val_accuracy_unc[-1]:.2f} %)")


if __name__ == "__main__":
    main()
