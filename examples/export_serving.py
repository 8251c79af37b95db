"""Export a Keras 3 model as a mixed-precision SavedModel for serving, then serve it.

    python examples/export_serving.py [OUT_DIR]

Builds a small image classifier, exports it with Keras (``model.export``), turns that
SavedModel into a float16 one with ``tfamp.export`` (checked against float32 first;
weights stored in float16), and loads the result with TensorFlow alone, as TF Serving
or any other process without tfamp would. The same from the shell:

    tfamp export OUT_DIR/float32 -o OUT_DIR/float16
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfamp  # noqa: E402


def main(out: Path) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3), name="image"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.export(str(out / "float32"), verbose=False)

    # Checked on random inputs here; pass inputs=["batch.npz"] to check on real data.
    report = tfamp.export(out / "float32", out / "float16", overwrite=True)
    print(report.render_text())

    # Serving needs TensorFlow only: the signature is the one Keras exported.
    served = tf.saved_model.load(str(out / "float16")).signatures["serving_default"]
    images = np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype(np.float32)
    probabilities = served(image=tf.constant(images))["output_0"]
    print("served:", probabilities.dtype.name, probabilities.shape,
          "classes", np.argmax(probabilities, axis=-1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
