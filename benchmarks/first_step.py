"""Time to the first finished training step: float32, Keras's mixed policy, tfamp.

Each run is a fresh process (so imports, tracing, the rewrite and compilation
all count) that builds a Keras 3 ``keras.applications`` model with random
weights and calls ``fit`` on one synthetic epoch; the time is from process start
to the end of the first batch (a callback), and the whole epoch. Modes take
turns over ``--rounds`` so a change of the machine's speed lands on all of them.

    python benchmarks/first_step.py [--model resnet50] [--size 64] [--batch 8] [--rounds 2]

Modes: fp32; keras_mf16 (``mixed_float16`` policy, Keras's LossScaleOptimizer);
tfamp (the same script as fp32 under ``TFAMP_ENABLE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCRIPT = r'''
import json, sys, time
import numpy as np
import keras
model_name, size, batch, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "keras_mf16":
    keras.mixed_precision.set_global_policy("mixed_float16")
builders = {"resnet50": keras.applications.ResNet50,
            "mobilenetv2": keras.applications.MobileNetV2,
            "efficientnetb0": keras.applications.EfficientNetB0}
keras.utils.set_random_seed(0)
model = builders[model_name](input_shape=(size, size, 3), weights=None, classes=10)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
x = np.random.default_rng(0).uniform(size=(batch * 4, size, size, 3)).astype("float32")
y = np.zeros((batch * 4,), "int64")
marks = {}

class Mark(keras.callbacks.Callback):
    def on_train_batch_end(self, index, logs=None):
        if index == 0:
            marks["first"] = time.time()

model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[Mark()])
marks["epoch"] = time.time()
print(json.dumps(marks))
'''

MODES = ("fp32", "keras_mf16", "tfamp")


def run_once(model: str, size: int, batch: int, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if mode == "tfamp":
        env.update(TFAMP_ENABLE="1", TFAMP_VERBOSITY="0")
    start = time.time()
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, str(size), str(batch),
                           "fp32" if mode == "tfamp" else mode],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-2000:]}")
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    return {"first": marks["first"] - start, "epoch": marks["epoch"] - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "mobilenetv2",
                                                                "efficientnetb0"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            results[mode].append(run_once(args.model, args.size, args.batch, mode))
    keras_first = statistics.median(r["first"] for r in results["keras_mf16"])
    print(f"{args.model} {args.size}x{args.size} batch {args.batch}, {args.rounds} rounds "
          f"(median; seconds from process start)")
    print("| mode | first step | epoch of 4 steps | first step vs Keras mixed_float16 |")
    print("|---|---|---|---|")
    for mode in MODES:
        first = statistics.median(r["first"] for r in results[mode])
        epoch = statistics.median(r["epoch"] for r in results[mode])
        print(f"| {mode} | {first:.1f} | {epoch:.1f} | {first / keras_first:.2f}x |")


if __name__ == "__main__":
    main()
