"""Where `jg.jit` meets the drop-ins it traces: the gradient calls of a step, recorded.

`jg.jit` (`jgraph.dropin.jit`) traces the user's step with a `Recorder` in force. A drop-in
gradient call (`jg.value_and_grad`, `jg.grad`, the equinox filters) made while one is in force
does not run its joint graph: it hands the recorder a thunk making its trace entry, and the call
itself, and returns the flat outputs the recorder gives (`grad_call`). The recorder decides:
while the step is first traced it records the entry and returns placeholders; while the tail of
the step is traced it returns the values the whole step's graph computes. A call made inside
another drop-in's trace (a gradient of a gradient) is not the step's own: no recorder is in force
there (`suspended`).
"""

from __future__ import annotations

import contextlib
import threading

_STATE = threading.local()


def current():
    """The recorder in force in this thread, or None."""
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def active(recorder):
    """`recorder` in force (None: none) while the block runs."""
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    stack.append(recorder)
    try:
        yield recorder
    finally:
        stack.pop()


def suspended():
    """No recorder in force while the block runs (a drop-in's own trace)."""
    return active(None)
