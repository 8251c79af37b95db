"""Every way TensorFlow reads a tf.function sees tfamp's rewritten graph.

What these tests pin down (issue 17, item 5: ``tf.saved_model.save`` used to
drop a ``@tfamp.function`` without a word):

* ``tf.saved_model.save`` keeps a ``tfamp.function`` wherever it keeps a
  ``tf.function`` (a tf.Module method with or without ``input_signature``, an
  instance attribute, a wrapped existing tf.function, a tf_keras or Keras 3
  model method,
  ``signatures=`` as a dict or a concrete function): the loaded function
  computes in float16 (16-bit ops in its saved graph), returns float32 as the
  original's signature says, and the variables come back with their values;
* the SavedModel loads and runs in a process that never imports tfamp
  (functions the rewritten graph calls are in the saved library);
* ``get_concrete_function`` returns the rewritten ConcreteFunction (16-bit
  ops, same signature and flat keywords as the original's);
* ``experimental_get_compiler_ir`` lowers the rewritten graph (f16 in the HLO);
* ``tf.train.Checkpoint`` of the owning module saves and restores the
  variables, and the function still runs rewritten afterwards;
* a bound method leaves nothing of its own in the instance's ``__dict__``;
* ``MirroredStrategy.run`` of a ``tfamp.function`` (which clones a tf.function)
  runs it rewritten;
* a ``tfamp.function`` given to ``tfamp.function`` is rewritten once, with the
  new settings (it is a tf.function now, and must not be rewritten twice);
* ``function_aliases`` name the rewritten functions;
* under ``TFAMP_ENABLE=1`` what a script saves is its float32 model (a tf.Module,
  a tf_keras ``model.save(save_format="tf")``, TFLite's converter, which saves one
  first), while its steps run rewritten: until session 22 the saved functions
  were rewritten, which TFLite's converter refused (float16 ops need its "flex"
  delegate) and which gave a serving host an unchecked 16-bit model; ``tfamp
  export`` is the way to a 16-bit one, checked against float32.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from tensorflow.python.eager.polymorphic_function import polymorphic_function

import tfamp

SIXTEEN_BIT = {"float16", "bfloat16"}
ATOL, RTOL = 2e-2, 2e-2  # float16 against float32 on 4x4 / 8x4 matmuls


# --------------------------------------------------------------------------- helpers


def _op_dtypes(concrete) -> set[tuple[str, str]]:
    """(op type, its T or DstT dtype) for every node of a concrete function and its library."""
    graph_def = concrete.graph.as_graph_def()
    node_lists = [graph_def.node] + [f.node_def for f in graph_def.library.function]
    found = set()
    for nodes in node_lists:
        for node in nodes:
            for key in ("T", "DstT"):
                if key in node.attr and node.attr[key].type:
                    found.add((node.op, tf.dtypes.as_dtype(node.attr[key].type).name))
    return found


def _sixteen_bit_ops(concrete) -> set[str]:
    return {op for op, dtype in _op_dtypes(concrete) if dtype in SIXTEEN_BIT and op != "Cast"}


def _float_dtypes(outputs) -> set[str]:
    return {t.dtype.name for t in tf.nest.flatten(outputs)}


@tf.function
def _inner(x, w):  # a function the rewritten graph calls: it must be saved too
    return tf.nn.relu(tf.matmul(x, w))


class _Module(tf.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.w = tf.Variable(tf.random.stateless_normal([4, 4], seed=[seed, 1]))
        self.attribute = tfamp.function(lambda x: tf.matmul(x, self.w) * 2.0)
        self.wrapped = tfamp.rewrite_function(tf.function(lambda x: tf.matmul(x, self.w) - 1.0))
        # a plain tf.function that calls a tfamp.function: saved with the rewritten callee
        self.plain_caller = tf.function(lambda x: self.traced(x) + 1.0)

    @tfamp.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def signed(self, x):
        return {"y": tf.matmul(x, self.w)}

    @tfamp.function
    def traced(self, x):
        return _inner(x, self.w)

    @tfamp.function(jit_compile=True)
    def compiled(self, x):
        return tf.matmul(x, self.w)

    # float32 references: the same math, plain TensorFlow
    def reference(self, name, x):
        y = tf.matmul(x, self.w)
        return {"signed": {"y": y}, "traced": tf.nn.relu(y), "attribute": y * 2.0,
                "wrapped": y - 1.0, "plain_caller": tf.nn.relu(y) + 1.0,
                "serve": {"y": y}, "serving_default": {"y": y}}[name]


def _net_class(keras_module):
    """A one-Dense model with a @tfamp.function serving method, for either Keras."""

    class Net(keras_module.Model):
        def __init__(self):
            super().__init__(name="net")  # (Keras 3: a name from the class is no valid scope)
            self.dense = keras_module.layers.Dense(
                4, kernel_initializer=keras_module.initializers.GlorotUniform(0))

        def call(self, x):
            return self.dense(x)

        @tfamp.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, x):
            return self(x)

        def reference(self, name, x):
            return self(x)

    return Net


_KerasNet, _Keras3Net = _net_class(keras), _net_class(keras3)


X = tf.random.stateless_normal([3, 4], seed=[7, 7])


# ----------------------------------------------------------------- saving: the table

# (case id, owner builder, save keyword arguments (given the owner), how to reach
#  the loaded callable, reference name)
SAVE_CASES = [
    ("module method, input_signature", _Module, lambda m: {},
     lambda loaded: loaded.signed, "signed"),
    ("module method, traced by a call", _Module, lambda m: {},
     lambda loaded: loaded.traced, "traced"),
    ("instance attribute", _Module, lambda m: {},
     lambda loaded: loaded.attribute, "attribute"),
    ("wrapped existing tf.function", _Module, lambda m: {},
     lambda loaded: loaded.wrapped, "wrapped"),
    ("plain tf.function calling one", _Module, lambda m: {},
     lambda loaded: loaded.plain_caller, "plain_caller"),
    ("signatures= dict of a tfamp.function", _Module, lambda m: {"signatures": {"serve": m.signed}},
     lambda loaded: loaded.signatures["serve"], "serve"),
    ("signatures= its concrete function", _Module,
     lambda m: {"signatures": m.signed.get_concrete_function()},
     lambda loaded: loaded.signatures["serving_default"], "serving_default"),
    ("tf_keras model method", _KerasNet, lambda m: {},
     lambda loaded: loaded.serve, "serve"),
    ("Keras 3 model method", _Keras3Net, lambda m: {},
     lambda loaded: loaded.serve, "serve"),
]


def _prepare(owner):
    # no input_signature: trace by calling
    for name in ("traced", "attribute", "wrapped", "plain_caller"):
        if hasattr(owner, name):
            getattr(owner, name)(X)
    if isinstance(owner, keras.Model | keras3.Model):
        owner(X)


def _loaded_concrete(fn):
    if isinstance(fn, tf.types.experimental.ConcreteFunction):
        return fn
    (concrete,) = fn.concrete_functions
    return concrete


@pytest.mark.parametrize("case", SAVE_CASES, ids=[c[0] for c in SAVE_CASES])
def test_saved_model_keeps_the_rewritten_function(tmp_path, case):
    _, build, save_kwargs, reach, reference = case
    owner = build()
    _prepare(owner)
    tf.saved_model.save(owner, str(tmp_path), **save_kwargs(owner))
    loaded = tf.saved_model.load(str(tmp_path))

    fn = reach(loaded)  # used to raise AttributeError: the function was not saved
    keyword_call = isinstance(fn, tf.types.experimental.ConcreteFunction)  # a signature
    outputs = fn(x=X) if keyword_call else fn(X)
    expected = owner.reference(reference, X)
    assert _float_dtypes(outputs) == {"float32"}
    for got, want in zip(tf.nest.flatten(outputs), tf.nest.flatten(expected), strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=ATOL, rtol=RTOL)
    concrete = _loaded_concrete(fn)
    assert _sixteen_bit_ops(concrete) >= {"MatMul"}, _op_dtypes(concrete)
    # the variables it computes on come back with their values (still float32)
    handles = [t for t in concrete.captured_inputs if t.dtype == tf.resource]
    restored = sorted(tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32).numpy().tobytes()
                      for h in handles)
    saved = sorted(v.numpy().tobytes() for v in owner.variables)
    assert restored == saved


def test_saved_module_has_every_function_and_nothing_else(tmp_path):
    module = _Module()
    _prepare(module)
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    public = {name for name in dir(loaded) if not name.startswith("_")}
    # `compiled` was never traced, so (as with a tf.function) there is nothing to save.
    assert {"signed", "traced", "attribute", "wrapped", "w"} <= public
    assert not [name for name in dir(loaded) if "tfamp" in name]


LOAD_WITHOUT_TFAMP = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    loaded = tf.saved_model.load(sys.argv[1])
    x = tf.constant(np.load(sys.argv[2]))
    y = loaded.traced(x)
    (concrete,) = loaded.traced.concrete_functions
    gd = concrete.graph.as_graph_def()
    half = sorted({n.op for f in gd.library.function for n in f.node_def
                   if "T" in n.attr and n.attr["T"].type == tf.float16.as_datatype_enum})
    assert "tfamp" not in sys.modules, sorted(m for m in sys.modules if "tfamp" in m)
    np.save(sys.argv[3], y.numpy())
    print("dtype", y.dtype.name, "half", ",".join(half))
""")


