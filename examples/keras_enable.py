"""A working tf_keras script made mixed-precision by one line: tfamp.enable(model).

Run: python examples/keras_enable.py [--dtype bfloat16] [--epochs 5]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tf_keras as keras  # noqa: E402

import tfamp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 28, 28, 1)).astype("float32")
    y = (x[:, :14].mean(axis=(1, 2, 3)) > x[:, 14:].mean(axis=(1, 2, 3))).astype("int64")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Conv2D(16, 3, activation="relu", input_shape=(28, 28, 1)),
        keras.layers.BatchNormalization(),
        keras.layers.MaxPooling2D(),
        keras.layers.Dropout(0.1),
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
