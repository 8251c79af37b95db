"""The adapter: every fact where tf_keras and Keras 3 differ, for the one lifecycle.

Everything else in ``tfamp.keras`` is written once against ``KerasFlavour``:
which classes a model, an optimizer and Keras's own loss-scale optimizer are;
how Keras builds a train / test / predict function and where tfamp puts its
rewrite in (``make_step_function``); the name of the epoch-end metrics method;
whether per-replica logs are summed; how Keras cuts arrays into batches and
unpacks a batch; which mixed policy is in force; how variables are named; the
layer graph the range probe reads.

=============================  ===========================  ==========================
fact                           tf_keras                     Keras 3 (TensorFlow backend)
=============================  ===========================  ==========================
step functions                 ``make_*_function`` returns  a Python function around
                               a ``tf.function``: wrapped   two tf.functions: the
                               in ``RewrittenFunction``     first (the step) is
                                                            rewritten, the loop calls it
epoch-end metrics method       ``_validate_and_get_         ``_get_metrics_result_or_
                               metrics_result``             logs``
per-replica logs               summed (read tfamp's once)   averaged
array batches                  ``TensorLikeDataAdapter``    ``ArrayDataAdapter``
a skipped step's iterations    counted (tf_keras's rule)    not counted (Keras 3's rule)
mixed policy                   ``mixed_precision.           ``config.dtype_policy()``
                               global_policy()``
=============================  ===========================  ==========================
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import sys
import threading
from types import ModuleType

log = logging.getLogger("tfamp")

TF_KERAS = "tf_keras"
KERAS3 = "keras3"


def keras3_module() -> ModuleType | None:
    """The Keras 3 module (``import keras``) if it is Keras 3, else None."""
    keras = sys.modules.get("keras")
    if keras is None:
        # Importing Keras 3 draws from Python's global random stream (rich's
        # style ids): in a tf_keras program that would move the script's own
        # random.choice / shuffle after its first enabled fit.
        state = random.getstate()
        try:
            import keras
        except ImportError:
            return None
        finally:
            random.setstate(state)
    return keras if str(getattr(keras, "__version__", "0")).startswith("3") else None


@dataclasses.dataclass(frozen=True)
class KerasFlavour:
    """The Keras a model was built with.

    Attributes:
      name: "tf_keras" or "keras3".
      keras: the module (``tf_keras`` or ``keras``).
    """

    name: str
    keras: ModuleType

    @property
    def is_keras3(self) -> bool:
        return self.name == KERAS3

    @property
    def label(self) -> str:
        """The Keras's name for messages."""
        return "Keras 3" if self.is_keras3 else "tf_keras"

    # -- classes -----------------------------------------------------------------

    @property
    def model_class(self) -> type:
        return self.keras.Model

    @property
    def optimizer_base(self) -> type:
        return self.keras.optimizers.Optimizer

    def is_legacy_optimizer(self, optimizer) -> bool:
        """Is `optimizer` one of tf_keras's legacy optimizers
        (``keras.optimizers.legacy.*``), which tfamp wraps in its
        ``LegacyLossScaleOptimizer``? (Keras 3 has none.)"""
        if self.is_keras3:
            return False
        return isinstance(optimizer, self.keras.optimizers.legacy.Optimizer)

    @property
    def keras_loss_scale_optimizer(self) -> type:
        """Keras's own LossScaleOptimizer class."""
        if self.is_keras3:
            return self.keras.optimizers.LossScaleOptimizer
        return self.keras.mixed_precision.LossScaleOptimizer

    @property
    def callback_base(self) -> type:
        return self.keras.callbacks.Callback

    # -- fit's plumbing ------------------------------------------------------------

    @property
    def metrics_method(self) -> str:
        """The method Keras re-reads its metrics with at an epoch's end."""
        if self.is_keras3:
            return "_get_metrics_result_or_logs"
        return "_validate_and_get_metrics_result"

    @property
    def sums_replica_logs(self) -> bool:
        """tf_keras sums the logs of the replicas (so tfamp reads its values once)."""
        return not self.is_keras3

    def show_logs_per_step(self, names: tuple[str, ...]) -> None:
        """Makes fit's progress bar show the logs `names` as each step's own values.

        tf_keras's ``Progbar`` shows a log that is not one of the model's metrics as
        its running mean over the epoch: after one skipped step tfamp's logs read
        ``loss_scale: 21845.3333 - skipped_steps: 0.6667`` (History had them right;
        a helper's simple_audio run, session 44). Its ``ProgbarLogger`` keeps the
        names it shows as they are in ``stateful_metrics``; for an enabled model
        `names` join them (one patch of the class, once). Keras 3 shows them as
        they are already.
        """
        if self.is_keras3:
            return
        _PROGBAR_NAMES.update(names)
        from tf_keras.src import callbacks

        logger = callbacks.ProgbarLogger
        if getattr(logger, "_tfamp_names_kept", False):
            return
        original = logger._maybe_init_progbar

        @functools.wraps(original)
        def _maybe_init_progbar(self):
            original(self)
            if getattr(getattr(self, "model", None), "_tfamp_state", None) is not None:
                self.stateful_metrics = set(self.stateful_metrics) | _PROGBAR_NAMES
                self.progbar._update_stateful_metrics(self.stateful_metrics)

        logger._maybe_init_progbar = _maybe_init_progbar
        logger._tfamp_names_kept = True

    def flatten_logs(self, model, logs: dict):
        """`logs` as ``train_on_batch(return_dict=False)`` returns them: values in
        the model's metric order, a single one as itself."""
        if self.is_keras3:
            return model._flatten_metrics_in_order(logs)
        from tf_keras.src.engine.training import flatten_metrics_in_order

        return flatten_metrics_in_order(logs, model.metrics_names)

    def unpack_batch(self, batch):
        """(x, y, sample_weight) of a batch, as Keras unpacks it."""
        if self.is_keras3:
            from keras.src.trainers.data_adapters import data_adapter_utils

            return data_adapter_utils.unpack_x_y_sample_weight(batch)
        return self.keras.utils.unpack_x_y_sample_weight(batch)

    def pack_batch(self, x, y=None, sample_weight=None):
        """The batch ``unpack_batch`` took apart, as ``train_step`` receives it."""
        return self.keras.utils.pack_x_y_sample_weight(x, y, sample_weight)

    def own_train_step(self, cls):
        """`cls`'s ``train_step`` where the model class defines its own, else None."""
        step = getattr(cls, "train_step", None)
        return None if step is None or step is self.keras.Model.train_step else step

    def array_dataset(self, x, y, sample_weight, batch_size: int):
        """The dataset Keras's own array adapter builds from arrays (same elements)."""
        if self.is_keras3:
            from keras.src.trainers.data_adapters import array_data_adapter

            adapter = array_data_adapter.ArrayDataAdapter(
                x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=False)
            return adapter.get_tf_dataset()
        from tf_keras.src.engine import data_adapter

        adapter = data_adapter.TensorLikeDataAdapter(
            x, y, sample_weights=sample_weight, batch_size=batch_size, shuffle=False)
        return adapter.get_dataset()

    def steps_per_execution(self, model) -> int:
        """Batches one call of the model's train function takes (an int in Keras 3,
        a variable in tf_keras; 1 before compile)."""
        import numpy as np

        value = getattr(model, "steps_per_execution" if self.is_keras3
                        else "_steps_per_execution", None)
        try:
            return max(1, int(np.asarray(value.numpy() if hasattr(value, "numpy") else value)))
        except (TypeError, ValueError):
            return 1

    def distribute_strategy(self, model):
        """The model's tf.distribute strategy (the default one when it has none)."""
        import tensorflow as tf

        return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()

    # -- another mixed precision -----------------------------------------------------

    def mixed_policy(self, model) -> str | None:
        """The Keras mixed policy ("mixed_float16", ...) in force on `model`, or None."""
        if self.is_keras3:
            policy = self.keras.config.dtype_policy().name
        else:
            policy = self.keras.mixed_precision.global_policy().name
        if policy.startswith("mixed_"):
            return policy
        return mixed_policy_of_layers(model)

    def check_backend(self) -> None:
        """Raises unless Keras 3 runs on TensorFlow (tfamp rewrites TensorFlow graphs)."""
        if not self.is_keras3:
            return
        backend = self.keras.backend.backend()
        if backend != "tensorflow":
            raise ValueError(
                f"tfamp rewrites TensorFlow graphs, but Keras 3 is running on the "
                f"{backend!r} backend (KERAS_BACKEND={backend}), so there is no TensorFlow "
                f"graph to rewrite. Set KERAS_BACKEND=tensorflow before importing keras, "
                f"or use that backend's own mixed precision "
                f"(keras.mixed_precision.set_global_policy('mixed_float16')).")

    def set_policy_hint(self) -> str:
        """How to set the float32 policy in this Keras (for messages)."""
        if self.is_keras3:
            return "keras.config.set_dtype_policy('float32')"
        return "keras.mixed_precision.set_global_policy('float32')"

    # -- step functions ----------------------------------------------------------------

    def make_step_function(self, model, cls, attr: str, force: bool, rewrite):
        """Builds Keras's `attr` ("train_function", ...) with its step rewritten.

        Args:
          model, cls: the model and its class (whose ``make_*_function`` builds).
          attr: the function's attribute on the model.
          force: rebuild even if built.
          rewrite: tf.function -> its ``RewrittenFunction`` (the model's settings).

        Returns:
          the function now on the model (None when Keras built none), and whether
          it runs rewritten (False under ``run_eagerly=True``).
        """
        maker = getattr(cls, f"make_{attr.removesuffix('_function')}_function")
        if self.is_keras3:
            return _make_keras3_function(model, maker, attr, force, rewrite)
        return _make_tf_keras_function(model, maker, attr, force, rewrite)

    # -- layers and variables -------------------------------------------------------------

    def is_graph_network(self, model) -> bool:
        """True for Sequential / Functional models with known inputs (layer outputs exist)."""
        if self.is_keras3:
            from keras.src.models.functional import Functional

            if isinstance(model, self.keras.Sequential):
                model = getattr(model, "_functional", None)
            if not isinstance(model, Functional):
                return False
        elif not getattr(model, "_is_graph_network", False):
            return False
        try:
            return bool(model.inputs)
        except (AttributeError, ValueError):
            return False

    def is_input_layer(self, layer) -> bool:
        return isinstance(layer, self.keras.layers.InputLayer)

    def variable_label(self, variable) -> str:
        """"dense/kernel": Keras 3's variable path, tf_keras's name without ":0"."""
        if self.is_keras3:
            return variable.path
        return variable.name.split(":")[0]

    def has_loss(self, model) -> bool:
        """True if the model was compiled with a loss or computes its own."""
        if type(model).compute_loss is not self.keras.Model.compute_loss:
            return True
        if self.is_keras3:
            return getattr(model, "_compile_loss", None) is not None
        return bool(getattr(model, "compiled_loss", None))

    def is_tensorboard(self, callback) -> bool:
        return isinstance(callback, self.keras.callbacks.TensorBoard)


