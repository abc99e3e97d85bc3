"""jgraph: a training step as an explicit, inspectable graph on JAX.

Trace a JAX loss function into a small IR (`trace`), build its backward graph with jgraph's own
VJP rules (`backward`), rematerialize, accumulate and step as graph -> graph transforms, and run the
result through XLA (`compile`).
"""

# (importing `vjp_rules` registers the VJP rules into `jgraph.backward`'s tables)
from jgraph import builder, config, ops, planner, policies, testing, vjp_rules
from jgraph.backward import backward
from jgraph.check import check
from jgraph.checkpoint import checkpoint, checkpoint_name
from jgraph.chunk import chunk_rows
from jgraph.dot import to_dot
from jgraph.dropin import filter_grad, filter_value_and_grad, grad, jit, value_and_grad, vjp
from jgraph.errors import BudgetWarning, GraphError, JGraphError, TraceError, TransformError
from jgraph.fuse import fuse_updates
from jgraph.interpreter import Interpreter, evaluate
from jgraph.ir import Eqn, Graph, Literal, Region, Var
from jgraph.lower import compile
from jgraph.memory import compiled_memory, memory
from jgraph.remat import remat
from jgraph.to_jax import to_jax
from jgraph.trace import trace
from jgraph.training import (
                             Dataset,
                             Optimizer,
                             Result,
                             accumulate,
                             epoch,
                             first_micro_step,
                             fit,
                             optimizer_step,
                             reset,
)

__all__ = [
    "Eqn", "Graph", "GraphError", "Interpreter", "JGraphError", "Literal", "Region", "TraceError",
    "TransformError", "BudgetWarning", "Var", "backward", "check", "compile", "evaluate", "trace",
    "testing", "to_jax", "config", "planner", "vjp_rules",
    "checkpoint", "checkpoint_name", "compiled_memory", "memory", "policies", "remat",
    "to_dot", "chunk_rows", "fuse_updates",
    "Dataset", "Optimizer", "Result", "accumulate", "epoch", "fit", "optimizer_step", "reset",
    "first_micro_step",
    "value_and_grad", "grad", "vjp", "jit", "filter_value_and_grad", "filter_grad",
]
__version__ = config.__version__

# Every JAX primitive the tracer does not rewrite is an op binding it (after every module that
# registers a tracer handler or a rule has been imported, above).
ops.register_jax_primitives(builder.rewritten_by_tracer())
