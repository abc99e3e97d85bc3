"""`jg.fuse_updates`: each update applied where its gradient is made (DESIGN §6, issue 28).

    slices     the rule table: which eqns act on each slice of a stacked value
    transform  `fuse_updates`: the analysis of a step's update eqns and the rewrite of its scans
"""

from jgraph.fuse.slices import SLICE_RULES, STATE_OF, slice_form
from jgraph.fuse.transform import fuse_updates, with_grads, without_grads

__all__ = ["SLICE_RULES", "STATE_OF", "fuse_updates", "slice_form", "with_grads", "without_grads"]
