"""Golden CLI cases: the fixtures they read and the commands they run.

Regenerate the expected outputs (then review the diff) with:
    python tests/golden/cases.py
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent
REPO = GOLDEN.parent.parent

# Built in a fresh interpreter so node names do not depend on what ran before.
BUILD_FIXTURES = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    folder = sys.argv[1]
    keras.utils.set_random_seed(0)
    layers = keras.layers
    mlp = keras.Sequential([
        layers.Dense(16, activation="relu", input_shape=(8,), name="hidden"),
        layers.Dense(4, name="logits"),
    ], name="mlp")
    mlp.compile(optimizer=keras.optimizers.Adam(name="adam"),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    mlp.save(f"{folder}/mlp.keras")
    mlp.save(f"{folder}/mlp_savedmodel")

    def attention(q, k):
        scores = tf.matmul(q, k, transpose_b=True, name="scores")
        weights = tf.nn.softmax(tf.reshape(tf.exp(scores, name="exp"), [4, 4],
                                           name="reshape"), name="softmax")
        return tf.matmul(weights, k, name="context")

    spec = tf.TensorSpec([4, 4], tf.float32)
    graph_def = tf.function(attention).get_concrete_function(spec, spec).graph.as_graph_def()
    with open(f"{folder}/attention.pbtxt", "w") as f:
        f.write(str(graph_def))
""")

# name -> tfamp arguments ({dir} is the fixture folder)
CASES = {
    "keras_train_summary.txt": ["inspect", "{dir}/mlp.keras"],
    "keras_predict_nodes.txt": ["inspect", "{dir}/mlp.keras", "--graph", "predict", "--nodes"],
    "saved_model_summary.txt": ["inspect", "{dir}/mlp_savedmodel"],
    "saved_model_nodes.txt": ["inspect", "{dir}/mlp_savedmodel", "--nodes"],
    "saved_model_full_names.txt": ["inspect", "{dir}/mlp_savedmodel", "--nodes", "--op",
                                   "MatMul", "--full-names"],
    "saved_model_why.txt": ["inspect", "{dir}/mlp_savedmodel", "--why",
                            "_wrapped_model/mlp/logits/BiasAdd"],
    "attention_nodes.txt": ["inspect", "{dir}/attention.pbtxt", "--nodes"],
    "attention_why.txt": ["inspect", "{dir}/attention.pbtxt", "--why", "softmax"],
    "attention_bf16.json": ["inspect", "{dir}/attention.pbtxt", "--dtype", "bfloat16",
                            "--format", "json"],
}


def environment() -> dict:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO),
            "TFAMP_ENABLE": ""}


def build_fixtures(folder: Path) -> None:
    subprocess.run([sys.executable, "-c", BUILD_FIXTURES, str(folder)], check=True,
                   env=environment(), capture_output=True, timeout=300)


def run_case(name: str, folder: Path) -> subprocess.CompletedProcess:
    argv = [arg.format(dir=folder) for arg in CASES[name]]
    return subprocess.run([sys.executable, "-m", "tfamp", *argv], capture_output=True,
                          text=True, env=environment(), timeout=300, cwd=str(folder))


def normalize(text: str, folder: Path) -> str:
    return text.replace(str(folder), "<fixtures>")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_fixtures(folder)
        for case in CASES:
            result = run_case(case, folder)
            if result.returncode != 0:
                sys.exit(f"{case}: exit {result.returncode}\n{result.stderr}")
            (GOLDEN / case).write_text(normalize(result.stdout, folder))
            print(f"wrote {case}")
