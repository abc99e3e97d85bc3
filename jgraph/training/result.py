"""`Result`: ggml_opt_result — losses per batch, predictions and accuracy, with uncertainties.

Per-batch losses are stored as the graphs compute them and the period scaling is undone here (in
float32, as ggml-opt does). `loss()` is the mean over batches for per-datapoint losses, with the
standard error of the mean as uncertainty, or the sum for `sum` losses, with the sample standard
deviation. `accuracy()` is `ncorrect / ndata` with a binomial standard error. Undefined values are
NaN (an uncertainty from fewer than 2 batches or datapoints, an accuracy without predictions), and
`loss()` of an empty result is (0, NaN), as in ggml-opt. Device values are read lazily, so adding
an output never waits for the device. `nonfinite` counts the steps whose finite check failed
(guarded Optimizers). `to_json`/`from_json` carry the statistics (not the predictions) through a
checkpoint, exactly (float32 losses are exact as JSON floats).
"""

from __future__ import annotations

import math

import numpy as np

from jgraph.errors import JGraphError


class Result:
    """Statistics of a sequence of `step`/`evaluate` outputs: `add` each, then read `loss()` and
    `accuracy()`, each a `(value, uncertainty)` pair, `ndata` and `pred()`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._pending: list = []
        self._losses: list[np.ndarray] = []
        self._preds: list[np.ndarray] = []
        self._ncorrect = 0
        self._has_ncorrect = True
        self._per_datapoint: bool | None = None
        self._nonfinite = 0
        self.ndata = 0

    def add(self, out) -> None:
        """Record one output (or a stack of micro-batch outputs from `step_period`)."""
        if self._per_datapoint is not None and out.per_datapoint != self._per_datapoint:
            raise JGraphError("Result: cannot mix per-datapoint and sum losses")
        self._per_datapoint = out.per_datapoint
        nbatches = 1 if np.ndim(out.loss) == 0 else int(np.shape(out.loss)[0])
        self.ndata += out.ndata * nbatches
        self._has_ncorrect &= out.ncorrect is not None
        self._pending.append(out)

    def _flush(self) -> None:
        for out in self._pending:
            loss = np.atleast_1d(np.asarray(out.loss, np.float32))
            if out.per_datapoint:
                loss = loss * np.float32(out.period)
            self._losses.append(loss)
            if out.pred is not None:
                self._preds.append(np.asarray(out.pred).reshape(-1))
            if out.ncorrect is not None:
                self._ncorrect += int(np.sum(np.asarray(out.ncorrect, np.int64)))
            if getattr(out, "finite", None) is not None:
                self._nonfinite += int(np.sum(~np.asarray(out.finite, np.bool_)))
        self._pending.clear()

    @property
    def nonfinite(self) -> int:
        """Steps whose finite check failed (their update was dropped or raised)."""
        self._flush()
        return self._nonfinite

    @property
    def nbatches(self) -> int:
        self._flush()
        return sum(len(x) for x in self._losses)

    def losses(self) -> np.ndarray:
        """Per-batch losses, period scaling undone (float32)."""
        self._flush()
        return np.concatenate(self._losses) if self._losses else np.zeros(0, np.float32)

    def loss(self) -> tuple[float, float]:
        """(loss, uncertainty): mean and standard error, or sum and standard deviation."""
        values = self.losses().astype(np.float64)
        n = len(values)
        if n == 0:
            return 0.0, math.nan
        mean = values.sum() / n
        var = max(float((values * values).sum() / n - mean * mean), 0.0)
        value = float(mean) if self._per_datapoint else float(values.sum())
        if n < 2:
            return value, math.nan
        unc = math.sqrt(var / (n - 1)) if self._per_datapoint else math.sqrt(var * n / (n - 1))
        return value, unc

    def accuracy(self) -> tuple[float, float]:
        """(accuracy, uncertainty); NaN without predictions or data."""
        self._flush()
        if not self._has_ncorrect or self.ndata == 0:
            return math.nan, math.nan
        acc = self._ncorrect / self.ndata
        unc = math.sqrt(acc * (1 - acc) / (self.ndata - 1)) if self.ndata >= 2 else math.nan
        return acc, unc

    def pred(self) -> np.ndarray:
        """All predictions so far, in order."""
        self._flush()
        return np.concatenate(self._preds) if self._preds else np.zeros(0, np.int32)

    def to_json(self) -> dict:
        """The statistics as JSON-serialisable values (predictions are not kept)."""
        return {"losses": [float(v) for v in self.losses()], "ncorrect": self._ncorrect,
                "has_ncorrect": self._has_ncorrect, "per_datapoint": self._per_datapoint,
                "nonfinite": self._nonfinite, "ndata": self.ndata}

    @classmethod
    def from_json(cls, obj, where: str = "result") -> Result:
        """The inverse of `to_json`; `JGraphError` naming the field if `obj` is malformed."""
        kinds = {"losses": list, "ncorrect": int, "has_ncorrect": bool,
                 "per_datapoint": (bool, type(None)), "nonfinite": int, "ndata": int}
        if not isinstance(obj, dict) or set(obj) != set(kinds):
            raise JGraphError(f"{where} must be an object with fields {sorted(kinds)}")
        for name, kind in kinds.items():
            value = obj[name]
            wrong = isinstance(value, bool) and kind is int
            if wrong or not isinstance(value, kind) or (kind is int and value < 0):
                raise JGraphError(f"{where}.{name} is {value!r:.60}, not a valid "
                                  f"{getattr(kind, '__name__', 'value')}")
        losses = obj["losses"]
        if not all(isinstance(v, float | int) and not isinstance(v, bool) for v in losses):
            raise JGraphError(f"{where}.losses must be a list of numbers")
        r = cls()
        if losses:
            r._losses.append(np.asarray(losses, np.float32))
        r._ncorrect, r._has_ncorrect = obj["ncorrect"], obj["has_ncorrect"]
        r._per_datapoint, r._nonfinite, r.ndata = (obj["per_datapoint"], obj["nonfinite"],
                                                   obj["ndata"])
        return r