def test_saved_model_loads_and_runs_without_tfamp(tmp_path):
    module = _Module()
    module.traced(X)
    tf.saved_model.save(module, str(tmp_path / "model"))
    np.save(tmp_path / "x.npy", X.numpy())
    script = tmp_path / "load.py"
    script.write_text(LOAD_WITHOUT_TFAMP)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TFAMP_") and k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model"), str(tmp_path / "x.npy"),
         str(tmp_path / "y.npy")], capture_output=True, text=True, env=env,
        cwd=str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dtype float32 half " in result.stdout, result.stdout
    half = result.stdout.split("half ")[1].split()[0].split(",")
    assert {"MatMul", "Relu"} <= set(half), result.stdout  # the called _inner, rewritten
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), module.reference("traced", X).numpy(),
                               atol=ATOL, rtol=RTOL)


def test_function_aliases_name_the_rewritten_functions(tmp_path):
    module = _Module()
    options = tf.saved_model.SaveOptions(function_aliases={"signed": module.signed})
    tf.saved_model.save(module, str(tmp_path), options=options)
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((tmp_path / "saved_model.pb").read_bytes())
    meta_graph = proto.meta_graphs[0]
    (name,) = [key for key, alias in meta_graph.meta_info_def.function_aliases.items()
               if alias == "signed"]
    (fdef,) = [f for f in meta_graph.graph_def.library.function if f.signature.name == name]
    assert "_tfamp" in name
    assert any(node.op == "MatMul" and node.attr["T"].type == tf.float16.as_datatype_enum
               for node in fdef.node_def), fdef


