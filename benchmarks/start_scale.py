"""Skipped steps and loss of the first steps with and without the start-scale probe.

Runs a from-scratch Keras 3 model (default: keras.applications.ResNet50,
weights=None, 64x64, batch 8, synthetic data) for a few steps under
``tfamp.enable`` with ``initial_scale="auto"`` (the probe) and with the old
fixed start 2**15, and in float32; prints per-step loss, loss scale and skipped
steps, the probe's cost and the time of a training step for comparison.

    python benchmarks/start_scale.py [--model ResNet50] [--size 64] [--batch 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run(mode: str, args) -> dict:
    import keras

    import tfamp

    keras.utils.set_random_seed(0)
    build = getattr(keras.applications, args.model)
    model = build(weights=None, input_shape=(args.size, args.size, 3), classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    if mode != "float32":
        tfamp.enable(model, initial_scale="auto" if mode == "auto" else float(mode),
                     verbose=False)
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.normal(size=(n, args.size, args.size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(n,))

    class PerStep(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rows, self.started = [], None

        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            row = {k: float(v) for k, v in (logs or {}).items()}
            row["seconds"] = time.perf_counter() - self.started
            self.rows.append(row)

    per_step = PerStep()
    started = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[per_step])
    total = time.perf_counter() - started
    state = getattr(model, "_tfamp_state", None)
    found = getattr(state, "start_scale", None) if state is not None else None
    return {"mode": mode, "fit_seconds": total, "steps": per_step.rows,
            "start_scale": None if not found else {
                "scale": found.scale, "max_abs": found.max_abs, "where": found.where,
                "weight_max": found.weight_max, "seconds": found.seconds,
                "underflow_share": found.underflow_share}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ResNet50")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default="auto,32768,float32")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        result = run(mode, args)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
