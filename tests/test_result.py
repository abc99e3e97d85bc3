"""jg.Result: ggml_opt_result's formulas on hand numbers."""

import math

import numpy as np

import jgraph as jg
from jgraph.training import StepOutput


def out(loss, period=1, per_datapoint=True, ndata=1, pred=None, ncorrect=None):
    return StepOutput(np.float32(loss), pred, ncorrect, ndata, period, per_datapoint)


def test_empty_result_is_zero_and_nan():
    r = jg.Result()
    loss, unc = r.loss()
    assert loss == 0.0 and math.isnan(unc) and r.ndata == 0
    assert all(math.isnan(v) for v in r.accuracy())


def test_mean_loss_standard_error_and_period_undone():
    r = jg.Result()
    for v in (1.0, 2.0, 3.0, 4.0):
        r.add(out(v / 4, period=4))  # stored as computed (scaled by 1/period)
    loss, unc = r.loss()
    assert loss == 2.5
    assert abs(unc - math.sqrt(1.25 / 3)) < 1e-12  # population var 1.25, / (n - 1)


def test_sum_loss_is_a_sum_with_sample_std():
    r = jg.Result()
    for v in (3.0, 4.0, 5.0, 6.0, 7.0, 8.0):
        r.add(out(v, period=5, per_datapoint=False))  # sum losses are never scaled
    loss, unc = r.loss()
    assert loss == 33.0 and abs(unc - math.sqrt(3.5)) < 1e-12


def test_one_batch_has_nan_uncertainty():
    r = jg.Result()
    r.add(out(2.0))
    assert r.loss()[0] == 2.0 and math.isnan(r.loss()[1])


def test_accuracy_binomial_and_nan_without_predictions():
    r = jg.Result()
    r.add(out(1.0, ndata=4, pred=np.array([0, 1, 2, 3]), ncorrect=np.int32(3)))
    r.add(out(1.0, ndata=4, pred=np.array([1, 1, 1, 1]), ncorrect=np.int32(1)))
    acc, unc = r.accuracy()
    assert acc == 0.5 and abs(unc - math.sqrt(0.25 / 7)) < 1e-12
    np.testing.assert_array_equal(r.pred(), [0, 1, 2, 3, 1, 1, 1, 1])
    r.add(out(1.0, ndata=4))  # an output without predictions: accuracy undefined
    assert all(math.isnan(v) for v in r.accuracy())


def test_stacked_outputs_count_as_batches():
    r = jg.Result()
    r.add(StepOutput(np.array([0.5, 1.0], np.float32), np.zeros((2, 3)), np.array([1, 2]), 3, 2,
                     True))
    assert r.nbatches == 2 and r.ndata == 6
    assert r.loss()[0] == 1.5 and r.accuracy()[0] == 0.5
