"""`jg.chunk_rows`: row-independent regions run over chunks of rows (DESIGN §6, issue 28).

The loss head of a backward graph (final norm, output projection, log-softmax or cross-entropy,
per-row losses, their sum or mean) computes each row of the batch (or of batch x sequence
positions) independently, and the loss's cotangent is known before the forward ends. So the
head's forward and backward run together in a scan over chunks of rows: one chunk's logits and
their cotangent exist at a time, the parameters' gradients accumulate over chunks, and the
cotangent of the head's row inputs comes out chunk by chunk. A row-independent region inside the
network (a token-wise MLP) runs in a forward scan over chunks whose backward scan recomputes each
chunk; so does attention, over blocks of queries (each block reads all keys and values), and both
are looked for inside a scanned model's layer too. Modules:

    rows       the rule table: how each op maps rows, and its params on a chunk
    find       the head region on the forward graph (row sums, growth, whether it is worth it)
    emit       a region's eqns emitted on a chunk; rows moved in and out of chunks
    interior   regions inside the network, each in a loop recomputed in the backward
    axes       the rule table of a block axis that moves from value to value (attention)
    blocks     attention's region over blocks of queries, in a loop recomputed in the backward
    transform  `chunk_rows`: the joint graph derived again around the chunked regions
"""

from jgraph.chunk.emit import split_rows
from jgraph.chunk.transform import chunk_rows

__all__ = ["chunk_rows", "split_rows"]