def layers_of(model, include_self: bool = True) -> list:
    """Every layer in `model` at any depth (and `model` itself if `include_self`).

    Both Kerases keep this behind the private ``_flatten_layers``; an object
    without it (not a Keras layer) has no layers but itself, and an older
    signature without keywords is read as its default (self included,
    recursive).
    """
    flatten = getattr(model, "_flatten_layers", None)
    if not callable(flatten):
        return [model] if include_self else []
    try:
        return list(flatten(include_self=include_self, recursive=True))
    except TypeError:  # (an older signature)
        return [layer for layer in flatten() if include_self or layer is not model]


def mixed_policy_of_layers(model) -> str | None:
    """The Keras mixed policy (e.g. "mixed_float16") some layer of `model` runs, or None.

    Both Kerases give every layer a ``dtype_policy`` whose name starts with
    "mixed_" under a mixed policy.
    """
    for layer in layers_of(model):
        name = getattr(getattr(layer, "dtype_policy", None), "name", None)
        if isinstance(name, str) and name.startswith("mixed_"):
            return name
    return None


def flavour_of(model) -> KerasFlavour:
    """The flavour of a tf_keras or Keras 3 model.

    Raises:
      TypeError: `model` is neither, saying what was received.
    """
    import tf_keras

    if isinstance(model, tf_keras.Model):
        return KerasFlavour(TF_KERAS, tf_keras)
    keras3 = keras3_module()
    if keras3 is not None and isinstance(model, keras3.Model):
        return KerasFlavour(KERAS3, keras3)
    raise TypeError(
        f"expected a Keras model: a Keras 3 keras.Model (import keras, or tf.keras) or a "
        f"tf_keras.Model; received {type(model).__module__}.{type(model).__name__}")


