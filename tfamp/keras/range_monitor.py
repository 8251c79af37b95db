"""``tfamp.RangeMonitor``: the range probe during ``fit``.

``RangeMonitor`` is a Keras callback that runs the probe
(``tfamp.keras.range_probe``) on the first `steps` training batches and then
writes the text summary (log), JSON, HTML page and PNG to `output_dir`, and
log2 histograms to TensorBoard when a log directory is known.
``tfamp.enable(model, ranges=...)`` and ``TFAMP_RANGES`` add it to ``fit`` with
batches taken from ``fit``'s own data. ``RangeMonitor`` subclasses both Keras's
``Callback`` classes, so the same object goes into either ``fit``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tfamp.keras.flavour import all_flavours, keras3_module
from tfamp.keras.range_probe import (
    KerasRangeProbe,
    current_loss_scale,
    dynamic_settings,
    unpack_batch,
)
from tfamp.numerics import ranges as ranges_lib
from tfamp.numerics.monitor import (
    DEFAULT_OUTPUT_DIR,
    DEFAULT_STEPS,
    write_outputs,
    write_tensorboard,
)
from tfamp.numerics.range_report import RangeReport
from tfamp.numerics.ranges import TensorRange

log = logging.getLogger("tfamp")


def _callback_bases() -> tuple[type, ...]:
    """tf_keras's Callback, and Keras 3's when Keras 3 is installed: one RangeMonitor
    object goes into either Keras's ``fit``."""
    keras3 = keras3_module()
    return (keras.callbacks.Callback,) + ((keras3.callbacks.Callback,) if keras3 else ())


class RangeMonitor(*_callback_bases()):
    """Shows where a model's gradients sit against float16's limits (Keras callback).

    The same object works in a tf_keras ``fit`` and a Keras 3 (``import keras``
    / ``tf.keras``, TensorFlow backend) ``fit``: it is a callback of both.

    For the first `steps` training batches it runs ``KerasRangeProbe`` (a
    separate float32 forward and backward pass, no weight change) on a batch of
    `data`, then writes ranges.txt / .json / .html / .png to `output_dir` and
    logs the summary. ``report`` holds the RangeReport afterwards.

    Args:
      data: batches to probe: (x, y) arrays (split into `batch_size` rows), a
        batched tf.data.Dataset, or a list of (x, y[, sample_weight]) tuples.
      steps: batches to collect (3).
      batch_size: rows per batch when `data` is arrays (32).
      output_dir: where the files go ("tfamp_ranges"); None writes no files.
      tensorboard_dir: also write log2 histograms there (a TensorBoard
        callback's log_dir; ``tfamp.enable(ranges=...)`` finds it in ``fit``).
      png: write the PNG (needs matplotlib).

    Example:
      >>> model.fit(x, y, callbacks=[tfamp.RangeMonitor((x, y), output_dir="ranges")])
      >>> # then open ranges/ranges.html, or look at ranges/ranges.png
    """

    def __init__(self, data, *, steps: int = DEFAULT_STEPS, batch_size: int = 32,
                 output_dir: str | os.PathLike | None = DEFAULT_OUTPUT_DIR,
                 tensorboard_dir: str | os.PathLike | None = None, png: bool = True):
        for base in _callback_bases():  # each Keras's Callback sets its own fields
            base.__init__(self)
        if not isinstance(steps, int) or steps <= 0:
            raise ValueError(f"steps must be a positive integer, received {steps!r}")
        self._batches = _batches_from(data, batch_size, steps)
        self.steps = steps
        self.output_dir = output_dir
        self.tensorboard_dir = tensorboard_dir
        self.png = png
        self.report: RangeReport | None = None
        self.written: dict[str, Path] = {}
        self._probe: KerasRangeProbe | None = None
        self._tensors: list[TensorRange] = []
        self._done = 0
        self._scale: float | None = None

    # Keras 3's Callback has a read-only `model` property; tf_keras assigns it.
    @property
    def model(self):
        return self.__dict__.get("_model")

    @model.setter
    def model(self, value):
        self.__dict__["_model"] = value

    def set_model(self, model):
        self.model = model

    def on_train_begin(self, logs=None):
        self._probe, self._tensors, self._done, self.report = None, [], 0, None

    def on_train_batch_begin(self, batch, logs=None):
        if self._done >= self.steps or self._done >= len(self._batches):
            return
        if self._probe is None:
            self._probe = KerasRangeProbe(self.model)
        x, y, sample_weight = unpack_batch(self._batches[self._done])
        self._scale = current_loss_scale(self.model)
        ranges_lib.accumulate(self._tensors, self._probe.collect(x, y, sample_weight))
        self._done += 1
        if self._done == min(self.steps, len(self._batches)):
            self._finish()

    def on_train_end(self, logs=None):
        if self.report is None and self._done:
            self._finish()

    def _finish(self) -> None:
        self.report = RangeReport(
            model=self.model.name, steps=self._done, loss_scale=self._scale,
            tensors=self._tensors, notes=list(self._probe.notes),
            **dynamic_settings(self.model))
        log.info("%s", self.report.summary_text())
        if self.output_dir is not None:
            self.written = write_outputs(self.report, self.output_dir, png=self.png)
            log.warning("tfamp: value ranges of %r written to %s (open ranges.html; "
                        "picture: ranges.png). %s", self.model.name,
                        Path(self.output_dir).resolve(), self.report.recommendation())
        if self.tensorboard_dir is not None:
            write_tensorboard(self.report, self.tensorboard_dir)


