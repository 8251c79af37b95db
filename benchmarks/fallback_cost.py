"""What the automatic float32 fallback costs (issue 21.2): steps lost, decision, re-rewrite.

A model whose first layer is a frozen projection with outputs ~2e5 (inf in
float16) trains under ``tfamp.enable``; a callback records when each batch
ends. Reported: steps skipped before the fallback, the decision's time (the
probes on the host), the step that ran first after it (new trace, rewrite and
run) against the median step and against the very first step (trace,
rewrite, run).

    python benchmarks/fallback_cost.py [--flavour keras3|tf_keras] [--model pipe|mobilenetv2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build(k, name: str):
    k.utils.set_random_seed(0)
    if name == "pipe":
        inputs = k.Input((16,))
        frozen = k.layers.Dense(32, name="frozen",
                                kernel_initializer=k.initializers.RandomNormal(stddev=30.0))
        h = k.layers.Rescaling(1e-5)(frozen(inputs))
        h = k.layers.Dense(16, activation="relu")(h)
        outputs = k.layers.Dense(1)(h)
        loss, shape, classes = "mse", (16,), None
    else:  # a frozen 1x1 projection of raw 0-1000 pixels, then MobileNetV2
        inputs = k.Input((64, 64, 3))
        frozen = k.layers.Conv2D(3, 1, name="frozen",
                                 kernel_initializer=k.initializers.RandomNormal(stddev=100.0))
        h = k.layers.Rescaling(1e-5)(frozen(inputs))
        backbone = k.applications.MobileNetV2(input_shape=(64, 64, 3), weights=None,
                                              classes=10)
        outputs = backbone(h)
        loss, shape, classes = "sparse_categorical_crossentropy", (64, 64, 3), 10
    frozen.trainable = False
    model = k.Model(inputs, outputs, name=name)
    model.compile(optimizer=k.optimizers.Adam(1e-3), loss=loss)
    return model, shape, classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", default="keras3", choices=["keras3", "tf_keras"])
    parser.add_argument("--model", default="pipe", choices=["pipe", "mobilenetv2"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    import numpy as np

    if args.flavour == "tf_keras":
        import tf_keras as k
    else:
        import keras as k
    import tfamp

    model, shape, classes = build(k, args.model)
    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x = rng.uniform(0, 1000, size=(n, *shape)).astype("float32")
    y = (rng.integers(0, classes, size=(n,)) if classes
         else rng.normal(size=(n, 1)).astype("float32"))
    tfamp.enable(model, verbose=False)
    ends: list[float] = []

    class Clock(k.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                        callbacks=[Clock()])
    steps = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    state = model._tfamp_state.fallback
    decision = state.decisions[0]
    after = 2  # the fallback is applied after the second skipped step's call
    print(json.dumps({
        "flavour": args.flavour, "model": args.model, "moved": list(state.moved),
        "skipped": float(history.history["skipped_steps"][-1]),
        "decisions": [(d.kind, d.patterns, round(d.seconds, 2)) for d in state.decisions],
        "decision_s": round(decision.seconds, 3),
        "first_step_s": round(steps[0], 3),
        "step_with_decision_s": round(steps[after - 1], 3),
        "first_step_after_fallback_s": round(steps[after], 3),
        "median_step_s": round(statistics.median(steps[after + 1:]), 4),
        "final_loss": float(history.history["loss"][-1]),
    }))


if __name__ == "__main__":
    main()
