"""`Dataset`: ggml_opt_dataset — datapoints (and labels) in shards, served in a shuffled order.

Datapoints are the leading axis of `data` (and `labels`). They are grouped into shards of
`shard_size` consecutive datapoints; a remainder that does not fill a shard is never served. A
shard permutation decides the order: `shuffle(key, idata)` permutes all shards, or only those of
the first `idata` datapoints (which keeps a validation tail fixed), with an explicit JAX key.
`batch(ibatch, batch_size)` serves the `ibatch`-th block of shards; a shard stays in order.
Sizes and indices are checked ints (`ArgumentError`); data and labels must hold numbers. With
`classes=n`, labels are class ids, checked to lie in [0, n) (an id outside makes a cross-entropy
NaN or a one-hot row of zeros); `fit` and `Optimizer` check them against the model's outputs.
`copy()` gives a dataset over the same arrays with its own order (what `fit` shuffles).

With a `mesh`, `batch` serves global `jax.Array`s split along the mesh's `data_axis` (every
process of a multi-process run serves the same batch and places only its own shards); a batch
size that the axis does not divide is an `ArgumentError`.
"""

from __future__ import annotations

import jax
import numpy as np

from jgraph.errors import JGraphError
from jgraph.training.arguments import ArgumentError, integer, numeric_array, positive_int
from jgraph.training.mesh import MeshPlan


def check_class_ids(labels, nclasses: int, what: str) -> None:
    """`ArgumentError` naming the first label outside [0, nclasses) and its index."""
    if labels is None:
        raise ArgumentError(f"{what}: class ids are needed (classes= was given), got no labels")
    if labels.dtype.kind not in "iu":
        raise ArgumentError(f"{what} must be integer class ids for {nclasses} classes, got "
                            f"dtype {labels.dtype}")
    if labels.size and (labels.min() < 0 or labels.max() >= nclasses):
        at = tuple(int(i) for i in np.argwhere((labels < 0) | (labels >= nclasses))[0])
        raise ArgumentError(f"{what} must be class ids in [0, {nclasses}); got {labels[at]} at "
                            f"index {at[0] if len(at) == 1 else at}")


class Dataset:
    """Data (and labels) on the host, served in batches of whole shards.

    Args:
        data: an array (or pytree of arrays) with the datapoints on axis 0.
        labels: the labels, datapoints on axis 0 (None: no labels).
        shard_size: consecutive datapoints per shard; a remainder that does not fill a shard is
            never served.
        mesh: a `jax.sharding.Mesh` the batches are placed on (None: numpy batches on the host).
        data_axis: the mesh axis the batch is split along.
        classes: the number of classes: labels are class ids, checked to lie in `[0, classes)`."""

    def __init__(self, data, labels=None, shard_size: int = 1, mesh=None,
                 data_axis: str = "data", classes: int | None = None):
        self.data = numeric_array(data, "Dataset: data")
        self.labels = None if labels is None else numeric_array(labels, "Dataset: labels")
        if self.data.ndim == 0 or len(self.data) == 0:
            raise JGraphError("Dataset: data needs a leading axis of at least one datapoint")
        if self.labels is not None and (self.labels.ndim == 0
                                        or len(self.labels) != len(self.data)):
            raise JGraphError(f"Dataset: {len(np.atleast_1d(self.labels))} labels for "
                              f"{len(self.data)} datapoints")
        if classes is not None:
            check_class_ids(self.labels, positive_int(classes, "Dataset: classes"),
                            "Dataset: labels")
        self.shard_size = positive_int(shard_size, "Dataset: shard_size")
        if self.shard_size > len(self.data):
            raise JGraphError(f"Dataset: shard_size {self.shard_size} exceeds the "
                              f"{len(self.data)} datapoints (no shard could be served)")
        self.permutation = np.arange(len(self.data) // self.shard_size, dtype=np.int64)
        self.plan = None if mesh is None else MeshPlan(mesh, data_axis)

    @property
    def mesh(self):
        """The mesh batches are placed on (None: NumPy batches on the host)."""
        return None if self.plan is None else self.plan.mesh

    def copy(self) -> Dataset:
        """A dataset over the same data and labels (not copied) with its own shard order."""
        other = object.__new__(Dataset)
        other.data, other.labels, other.shard_size = self.data, self.labels, self.shard_size
        other.permutation = self.permutation.copy()
        other.plan = self.plan
        return other

    @property
    def ndata(self) -> int:
        """Datapoints that can be served (whole shards only)."""
        return len(self.permutation) * self.shard_size

    @property
    def nshards(self) -> int:
        return len(self.permutation)

    def shuffle(self, key, idata: int | None = None) -> Dataset:
        """Permute the shards (all, or those of the first `idata` datapoints) in place."""
        if idata is not None:
            idata = integer(idata, "Dataset.shuffle: idata")
        if idata is None or idata < 0:
            n = self.nshards
        else:
            if idata % self.shard_size or idata > self.ndata:
                raise JGraphError(f"Dataset.shuffle: idata={idata} must be a multiple of the "
                                  f"shard size {self.shard_size} and at most {self.ndata}")
            n = idata // self.shard_size
        if n > 1:
            try:
                order = np.asarray(jax.random.permutation(key, n))
            except (TypeError, ValueError) as e:
                raise ArgumentError(f"Dataset.shuffle: key must be a JAX PRNG key "
                                    f"(jax.random.key or PRNGKey), got {key!r:.60}") from e
            self.permutation[:n] = self.permutation[:n][order]
        return self

    def batch(self, ibatch: int, batch_size: int):
        """`(data, labels)` of batch `ibatch` (labels None without labels), as numpy arrays."""
        ibatch = integer(ibatch, "Dataset.batch: ibatch", 0)
        batch_size = positive_int(batch_size, "Dataset.batch: batch_size")
        if batch_size % self.shard_size:
            raise JGraphError(f"Dataset.batch: batch size {batch_size} is not a multiple of the "
                              f"shard size {self.shard_size}")
        per = batch_size // self.shard_size
        if (ibatch + 1) * per > self.nshards:
            raise JGraphError(f"Dataset.batch: batch {ibatch} of size {batch_size} is out of "
                              f"range ({self.ndata} datapoints)")
        if self.plan is not None and batch_size % self.plan.size:
            raise ArgumentError(f"Dataset.batch: batch size {batch_size} is not divisible by the "
                                f"{self.plan.size} devices of mesh axis "
                                f"{self.plan.data_axis!r}")
        shards = self.permutation[ibatch * per:(ibatch + 1) * per]
        idx = (shards[:, None] * self.shard_size + np.arange(self.shard_size)).reshape(-1)
        x, y = self.data[idx], None if self.labels is None else self.labels[idx]
        if self.plan is not None:
            return self.plan.put_batch(x, "Dataset.batch"), self.plan.put_batch(y, "Dataset.batch")
        return x, y
