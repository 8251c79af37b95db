"""Can an op compute in a 16-bit type? Asked of its OpDef and registered kernels.

A body that XLA compiles (``tfamp.rewrite.compiled``) needs more than the
device's kernel: tf2xla refuses a function with an op whose XLA kernel
(``XLA_CPU_JIT``, ``XLA_GPU_JIT``) does not take its type. MaxPoolGradGrad,
for one, has float16 CPU and GPU kernels but an XLA kernel for float32 only.
TensorFlow registers the XLA kernels only once the process has made an XLA
device; ``_xla_registered`` makes one first (by running a trivial compiled
function) when it can.
"""

from __future__ import annotations

import functools
import logging
import threading

from tensorflow.python.framework import kernels, op_def_registry

log = logging.getLogger(__name__)


@functools.cache
def opdef_allows(op: str, attr: str, dtype: int) -> bool:
    """True if the OpDef of `op` lets type attribute `attr` take `dtype`."""
    op_def = op_def_registry.get(op)
    if op_def is None:
        return False
    for attr_def in op_def.attr:
        if attr_def.name == attr:
            allowed = attr_def.allowed_values.list.type
            return not allowed or dtype in allowed
    return False


@functools.cache
def _kernels(op: str) -> tuple:
    return tuple(kernels.get_registered_kernels_for_op(op).kernel)


@functools.cache
def has_kernel(op: str, attr: str, dtype: int, device_type: str) -> bool:
    """True if a `device_type` kernel of `op` accepts `dtype` for `attr`.

    A kernel with no constraint on `attr` accepts any type for it; a kernel
    registered for the "DEFAULT" device type (IdentityN, ...) serves every device.
    """
    return _accepts(_kernels(op), attr, dtype, (device_type, "DEFAULT"))


@functools.cache
def missing_kernel(op: str, attr: str, dtype: int, device_type: str,
                   compiled: bool = False) -> str:
    """The kernel `op` lacks to take `dtype` for `attr`, or "" if none is lacking.

    Args:
      op, attr, dtype: the op type, its type attribute, the type asked for.
      device_type: where the op runs ("CPU", "GPU").
      compiled: whether XLA compiles the body the op is in; then its XLA kernel
        ("XLA_GPU_JIT" on a GPU) must take `dtype` too.

    Returns:
      "" if it can compute in `dtype`; else the device type whose kernel does
      not take it (`device_type`, or the XLA one). Where XLA has no kernel for
      the op at all, or its kernels are not known in this process (eager
      execution disabled), only the device's kernel is asked: XLA refuses such
      an op whatever its type.
    """
    if not has_kernel(op, attr, dtype, device_type):
        return device_type
    if compiled:
        jit_device = f"XLA_{device_type}_JIT"
        found = [k for k in _xla_kernels(op) if k.device_type == jit_device]
        if found and not _accepts(found, attr, dtype, (jit_device,)):
            return jit_device
    return ""


def _accepts(kernel_defs, attr: str, dtype: int, device_types: tuple[str, ...]) -> bool:
    for kernel in kernel_defs:
        if kernel.device_type not in device_types:
            continue
        allowed = [c.allowed_values.list.type for c in kernel.constraint
                   if c.name == attr]
        if not allowed or dtype in allowed[0]:
            return True
    return False


@functools.cache
def _xla_kernels(op: str) -> tuple:
    """`op`'s XLA kernels (device types XLA_*_JIT); () if they are not known."""
    if not _xla_registered():
        return ()
    return tuple(k for k in kernels.get_registered_kernels_for_op(op).kernel
                 if k.device_type.startswith("XLA_") and k.device_type.endswith("_JIT"))


@functools.cache
def _xla_registered() -> bool:
    """Makes TensorFlow register its XLA kernels, once; False if it cannot here."""
    if _has_xla_kernels():
        return True
    # Registration comes with the first XLA device, which the first compiled
    # function makes. It runs in a thread of its own: the caller may be inside
    # a trace, a device scope or a distribution strategy's replica context,
    # none of which a new thread inherits. Where eager execution is off
    # (tf.compat.v1 graph mode) nothing is run.
    errors: list[BaseException] = []

    def register() -> None:
        import tensorflow as tf

        try:
            if tf.executing_eagerly():
                with tf.device("/device:CPU:0"):
                    tf.function(lambda x: x + 1.0, jit_compile=True)(tf.constant(0.0))
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    thread = threading.Thread(target=register, name="tfamp-xla-kernels")
    thread.start()
    thread.join()
    if _has_xla_kernels():
        return True
    log.warning("tfamp: XLA's kernels are not known in this process (%s); an op in a "
                "function compiled with jit_compile is checked against its device's "
                "kernel only", errors[0] if errors else "eager execution is off")
    return False


def _has_xla_kernels() -> bool:
    return any(k.device_type == "XLA_CPU_JIT"
               for k in kernels.get_registered_kernels_for_op("Identity").kernel)


def resolve_device_type(device_type: str) -> str:
    """'CPU' or 'GPU' for a config's device_type ('auto' asks TensorFlow)."""
    if device_type != "auto":
        return device_type
    return "GPU" if _visible_gpu() else "CPU"


@functools.cache
def _visible_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


@functools.cache
def node_device_type(device: str, default: str) -> str:
    """The device type ('CPU', 'GPU', ...) of a NodeDef's `device` string.

    Args:
      device: e.g. "/device:CPU:0" or "/job:localhost/replica:0/task:0/device:GPU:0";
        "" (no placement) or a string that names no device type means `default`.
      default: the device type for unplaced nodes (the config's).
    """
    if not device:
        return default
    from tensorflow.python.framework import device_spec

    try:
        parsed = device_spec.DeviceSpecV2.from_string(device).device_type
    except ValueError:
        return default
    return parsed.upper() if parsed else default
