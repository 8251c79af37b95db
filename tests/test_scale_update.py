"""scale_update's verdict: the scale update and the apply-or-skip predicate agree.

``update_scale`` reads its verdict off the whole record of first bad gradients
(``_finite_from_record``, so that XLA merges the scale variables' selects) while
``apply_if_finite`` uses ``all_finite``: a step the optimizer skips must be the
step whose scale is halved, and the other way round.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from tfamp.keras import scale_update

FLAGS = [
    [],
    [True],
    [False],
    [True] * 5,
    [True, False],
    [False, True, False, True, False, False],
    [True] * 200 + [False],
    [False] + [True] * 200,
]


def _state():
    return dict(scale=tf.Variable(1024.0), good_steps=tf.Variable(0, dtype=tf.int64),
                skipped_steps=tf.Variable(0, dtype=tf.int64),
                floor_skips=tf.Variable(0, dtype=tf.int64),
                first_nonfinite=tf.Variable([-1] * scale_update.BAD_NAMES_KEPT, dtype=tf.int32))


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"{len(f)}-{f.count(False)}bad")
def test_update_verdict_is_all_finite(flags, graph):
    state = _state()

    def step(flags):
        finite, _ = scale_update.update_scale(flags, **state, dynamic=True, growth_interval=2000,
                                              min_scale=1.0)
        return finite, scale_update.all_finite(flags)

    run = tf.function(step) if graph else step
    finite, expected = run(tf.constant(flags, tf.bool, shape=[len(flags)]))
    assert bool(finite) == bool(expected) == all(flags)
    bad = [i for i, f in enumerate(flags) if not f][:scale_update.BAD_NAMES_KEPT]
    if all(flags):
        assert float(state["scale"].numpy()) == 1024.0
        assert int(state["good_steps"].numpy()) == 1
        assert state["first_nonfinite"].numpy().tolist() == [-1] * scale_update.BAD_NAMES_KEPT
    else:
        assert float(state["scale"].numpy()) == 512.0
        assert int(state["good_steps"].numpy()) == 0
        assert int(state["skipped_steps"].numpy()) == 1
        padded = bad + [-1] * (scale_update.BAD_NAMES_KEPT - len(bad))
        assert state["first_nonfinite"].numpy().tolist() == padded


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"{len(f)}-{f.count(False)}bad")
def test_kept_bad_indices(flags, graph):
    """The record's new value comes out of the reduction: the first bad indices on a
    bad step, the previous record (whatever it holds) on a finite one."""
    previous = [7, -1, 3]
    run = tf.function(scale_update.kept_bad_indices) if graph else scale_update.kept_bad_indices
    flags_tensor = tf.constant(flags, tf.bool, shape=[len(flags)])
    kept = run(flags_tensor, tf.constant(previous, tf.int32))
    bad = [i for i, f in enumerate(flags) if not f][:scale_update.BAD_NAMES_KEPT]
    padded = bad + [-1] * (scale_update.BAD_NAMES_KEPT - len(bad))
    assert kept.numpy().tolist() == (previous if all(flags) else padded)
    assert scale_update.first_bad_indices(flags_tensor).numpy().tolist() == padded


def test_finite_step_keeps_the_record():
    state = _state()
    state["first_nonfinite"].assign([4, 9, -1])
    scale_update.update_scale(tf.constant([True, True]), **state, dynamic=True,
                              growth_interval=2000, min_scale=1.0)
    assert state["first_nonfinite"].numpy().tolist() == [4, 9, -1]


def test_step_log_values_are_new_values():
    """The step's logs hold the scale and the skipped steps as numbers equal to the
    variables', the scale in a dtype of its own (an XLA output that is not the
    variable's new value: no copy kernel)."""
    from tfamp.keras.scale_state import step_log_values

    class Owner:
        skipped_steps = tf.Variable(3, dtype=tf.int64)
        scale = tf.Variable(2.0**15)

        def scale_tensor(self):
            return tf.convert_to_tensor(self.scale)

    scale, skipped = step_log_values(Owner())
    assert scale.dtype != Owner.scale.dtype and float(scale) == 2.0**15
    assert int(skipped) == 3
