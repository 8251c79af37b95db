"""Time to the first finished training step: float32, Keras's mixed policy, tfamp.

Each run is a fresh process (so imports, tracing, the rewrite and compilation
all count) that builds a Keras 3 ``keras.applications`` model with random
weights and calls ``fit`` on one synthetic epoch; the time is from process start
to the end of the first batch (a callback), and the whole epoch. Modes take
turns over ``--rounds`` so a change of the machine's speed lands on all of them.

    python benchmarks/first_step.py [--model resnet50] [--size 64] [--batch 8] [--rounds 2]
    python benchmarks/first_step.py --model hub_bert --size 128   # with keras-hub installed

Where the time goes, per mode: import (TensorFlow, Keras; tfamp's hook under
TFAMP_ENABLE), build (the model and compile), then within the first step: trace
(TensorFlow tracing the step functions, outermost, without the rewrites nested
in it), rewrite (tfamp: reading the traced graph, the pass, importing the
result; "pass" and "graph import" are parts of it) and run (the rest of the
first step: XLA or executor compilation and the step itself).

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
marks = {"imported": time.time()}
model_name, size, batch, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spent = {"trace": 0.0, "rewrite": 0.0, "rewrite_in_trace": 0.0, "pass": 0.0, "import": 0.0}
depth = [0]

def timed(module, name, key, outermost=False):
    inner = getattr(module, name)
    def wrapper(*args, **kwargs):
        if outermost and depth[0]:
            return inner(*args, **kwargs)
        depth[0] += outermost
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            depth[0] -= outermost
            spent[key] += took
            if key == "rewrite" and depth[0]:
                spent["rewrite_in_trace"] += took
    setattr(module, name, wrapper)

from tensorflow.python.eager.polymorphic_function import tracing_compilation
timed(tracing_compilation, "trace_function", "trace", outermost=True)
if "tfamp.runtime.runner" in sys.modules:  # TFAMP_ENABLE activated it on `import keras`
    runner = sys.modules["tfamp.runtime.runner"]
    timed(runner, "rewrite_concrete_function", "rewrite")
    timed(runner, "rewrite_graph_def", "pass")
    timed(runner, "_import_as_func_graph", "import")
if mode == "keras_mf16":
    keras.mixed_precision.set_global_policy("mixed_float16")
builders = {"resnet50": keras.applications.ResNet50,
            "mobilenetv2": keras.applications.MobileNetV2,
            "efficientnetb0": keras.applications.EfficientNetB0}
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
y = np.zeros((batch * 4,), "int64")
if model_name == "hub_bert":  # keras-hub (not a tfamp dependency): BERT, size = sequence
    import keras_hub
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30522, num_layers=4, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=size)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                preprocessor=None)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = {"token_ids": rng.integers(0, 30522, (batch * 4, size)).astype("int32"),
         "segment_ids": np.zeros((batch * 4, size), "int32"),
         "padding_mask": np.ones((batch * 4, size), "int32")}
else:
    model = builders[model_name](input_shape=(size, size, 3), weights=None, classes=10)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = rng.uniform(size=(batch * 4, size, size, 3)).astype("float32")
marks["built"] = time.time()

class Mark(keras.callbacks.Callback):
    def on_train_batch_end(self, index, logs=None):
        if index == 0:
            marks["first"] = time.time()

marks["fit"] = time.time()
model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[Mark()])
marks["epoch"] = time.time()
marks.update(spent)
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
    first_call = marks["first"] - marks["fit"]
    trace = marks["trace"] - marks["rewrite_in_trace"]
    return {"first": marks["first"] - start, "epoch": marks["epoch"] - start,
            "import": marks["imported"] - start, "build": marks["built"] - marks["imported"],
            "trace": trace, "rewrite": marks["rewrite"], "pass": marks["pass"],
            "graph import": marks["import"],
            "run": first_call - trace - marks["rewrite"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50",
                        choices=["resnet50", "mobilenetv2", "efficientnetb0", "hub_bert"],
                        help="hub_bert: keras-hub BERT (4 layers, 256 wide; --size is the "
                             "sequence length), needs keras-hub installed")
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
    parts = ("import", "build", "trace", "rewrite", "pass", "graph import", "run")
    print("| mode | first step | epoch of 4 steps | first step vs Keras mixed_float16 | "
          + " | ".join(parts) + " |")
    print("|---" * (4 + len(parts)) + "|")
    for mode in MODES:
        first = statistics.median(r["first"] for r in results[mode])
        epoch = statistics.median(r["epoch"] for r in results[mode])
        split = " | ".join(f"{statistics.median(r[k] for r in results[mode]):.1f}"
                           for k in parts)
        print(f"| {mode} | {first:.1f} | {epoch:.1f} | {first / keras_first:.2f}x | {split} |")


if __name__ == "__main__":
    main()
