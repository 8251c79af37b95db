"""Can an op compute in a 16-bit type? Asked of its OpDef and registered kernels."""

from __future__ import annotations

import functools

from tensorflow.python.framework import kernels, op_def_registry


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
    for kernel in _kernels(op):
        if kernel.device_type not in (device_type, "DEFAULT"):
            continue
        allowed = [c.allowed_values.list.type for c in kernel.constraint
                   if c.name == attr]
        if not allowed or dtype in allowed[0]:
            return True
    return False


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
