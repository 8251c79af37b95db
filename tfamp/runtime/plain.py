"""What tfamp leaves as written on purpose: plain tf.functions and plain model calls.

tfamp's own probes (the start-scale probe, the range probe, the overflow
locator) measure float32 reference values: they trace with ``plain_function``
(TensorFlow's own ``tf.function``, also under ``TFAMP_ENABLE``, whose
``tf.function`` rewrites) and call enabled models inside ``plain_calls()``
(their class's ``call``, not the rewritten forward). Both are per thread: a
``MirroredStrategy`` replica traces in a thread of its own and enters them there.
"""

from __future__ import annotations

from tfamp.runtime.trace_local import TraceLocal

_plain = TraceLocal()


def original_tf_function():
    """TensorFlow's ``tf.function``, also where ``TFAMP_ENABLE`` replaced it."""
    import tensorflow as tf

    return getattr(tf.function, "_tfamp_original", tf.function)


def plain_function(python_function=None, **kwargs):
    """``tf.function(python_function, **kwargs)`` that tfamp does not rewrite."""
    function = original_tf_function()
    if python_function is None:
        return lambda f: function(f, **kwargs)
    return function(python_function, **kwargs)


def plain_calls():
    """Within it, enabled models run their class's ``call`` as is (a context manager)."""
    return _plain.set(True)


def in_plain_calls() -> bool:
    """True inside ``plain_calls()`` (this thread, or the trace it belongs to)."""
    return bool(_plain.get())
