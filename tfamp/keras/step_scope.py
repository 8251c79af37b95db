"""Who scales in the training step being traced, and what it has scaled so far.

All of it per thread and per traced graph (a ``MirroredStrategy`` replica
traces in a thread of its own), and only while tracing (eager code is never
scaled here). The loss-scale optimizers, the tape and optimizer patches
(``tape.py``), the start-scale probe and an enabled model's train step read
and write it; it imports nothing of theirs.

* **The probe slot** (``probe_mode`` / ``current_probe``): while the start-scale
  probe traces a step, tapes record instead of scaling and no update applies;
  also in the replica threads of a ``strategy.run`` inside that step
  (``runtime/trace_local.py``).
* **The step scope** (``train_step_scope`` / ``current_step``): an enabled
  model's ``train_step`` being traced; every loss it differentiates is scaled
  by the model's one scale, and the updates are counted (scaled or not).
* **Pending scaled steps** (``push_pending`` / ``take_pending``): a tape scaled
  a loss with an owner's scale; the next optimizer update in the trace
  checks finiteness and updates that owner's scale. ``push_process_scaled`` /
  ``take_process_scaled``: the same for TFAMP_ENABLE's process-wide scale, so
  that a tfamp loss-scale optimizer applying those gradients (a custom loop
  with the compiled model's optimizer) updates that scale, not its own.
* **Losses a loss-scale optimizer scaled itself** (tf_keras ``get_scaled_loss``:
  ``note_scaled_loss`` / ``take_scaled_loss``; Keras 3 ``scale_loss``:
  ``mark_scaled_loss`` / ``consume_scaled_loss``, per optimizer).
* **Rewritten model calls in a custom loop's trace** (``record_call`` /
  ``loops_reached``): which enabled model a loss depends on.
* **The process-wide custom-loop scale** (``TFAMP_ENABLE``):
  ``set_process_owner`` / ``process_owner``, registered by the start-up hook.
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from tfamp.keras.scale_update import mark_scaled
from tfamp.runtime.trace_local import TraceLocal

# The attribute marking the inner optimizer of a loss-scale optimizer (tfamp's or
# Keras's own): the apply patches leave it alone, its wrapper reports its updates.
INNER_MARK = "_tfamp_inner_of_loss_scale_optimizer"

_local = threading.local()
_EAGER = object()


# -- the start-scale probe ---------------------------------------------------------

_probe = TraceLocal()


def current_probe():
    """The probe recording here, if any (an object with ``gradient``)."""
    return _probe.get()


def probe_mode(recorder):
    """Within it, scaled tapes record instead of scaling and updates are skipped."""
    return _probe.set(recorder)


# -- an enabled model's train step ---------------------------------------------------

class StepScope:
    """One trace of an enabled model's ``train_step``: who scales, and what was updated.

    Within it every ``tape.gradient`` of a float loss that nobody scaled
    (Keras's own train step scales through its loss-scale optimizer, which
    marks the loss) is seeded with the model's scale and unscaled in float32,
    and the optimizer update that follows checks finiteness and updates that
    same scale, whichever optimizer it is (the compiled one, or a GAN's own two).

    Attributes:
      owner_of: () -> the model's scale owner (built), asked on the first tape.
      owner: the scale owner the tapes used, once one was scaled.
      scaled: optimizer updates whose gradients were loss-scaled.
      unscaled: optimizer updates of gradients tfamp did not scale
        (``output_gradients`` given, or no tape).
    """

    def __init__(self, owner_of, find_optimizer=None):
        self._owner_of = owner_of
        self._find_optimizer = find_optimizer
        self.owner = None
        self.scaled = 0
        self.unscaled = 0
        self.own_losses = 0  # losses a loss-scale optimizer scaled itself, not yet applied
        self.recorder = None  # start_scale.Recorder: the tapes record for the probe

    def owner_for_tape(self):
        """The owner whose scale this step's tapes use (made and built on first use)."""
        if self.owner is None:
            self.owner = self._owner_of()
        return self.owner

    def reported_owner(self):
        """The owner whose scale this step applied, or None if it applied none."""
        if not self.scaled:
            return None
        if self.owner is not None:
            return self.owner
        return self._find_optimizer() if self._find_optimizer is not None else None


class train_step_scope:  # noqa: N801  (a context manager, like tf.name_scope)
    """Within it (in this thread), tapes and updates follow the model's scale."""

    def __init__(self, scope: StepScope):
        self._scope = scope

    def __enter__(self) -> StepScope:
        self._previous = current_step()
        _local.step = self._scope
        return self._scope

    def __exit__(self, *exc):
        _local.step = self._previous
        return False


def current_step() -> StepScope | None:
    """The enabled model's train step being traced in this thread, if any."""
    return getattr(_local, "step", None)


def note_update(owner, scaled: bool | None = None) -> None:
    """Records an optimizer update in the current step: scaled by `owner`, or unscaled.

    `scaled` overrides the inference from `owner` (a loss-scale optimizer that
    scaled through its own ``scale_loss`` passes True with no owner).
    """
    scope = current_step()
    if scope is None or tf.executing_eagerly():
        return
    if scaled if scaled is not None else owner is not None:
        scope.scaled += 1
    else:
        scope.unscaled += 1


def note_scaled_loss() -> None:
    """A loss-scale optimizer scaled a loss itself (tf_keras ``get_scaled_loss``)."""
    scope = current_step()
    if scope is not None and not tf.executing_eagerly():
        scope.own_losses += 1


def take_scaled_loss() -> bool:
    """True (once per loss) if a loss-scale optimizer scaled a loss in the current step."""
    scope = current_step()
    if scope is None or scope.own_losses <= 0:
        return False
    scope.own_losses -= 1
    return True


# -- pending scaled steps ------------------------------------------------------------

def _per_graph(name: str) -> dict:
    """This thread's table `name`: {graph (or _EAGER): value}."""
    table = getattr(_local, name, None)
    if table is None:
        table = weakref.WeakKeyDictionary()
        setattr(_local, name, table)
    return table


def _graph_key():
    return _EAGER if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def push_pending(owner, sources=()) -> None:
    """A tape scaled a loss with `owner`'s scale in this trace and thread,
    differentiated for `sources` (what ``returned_owner`` matches)."""
    _per_graph("pending").setdefault(tf.compat.v1.get_default_graph(), []).append(
        (owner, frozenset(variable_ids(sources))))


def take_pending():
    """The scale owner of the oldest pending scaled step in this trace and thread, or None."""
    if tf.executing_eagerly():
        return None
    pending = _per_graph("pending").get(tf.compat.v1.get_default_graph())
    return pending.pop(0)[0] if pending else None


def returned_owner(variables):
    """For an eager update: the owner whose scale a traced function's tape scaled
    gradients of `variables` with, where no update in that trace took them (the
    function returned them: the tensorflow/docs walkthrough's ``grad``), else None.
    Those gradients were unscaled in the function but not checked; the eager
    update checks them and updates that scale."""
    wanted = variable_ids(variables)
    for pending in list(_per_graph("pending").values()):
        for owner, ids in pending:
            if ids & wanted:
                return owner
    return None


def variable_ids(variables) -> set[int]:
    """ids of `variables` and, for Keras 3 variables, of the tf.Variable inside."""
    ids = set()
    for v in tf.nest.flatten(variables):
        ids.add(id(v))
        inner = getattr(v, "_value", None)
        if inner is not None:
            ids.add(id(inner))
    return ids


def push_process_scaled() -> None:
    """TFAMP_ENABLE's custom-loop tape scaled a loss with the process-wide scale in
    this trace (or eagerly) and thread (``take_process_scaled``: the update that
    checks it)."""
    if tf.executing_eagerly():
        _local.eager_process_scaled = getattr(_local, "eager_process_scaled", 0) + 1
        return
    table = _per_graph("process_scaled")
    graph = tf.compat.v1.get_default_graph()
    table[graph] = table.get(graph, 0) + 1


def take_process_scaled() -> bool:
    """True (once per scaled loss) if the process-wide scale scaled a loss in this
    trace and thread and no update has taken it yet. Eagerly: an eager tape's mark,
    else any trace's mark no update in it took (a function that returns its
    gradients, applied eagerly: every call of it, so the mark is kept)."""
    if tf.executing_eagerly():
        eager = getattr(_local, "eager_process_scaled", 0)
        if eager:
            _local.eager_process_scaled = eager - 1
            return True
        return any(count > 0 for count in _per_graph("process_scaled").values())
    table = _per_graph("process_scaled")
    graph = tf.compat.v1.get_default_graph()
    if not table.get(graph):
        return False
    table[graph] -= 1
    return True


def take_process_owner(optimizer):
    """TFAMP_ENABLE's process-wide scale owner where its tape scaled the gradients the
    loss-scale `optimizer` now applies (that owner, not the optimizer's own scale,
    must check and adapt), else None. Takes the mark (``take_process_scaled``)."""
    if not take_process_scaled():
        return None
    owner = process_owner()
    return None if owner is None or owner is optimizer else owner


# -- Keras 3 scale_loss: per optimizer --------------------------------------------------

def mark_scaled_loss(optimizer, scaled) -> None:
    """Marks `scaled` as a loss `optimizer.scale_loss` returned, and counts it pending."""
    mark_scaled(scaled)
    key = _graph_key()
    if key is _EAGER:
        per_graph = getattr(_local, "eager_losses", None)
        if per_graph is None:
            per_graph = _local.eager_losses = {}
    else:
        per_graph = _per_graph("losses").setdefault(key, {})
    per_graph[id(optimizer)] = per_graph.get(id(optimizer), 0) + 1


def consume_scaled_loss(optimizer) -> bool:
    """True (once per scaled loss) if `optimizer.scale_loss` ran in this trace."""
    key = _graph_key()
    per_graph = (getattr(_local, "eager_losses", None) if key is _EAGER
                 else _per_graph("losses").get(key))
    if not per_graph or per_graph.get(id(optimizer), 0) <= 0:
        return False
    per_graph[id(optimizer)] -= 1
    return True


# -- an enabled model called in a custom loop's trace ------------------------------------

# {traced graph: {name of an op an enabled model's rewritten call produced: its loop}}
_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_calls_lock = threading.Lock()


def record_call(outputs, loop) -> None:
    """An enabled model's rewritten call produced `outputs` in the current graph."""
    graph = tf.compat.v1.get_default_graph()
    names = {t.op.name for t in tf.nest.flatten(outputs, expand_composites=True)
             if isinstance(t, tf.Tensor)}
    with _calls_lock:
        table = _calls.setdefault(graph, {})
        for name in names:
            table[name] = loop


def loops_reached(target, *, through: bool = False) -> list:
    """The loops (enabled models) whose rewritten call `target` (a tensor or a list
    of them) depends on, in its graph: the nearest ones (a call's inputs are not
    walked), or with `through` every one upstream too (a GAN's generator behind the
    discriminator its loss is computed by)."""
    targets = tf.nest.flatten(target)
    graph = getattr(targets[0], "graph", None) if targets else None
    with _calls_lock:
        table = dict(_calls.get(graph, {})) if graph is not None else {}
    if not table:
        return []
    found: dict[int, object] = {}
    seen = set()
    pending = [t.op for t in targets]
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in table:
            found[id(table[op.name])] = table[op.name]
            if not through:
                continue
        pending.extend(t.op for t in op.inputs)
    return list(found.values())


# -- the process-wide custom-loop scale (TFAMP_ENABLE) --------------------------------------

_process_owner = None
_process_config = None


def set_process_owner(get_owner, get_config=None) -> None:
    """Registers () -> TFAMP_ENABLE's custom-loop scale owner (or None when off), and
    () -> the AmpConfig its functions are rewritten with now."""
    global _process_owner, _process_config
    _process_owner, _process_config = get_owner, get_config


def process_owner():
    """TFAMP_ENABLE's custom-loop scale owner, or None (not active, or no loss scaling)."""
    return _process_owner() if _process_owner is not None else None


def process_config():
    """The AmpConfig TFAMP_ENABLE rewrites functions with now, or None (not active)."""
    return _process_config() if _process_config is not None else None


def process_scaling_registered() -> bool:
    """Has TFAMP_ENABLE registered its custom-loop scale (its start-up hook probes
    custom loops)? Makes no owner."""
    return _process_owner is not None


def probe_apply_result(optimizer):
    """What a tf_keras ``apply_gradients`` returns in the start-scale probe, which
    applies nothing: the optimizer's ``iterations``, where it exists. A legacy
    optimizer makes it lazily, and must not make it in the probe's trace (under
    MirroredStrategy, a replica's: it could not be lifted, and broke the steps after)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "_iterations", None) is None:
        return tf.no_op()
    return optimizer.iterations


def is_inner_optimizer(optimizer) -> bool:
    """Wrapped by a loss-scale optimizer (tfamp's or Keras's), which reports its updates."""
    return bool(getattr(optimizer, INNER_MARK, False)
                or getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", False))
