"""``tfamp inspect`` on Keras files: Keras 3 and tf_keras, custom classes via --import."""

import json
import os
import subprocess
import sys
import textwrap

import keras as keras3
import pytest
import tf_keras

from tfamp import cli
from tfamp.inspect.graph_files import keras_flavour


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def mlp(keras, compiled):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    if compiled:
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    return model


@pytest.mark.parametrize("keras, flavour", [(keras3, "keras3"), (tf_keras, "tf_keras")])
@pytest.mark.parametrize("compiled", [True, False])
def test_inspect_reads_keras_files_of_both_kerases(capsys, tmp_path, keras, flavour, compiled):
    path = tmp_path / "model.keras"
    mlp(keras, compiled).save(str(path))
    assert keras_flavour(path) == flavour
    code, out, err = run(capsys, "inspect", str(path), "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    graph = "train" if compiled else "predict"
    assert report["function"] == f"model:{graph}"
    matmuls = [n for n in report["nodes"] if n["op"] == "MatMul"]
    # Forward pass: 2 MatMuls; the training step adds their gradients (2 more at least).
    assert len(matmuls) >= (4 if compiled else 2)
    assert all(n["converted"] for n in matmuls), [n["name"] for n in matmuls]
    assert report["converted"]["MatMul"] == len(matmuls)


def test_keras3_h5_file_is_read_with_keras3(capsys, tmp_path):
    path = tmp_path / "model.h5"
    mlp(keras3, False).save(str(path))
    assert keras_flavour(path) == "keras3"
    code, out, err = run(capsys, "inspect", str(path), "--format", "json")
    assert code == 0, err
    assert json.loads(out)["converted"]["MatMul"] == 2


LAYERS = {
    "k3": "import keras",
    "k2": "import tf_keras as keras",
}
LAYER_MODULE = textwrap.dedent("""
    @keras.saving.register_keras_serializable(package="edgepkg")
    class Scale(keras.layers.Layer):
        def __init__(self, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def call(self, x):
            return x * self.factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}
""")
SAVE_SCRIPT = textwrap.dedent("""
    import sys
    import keras, tf_keras
    from edgepkg import k2, k3
    for keras, module, name in ((keras, k3, "k3"), (tf_keras, k2, "k2")):
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), module.Scale()])
        model.compile(optimizer="adam", loss="mse")
        model.save(sys.argv[1] + f"/{name}.keras")
""")


def test_inspect_import_registers_custom_layers(capsys, tmp_path, monkeypatch):
    package = tmp_path / "edgepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, header in LAYERS.items():
        (package / f"{name}.py").write_text(header + "\n" + LAYER_MODULE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TFAMP_ENABLE", None)
    saved = subprocess.run([sys.executable, "-c", SAVE_SCRIPT, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-3000:]
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in LAYERS:
        path = str(tmp_path / f"{name}.keras")
        code, out, err = run(capsys, "inspect", path)
        assert code == 2 and out == ""
        assert err.strip() == (
            f"tfamp: error: {path}: class 'Scale' (registered name 'edgepkg>Scale', saved "
            f"from module 'edgepkg.{name}') is not registered: pass --import edgepkg.{name} "
            f"(the package that defines and registers it; repeatable) so its classes can be "
            f"rebuilt")
        code, out, err = run(capsys, "inspect", path, "--import", f"edgepkg.{name}",
                             "--format", "json")
        assert code == 0, err
        report = json.loads(out)
        assert report["converted"]["MatMul"] >= 2
        assert any(n["op"] == "Mul" and "scale" in n["name"] for n in report["nodes"])


def test_inspect_import_of_a_missing_module_is_one_line(capsys, tmp_path):
    path = tmp_path / "model.keras"
    mlp(keras3, False).save(str(path))
    code, _, err = run(capsys, "inspect", str(path), "--import", "no_such_module_xyz")
    assert code == 2
    assert err.startswith("tfamp: error: --import no_such_module_xyz: No module named")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("keras", [keras3, tf_keras])
@pytest.mark.parametrize("graph", ["train", "predict"])
def test_inspect_a_model_with_named_dict_inputs(capsys, tmp_path, keras, graph):
    """keras-hub models (and functional models with named inputs) take a dict."""
    inputs = {name: keras.Input((6,), name=name) for name in ("tokens", "segments")}
    merged = keras.layers.Concatenate()([inputs["tokens"], inputs["segments"]])
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(merged)))
    model.compile(optimizer="adam", loss="mse")
    path = tmp_path / "named.keras"
    model.save(str(path))
    code, out, err = run(capsys, "inspect", str(path), "--graph", graph, "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    assert report["function"] == f"named:{graph}"
    assert report["converted"]["MatMul"] >= (4 if graph == "train" else 2)


BROKEN_CONFIG_MODULE = textwrap.dedent("""
    import tf_keras as keras

    class Wide(keras.Model):
        def __init__(self, width=4, **kwargs):
            super().__init__(**kwargs)
            self.width = width
            self.dense = keras.layers.Dense(width)

        def call(self, x):
            return self.dense(x)

        def get_config(self):
            return {"hidden": self.width}  # not what __init__ takes
""")


def test_inspect_shows_the_loader_error_when_the_class_is_imported_but_does_not_rebuild(
        capsys, tmp_path, monkeypatch):
    (tmp_path / "brokencfg.py").write_text(BROKEN_CONFIG_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import brokencfg

    model = brokencfg.Wide()
    model(tf_keras.Input((3,)))
    path = tmp_path / "wide.keras"
    model.save(str(path))
    code, _, err = run(capsys, "inspect", str(path), "--import", "brokencfg")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "is not registered" not in err
    assert err.startswith(f"tfamp: error: {path} is not a loadable Keras model file (")
    assert "get_config" in err  # tf_keras: the config does not match the constructor


def test_keras_file_batch_size_line_and_option(capsys, tmp_path):
    """Issue 20: the batch a Keras file is traced at is printed, and --batch-size sets it;
    a compiled, never-trained Keras 3 file loads without the optimizer warning."""
    import warnings

    path = tmp_path / "model.keras"
    mlp(keras3, True).save(str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run(capsys, "inspect", str(path))
    assert code == 0, err
    assert "  batch size: 8 (assumed; a Keras file records none: change it with " \
        "--batch-size N)" in out
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert "Skipping variable loading" not in err
    eight = next(line for line in out.splitlines() if line.startswith("  matrix/convolution"))
    code, out, _ = run(capsys, "inspect", str(path), "--batch-size", "32")
    assert code == 0 and "  batch size: 32 (given with --batch-size)" in out
    flops = next(line for line in out.splitlines() if line.startswith("  matrix/convolution"))
    counted = [int(line.split(" of ")[1].split()[0].replace(",", "")) for line in (eight, flops)]
    assert counted[1] == 4 * counted[0]
    code, out, _ = run(capsys, "inspect", str(path), "--format", "json", "--batch-size", "32")
    assert json.loads(out)["batch_size"] == 32