def _batches_from(data, batch_size: int, steps: int) -> list:
    """Up to `steps` batches from arrays, a dataset or a list of batches."""
    if isinstance(data, tf.data.Dataset):
        return list(data.take(steps))
    if isinstance(data, list) and data and isinstance(data[0], tuple):
        return data[:steps]
    if isinstance(data, tuple) and 2 <= len(data) <= 3:
        x, y, *rest = data
        sample_weight = rest[0] if rest else None
        size = len(tf.nest.flatten(x)[0])
        batches = []
        for start in range(0, size, batch_size):
            if len(batches) == steps:
                break
            part = slice(start, start + batch_size)
            cut = (lambda a, part=part: None if a is None else a[part])  # noqa: E731
            batch = (tf.nest.map_structure(cut, x), tf.nest.map_structure(cut, y))
            if sample_weight is not None:
                batch += (cut(sample_weight),)
            batches.append(batch)
        return batches
    raise TypeError(
        f"RangeMonitor data must be (x, y) arrays, a batched tf.data.Dataset or a list of "
        f"(x, y) tuples, received {type(data).__name__}")


def batches_from_fit_args(args: Sequence, kwargs: dict, steps: int) -> list | None:
    """Batches for the probe taken from ``fit``'s own arguments (None if unusable).

    Arrays are cut into ``fit``'s batch_size (32 by default); a tf.data
    Dataset is read for its first `steps` batches (it must be re-iterable, as
    ``fit`` also needs it); generators and Sequences are not read.
    """
    x = args[0] if args else kwargs.get("x")
    y = args[1] if len(args) > 1 else kwargs.get("y")
    batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or 32
    if isinstance(x, tf.data.Dataset):
        return list(x.take(steps))
    if y is not None and all(isinstance(a, (np.ndarray, tf.Tensor))
                             for a in tf.nest.flatten(x) + tf.nest.flatten(y)):
        sample_weight = kwargs.get("sample_weight")
        data = (x, y) if sample_weight is None else (x, y, sample_weight)
        return _batches_from(data, int(batch_size), steps)
    return None


def monitor_for_fit(settings, args: Sequence, kwargs: dict) -> RangeMonitor | None:
    """A RangeMonitor for ``fit(*args, **kwargs)`` per ``tfamp.enable(ranges=...)``.

    Args:
      settings: the output directory (str / Path) or True for the default one.
      args, kwargs: fit's arguments (data and callbacks are read, not changed).

    Returns:
      the monitor, or None (with a warning) when fit's data cannot be re-read.
    """
    output_dir = DEFAULT_OUTPUT_DIR if settings is True else settings
    batches = batches_from_fit_args(args, kwargs, DEFAULT_STEPS)
    if not batches:
        log.warning("tfamp: ranges were requested but fit's data is not arrays or a "
                    "tf.data.Dataset; add tfamp.RangeMonitor(data=...) to callbacks "
                    "yourself.")
        return None
    callbacks = fit_callbacks(args, kwargs)
    if any(isinstance(c, RangeMonitor) for c in callbacks):
        return None
    tensorboard = next((c for c in callbacks
                        if any(f.is_tensorboard(c) for f in all_flavours())), None)
    return RangeMonitor(batches, steps=len(batches), output_dir=output_dir,
                        tensorboard_dir=getattr(tensorboard, "log_dir", None))


def fit_callbacks(args: Sequence, kwargs: dict) -> list:
    """fit's callbacks as a new list, in whichever form fit was given them: None,
    one callback (tensorflow/docs' simple_audio passes an EarlyStopping alone), a
    list or tuple, nested or not (Keras flattens them), or a CallbackList (its
    callbacks; fit adds History and the progress bar only where they are
    missing)."""
    value = args[5] if len(args) > 5 else kwargs.get("callbacks")
    if value is None:
        return []
    if any(isinstance(value, f.keras.callbacks.CallbackList) for f in all_flavours()):
        return list(value.callbacks)
    return tf.nest.flatten(value)


def fit_batch_source(args: Sequence, kwargs: dict):
    """A callable returning one batch of ``fit``'s data later (None if unusable).

    Arrays: a copy of the first batch is kept now (not the caller's arrays). A
    tf.data Dataset, or a keras.utils.Sequence / PyDataset (its batch 0), is only
    read when the callable is called.
    """
    x = args[0] if args else kwargs.get("x")
    if isinstance(x, tf.data.Dataset):
        def from_dataset():
            for batch in x.take(1):
                return batch
            return None
        return from_dataset
    if hasattr(x, "__getitem__") and hasattr(x, "on_epoch_end") and hasattr(x, "__len__"):
        # a keras.utils.Sequence / PyDataset (either Keras): its batches by index
        def from_sequence():
            return x[0] if len(x) else None
        return from_sequence
    batches = batches_from_fit_args(args, kwargs, 1)
    y = args[1] if len(args) > 1 else kwargs.get("y")
    if not batches and y is None and x is not None and all(
            isinstance(a, (np.ndarray, tf.Tensor)) for a in tf.nest.flatten(x)):
        # fit(x) alone (a contrastive or autoencoding step of the model's own)
        batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or 32
        batches = [tf.nest.map_structure(lambda a: a[:int(batch_size)], x)]
    if not batches:
        return lambda: None
    batch = tf.nest.map_structure(
        lambda a: None if a is None else np.array(a), batches[0])
    return lambda: batch
