"""Flax NNX objects among `jg.jit`'s arguments, handled as `nnx.jit` handles them (the module
docstring of `jgraph.dropin.jit`): split together into states appended as arguments, each
object's place left as a `NodeRef`, merged again around the step (`with_nodes`). `flax.nnx` is
never imported here: an NNX object exists only where the user has imported it."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import jax

from jgraph.dropin.arguments import ArgumentError


def flax_nnx():
    """`flax.nnx` where the user has imported it (no NNX object exists before that), else None."""
    return sys.modules.get("flax.nnx")


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class NodeRef:
    """Where an NNX object stood in an argument: no leaves, the object's number as aux data."""

    index: int

    def tree_flatten(self):
        return (), self.index

    @classmethod
    def tree_unflatten(cls, index, _):
        return cls(index)


@jax.tree_util.register_pytree_node_class
class NodeState:
    """An NNX object's state as an argument of the step (its arrays traced); static: the
    graphdef of all the step's NNX objects, and the position of the argument holding it."""

    def __init__(self, graphdef, owner: int, state):
        self.graphdef, self.owner, self.state = graphdef, owner, state

    def tree_flatten(self):
        return (self.state,), (self.graphdef, self.owner)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, children[0])


def split_nodes(args, static) -> tuple[list, tuple]:
    """The step's arguments with their NNX objects split out (module docstring), and the
    objects, in the order of the appended states."""
    nnx = flax_nnx()
    if nnx is None:
        return list(args), ()
    pure, nodes, owners, number = list(args), [], [], {}
    for i, a in enumerate(args):
        if i in static:
            continue
        flat, tree = jax.tree.flatten(a, is_leaf=is_node)
        if not any(map(is_node, flat)):
            continue
        for j, x in enumerate(flat):
            if is_node(x):
                if id(x) not in number:
                    number[id(x)] = len(nodes)
                    nodes.append(x)
                    owners.append(i)
                flat[j] = NodeRef(number[id(x)])
        pure[i] = jax.tree.unflatten(tree, flat)
    if not nodes:
        return pure, ()
    graphdef, state = nnx.split(tuple(nodes))
    pure += [NodeState(graphdef, o, part(state, k)) for k, o in enumerate(owners)]
    return pure, tuple(nodes)


def is_node(x) -> bool:
    nnx = flax_nnx()
    return nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable))


def part(state, k: int):
    """Object k's state in the state `nnx.split` made of a tuple of objects (empty where the
    object has none, or its Variables are all another's, shared)."""
    return state[k] if k in state else flax_nnx().State({})


def whole(states) -> object:
    return flax_nnx().State({k: s.state for k, s in enumerate(states)})


def with_nodes(fun, args, n: int):
    """`fun` on the step's arguments with the NNX objects merged from their states (the last
    `n` arguments), returning the objects' new states and `fun`'s result."""
    nnx, states = flax_nnx(), args[len(args) - n:]
    graphdef = states[0].graphdef
    objects = nnx.merge(graphdef, whole(states))
    out = fun(*[jax.tree.map(lambda x: objects[x.index] if isinstance(x, NodeRef) else x, a,
                             is_leaf=lambda x: isinstance(x, NodeRef))
                for a in args[:len(args) - n]])
    if any(map(is_node, jax.tree.leaves(out, is_leaf=is_node))):
        raise ArgumentError("jg.jit: the step returns an NNX object, which nnx.jit allows and "
                            "jg.jit does not; return its state (nnx.state(obj)), or pass the "
                            "object as an argument: jg.jit updates it in place")
    new_graphdef, new_state = nnx.split(objects)
    if new_graphdef != graphdef:
        raise ArgumentError("jg.jit: the step changed the structure of an NNX argument (added or "
                            "removed a Variable or a submodule, or changed a static attribute), "
                            "which nnx.jit allows and jg.jit does not (it writes back an object's "
                            "values only); make the change outside the step")
    return tuple(NodeState(graphdef, s.owner, part(new_state, k))
                 for k, s in enumerate(states)), out
