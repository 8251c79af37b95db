"""A working Keras 3 script (import keras / tf.keras) made mixed-precision by one line.

Run: python examples/keras3_enable.py [--dtype bfloat16] [--epochs 3]

Keras 3 with the TensorFlow backend (the default; ``tf.keras`` in TensorFlow
2.21). ``tfamp.enable(model)`` rewrites the training, evaluation and prediction
steps and, for float16, wraps the optimizer in tfamp's loss-scale optimizer:
the history gains ``loss_scale`` and ``skipped_steps``.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfamp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16, 16, 1)).astype("float32")
    y = (x[:, :8].mean(axis=(1, 2, 3)) > x[:, 8:].mean(axis=(1, 2, 3))).astype("int64")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(2),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    tfamp.enable(model, dtype=args.dtype)  # <- the one added line

    history = model.fit(x, y, epochs=args.epochs, batch_size=64, validation_split=0.2,
                        verbose=2)
    print(f"final loss {history.history['loss'][-1]:.4f}, "
          f"val accuracy {history.history['val_accuracy'][-1]:.3f}")
    if "loss_scale" in history.history:
        print("loss scale per epoch:", history.history["loss_scale"],
              "skipped steps:", history.history["skipped_steps"][-1])
    print(model.train_function.reports[0].summary_line())


if __name__ == "__main__":
    main()