# ------------------------------------------------------- the other ways of reading it


def test_a_tfamp_function_is_a_tf_function_to_tensorflow():
    module = _Module()
    for fn in (module.signed, module.attribute, _Module.signed):
        assert isinstance(fn, polymorphic_function.Function)
        assert isinstance(fn, tf.types.experimental.PolymorphicFunction)


def test_get_concrete_function_returns_the_rewritten_function():
    module = _Module()
    plain = tf.function(module.signed.python_function,
                        input_signature=module.signed.input_signature)
    original = plain.get_concrete_function()
    concrete = module.signed.get_concrete_function()
    assert _sixteen_bit_ops(concrete) >= {"MatMul"}
    assert not _sixteen_bit_ops(original)
    assert concrete.graph.name.endswith("_tfamp")
    assert concrete.structured_input_signature == original.structured_input_signature
    assert concrete._arg_keywords == original._arg_keywords  # signatures= uses them
    assert concrete._num_positional_args == original._num_positional_args
    assert _float_dtypes(concrete(X)) == {"float32"}
    # the same object on every call, and the one calls run
    assert module.signed.get_concrete_function() is concrete
    assert module.signed.get_concrete_function(tf.TensorSpec([None, 4])) is concrete


@pytest.mark.parametrize("args", [(X,), (tf.TensorSpec([3, 4], tf.float32),)],
                         ids=["tensors", "tensor specs"])
