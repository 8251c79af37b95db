"""A value the thread that sets it sees, and every thread tracing into the same graph.

``threading.local`` is not enough while TensorFlow traces: ``MirroredStrategy``
traces each replica's step in a thread of its own, into the same function
graph. A ``TraceLocal`` set while a function is being traced is also seen by
any thread whose current graph is that one or nested in it (a tf.cond branch,
a tf.function called inside); outside any trace it is an ordinary
thread-local value.
"""

from __future__ import annotations

import contextlib
import threading
import weakref


def _building_graph():
    """The function graph being traced in this thread, or None (eager, or a TF1 graph)."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    return graph if getattr(graph, "building_function", False) else None


class TraceLocal:
    """See the module docstring. ``get()`` is None when nothing is set."""

    def __init__(self):
        self._local = threading.local()
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def set(self, value):
        """Within it, `value` is seen here and by threads tracing into this graph."""
        previous = getattr(self._local, "value", None)
        graph = _building_graph()
        self._local.value = value
        if graph is not None:
            with self._lock:
                before = self._graphs.get(graph)
                self._graphs[graph] = value
        try:
            yield value
        finally:
            self._local.value = previous
            if graph is not None:
                with self._lock:
                    if before is None:
                        self._graphs.pop(graph, None)
                    else:
                        self._graphs[graph] = before

    def get(self):
        value = getattr(self._local, "value", None)
        if value is not None or not self._graphs:
            return value
        graph = _building_graph()
        with self._lock:
            while graph is not None:
                found = self._graphs.get(graph)
                if found is not None:
                    return found
                graph = getattr(graph, "outer_graph", None)
        return None