def all_flavours() -> list[KerasFlavour]:
    """Every Keras importable here (tf_keras first)."""
    import tf_keras

    flavours = [KerasFlavour(TF_KERAS, tf_keras)]
    keras3 = keras3_module()
    if keras3 is not None:
        flavours.append(KerasFlavour(KERAS3, keras3))
    return flavours


# -- how each Keras builds its step functions -----------------------------------------------

def _make_tf_keras_function(model, maker, attr: str, force: bool, rewrite):
    """tf_keras: ``make_*_function`` stores a tf.function (or, under TFAMP_ENABLE,
    already a RewrittenFunction): it is wrapped, or given the model's settings."""
    import tensorflow as tf

    from tfamp.runtime.runner import RewrittenFunction

    made = maker(model, force)
    current = model.__dict__.get(attr, made)
    # RewrittenFunction first: it is a tf.function (PolymorphicFunction) too.
    if isinstance(current, RewrittenFunction):
        rewritten = rewrite(current)
        if rewritten is not current:
            object.__setattr__(model, attr, rewritten)
        return rewritten, True
    if isinstance(current, tf.types.experimental.PolymorphicFunction):
        wrapped = rewrite(current)
        object.__setattr__(model, attr, wrapped)
        return wrapped, True
    return current, False


class StepFunctions:
    """Keras 3's Python ``train_function`` (or test, predict) with tfamp's parts.

    Calls through to Keras's function; ``rewritten`` holds the
    ``RewrittenFunction`` for the step, whose ``reports`` say what was converted;
    ``after_call(outputs)`` runs after each call (the lifecycle's point).
    """

    def __init__(self, keras_function, rewritten: list, after_call=None):
        self._keras_function = keras_function
        self.rewritten = rewritten
        self._after_call = after_call
        functools.update_wrapper(self, keras_function, updated=())

    @property
    def reports(self):
        return [report for fn in self.rewritten for report in fn.reports]

    def set_after_call(self, after_call) -> None:
        self._after_call = after_call

    def __call__(self, *args, **kwargs):
        outputs = self._keras_function(*args, **kwargs)
        if self._after_call is not None:
            self._after_call(outputs)
        return outputs


