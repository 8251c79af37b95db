"""Which Keras a model belongs to (tf_keras or Keras 3), and the few facts that differ.

The range probe, the first-non-finite-op localiser and ``tfamp inspect
--ranges`` are written once against this small interface: the Keras module,
whether the model is a graph of layers (Sequential / Functional), how a
variable is named, whether the model has a loss to back-propagate, and the
TensorBoard callback class.
"""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType

TF_KERAS = "tf_keras"
KERAS3 = "keras3"


def keras3_module() -> ModuleType | None:
    """The Keras 3 module (``import keras``) if it is Keras 3, else None."""
    keras = sys.modules.get("keras")
    if keras is None:
        try:
            import keras
        except ImportError:
            return None
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