def test_compiler_ir_lowers_the_rewritten_graph(args):
    module = _Module()
    hlo = module.compiled.experimental_get_compiler_ir(*args)(stage="hlo")
    assert "f16[3,4]" in hlo and "f16[4,4]" in hlo, hlo
    plain = tf.function(lambda x: tf.matmul(x, module.w), jit_compile=True)
    assert "f16" not in plain.experimental_get_compiler_ir(*args)(stage="hlo")


def test_compiler_ir_without_jit_compile_says_so_as_tf_function_does():
    module = _Module()
    with pytest.raises(ValueError, match="jit_compile=True"):
        module.signed.experimental_get_compiler_ir(X)


def test_checkpoint_of_the_owner_restores_variables_and_keeps_the_rewrite(tmp_path):
    module = _Module()
    before = module.signed(X)["y"].numpy()
    path = tf.train.Checkpoint(module).save(str(tmp_path / "ckpt"))
    saved = module.w.numpy()
    module.w.assign(tf.zeros([4, 4]))
    tf.train.Checkpoint(module).restore(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(module.w.numpy(), saved)
    np.testing.assert_array_equal(module.signed(X)["y"].numpy(), before)
    assert module.signed.reports and module.signed.reports[0].converted
    # the checkpoint holds the variable, and no bound-function bookkeeping of tfamp's
    names = [name for name, _ in tf.train.list_variables(path)]
    assert any(name.startswith("w/") for name in names), names
    assert not [name for name in names if "tfamp" in name], names


def test_a_bound_method_is_cached_outside_the_instance():
    module = _Module()
    assert module.signed is module.signed
    assert not [key for key in vars(module) if "tfamp" in key]
    other = _Module(seed=1)
    assert other.signed is not module.signed


def test_a_tfamp_function_given_to_tfamp_function_is_rewritten_once():
    module = _Module()
    module.attribute(X)
    again = tfamp.function(module.attribute, config=tfamp.AmpConfig(dtype="bfloat16"))
    assert again._tf_function is module.attribute._tf_function  # the tf.function, not its rewrite
    assert _float_dtypes(again(X)) == {"float32"}
    (report,) = again.reports
    assert report.converted
    assert {dtype for op, dtype in _op_dtypes(again.get_concrete_function(X))
            if op == "MatMul"} == {"bfloat16"}


def test_strategy_run_of_a_tfamp_function_runs_it_rewritten():
    # MirroredStrategy.run lifts a tf.function with Function._clone: the clone
    # must be rewritten too, not a plain float32 tf.function.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        w = tf.Variable(tf.ones((4, 4)) / 3)
    fn = tfamp.function(lambda x: tf.matmul(x, w))
    got = strategy.run(fn, args=(tf.ones((2, 4)),))
    assert got.dtype == tf.float32
    want16 = tf.matmul(tf.ones((2, 4), tf.float16), tf.cast(w, tf.float16))
    np.testing.assert_array_equal(got.numpy(), tf.cast(want16, tf.float32).numpy())
    assert fn._jit_compile is None  # Function's fields read through to the tf.function


def test_nothing_to_convert_saves_the_traced_function(tmp_path):
    module = tf.Module()
    module.count = tfamp.function(lambda n: n + 1,
                                  input_signature=[tf.TensorSpec([], tf.int32)])
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    assert int(loaded.count(tf.constant(41))) == 42


# ------------------------------------------------------------------- TFAMP_ENABLE=1

ENV_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf

    class Scaler(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.random.stateless_normal([4, 4], seed=[1, 2]))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def __call__(self, x):
            return tf.nn.relu(tf.matmul(x, self.w))

    module = Scaler()
    x = tf.random.stateless_normal([3, 4], seed=[3, 4])
    want = tf.nn.relu(tf.matmul(x, module.w)).numpy()
    ran = module.__call__.get_concrete_function().graph.as_graph_def()
    print("ran_half", any(n.attr["T"].type == tf.float16.as_datatype_enum
                          for n in ran.node if "T" in n.attr))
    tf.saved_model.save(module, sys.argv[1])
    loaded = tf.saved_model.load(sys.argv[1])
    y = loaded(x)
    (concrete,) = loaded.__call__.concrete_functions
    gd = concrete.graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    half = sorted({n.op for n in nodes
                   if "T" in n.attr and n.attr["T"].type == tf.float16.as_datatype_enum})
    print("patched", hasattr(tf.function, "_tfamp_original"))
    print("dtype", y.dtype.name)
    print("half", ",".join(half))
    print("close", bool(np.allclose(y.numpy(), want, atol=2e-2, rtol=2e-2)))
    print("restored", bool(np.array_equal(loaded.w.numpy(), module.w.numpy())))
""")


def _run_enabled(script_text: str, tmp_path):
    """Runs a script as TFAMP_ENABLE=1 does, with this checkout's start-up code.

    ``tfamp run`` calls the same ``startup.activate()`` as the interpreter hook,
    whatever hook the shared environment has installed (the hook is idempotent).
    """
    script = tmp_path / "save.py"
    script.write_text(script_text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update(TFAMP_ENABLE="1", TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "tfamp", "run", str(script), str(tmp_path / "model")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)


def test_tfamp_enable_runs_a_tf_function_rewritten_and_saves_it_float32(tmp_path):
    result = _run_enabled(ENV_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["patched"] == "True", result.stdout
    assert lines["ran_half"] == "True", result.stdout  # (the function runs rewritten)
    assert lines["dtype"] == "float32", result.stdout
    assert lines["half"] == "", result.stdout  # (what was saved: float32)
    assert lines["close"] == "True" and lines["restored"] == "True", result.stdout


KERAS_ENV_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, x[:, :1], epochs=1, batch_size=16, verbose=0)
    want = model(x).numpy()  # eager: float32
    model.save(sys.argv[1], save_format="tf")  # used to fail: RewrittenFunction not Trackable
    loaded = tf.saved_model.load(sys.argv[1])
    serve = loaded.signatures["serving_default"]
    (y,) = serve(tf.constant(x)).values()
    gd = serve.graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    half = sorted({n.op for n in nodes
                   if "T" in n.attr and n.attr["T"].type == tf.float16.as_datatype_enum})
    print("dtype", y.dtype.name)
    print("half", ",".join(half))
    print("close", bool(np.allclose(y.numpy(), want, atol=1e-5, rtol=1e-5)))
    print("trained_half", any(r.converted for r in model.train_function.reports))
    lite = tf.lite.TFLiteConverter.from_keras_model(model).convert()  # (refused 16-bit ops)
    interpreter = tf.lite.Interpreter(model_content=lite)
    interpreter.allocate_tensors()
    print("tflite", sorted({d["dtype"].__name__ for d in interpreter.get_tensor_details()}))
""")


def test_tfamp_enable_tf_keras_model_save_and_tflite_are_float32(tmp_path):
    result = _run_enabled(KERAS_ENV_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["trained_half"] == "True", result.stdout
    assert lines["dtype"] == "float32", result.stdout
    assert lines["half"] == "", result.stdout
    assert lines["close"] == "True", result.stdout
    assert lines["tflite"] == "['float32']", result.stdout