class _TfWithRewrittenStep:
    """Stands in for ``tf`` in Keras 3's trainer module while it builds its functions.

    ``function`` wraps the first function built (the step) in RewrittenFunction
    and builds the rest (loops calling the step) as plain tf.functions.
    """

    def __init__(self, rewrite):
        import tensorflow as tf

        self._tf = tf
        self._rewrite = rewrite
        self.rewritten: list = []

    def __getattr__(self, name):
        return getattr(self._tf, name)

    def function(self, func=None, **kwargs):
        from tfamp.runtime.plain import plain_function
        from tfamp.runtime.runner import RewrittenFunction

        if func is None:
            return lambda f: self.function(f, **kwargs)
        if isinstance(func, RewrittenFunction):
            return func
        made = plain_function(func, **kwargs)
        if self.rewritten:
            return made
        wrapped = self._rewrite(made)
        self.rewritten.append(wrapped)
        return wrapped


_build_lock = threading.Lock()
# The logs tf_keras's progress bar shows per step for an enabled model
# (``KerasFlavour.show_logs_per_step``).
_PROGBAR_NAMES: set[str] = set()


def _make_keras3_function(model, maker, attr: str, force: bool, rewrite):
    """Keras 3: while ``make_*_function`` runs, its trainer module sees a stand-in
    ``tf`` whose ``function`` rewrites the first function built (the step)."""
    from keras.src.backend.tensorflow import trainer as trainer_module

    current = model.__dict__.get(attr)
    if isinstance(current, StepFunctions) and not force:
        return current, True
    proxy = _TfWithRewrittenStep(rewrite)
    with _build_lock:
        saved = trainer_module.tf
        trainer_module.tf = proxy
        try:
            maker(model, force)
        finally:
            trainer_module.tf = saved
    made = model.__dict__.get(attr)
    if made is None or not proxy.rewritten:
        return made, False
    wrapped = StepFunctions(made, proxy.rewritten)
    object.__setattr__(model, attr, wrapped)
    return wrapped, True
