r"""Which keep_fp32 pattern names a Keras layer in every call, not one call's scope.

A layer called twice in one step (a siamese model's two towers, a metric model
on anchors and positives) gets a name scope per call: Keras 3 writes
``embedding_model_1/dense_1/`` and ``embedding_model_3/dense_1/``, the layer
names with TensorFlow's uniquifying suffix. The float32 fallback moves, and the
stuck-at-floor warning's "Fix:" names, the pattern ``every_call`` makes from
the scope the locator found, so the layer moves in each of its calls.
"""

from __future__ import annotations

import re

from tfamp.keras.flavour import layers_of

_CALL_SUFFIX = re.compile(r"(.+)_\d+")


def layer_names(model) -> frozenset[str]:
    """The names of `model` and of every layer in it, at any depth."""
    return frozenset(getattr(layer, "name", "") for layer in layers_of(model)) | {model.name}


def every_call(scope: str, names: frozenset[str]) -> str:
    r"""A keep_fp32 pattern for layer scope `scope` that matches every call of that
    layer, not only the one in `scope`.

    A scope component that is not a layer's name but one with TensorFlow's
    ``_<n>`` suffix stands for that layer's every call (the name, then an
    optional ``_<n>``); one that is a layer's name stays as it is, so tf_keras's
    stable scopes (``pipe/frozen/``) are unchanged. The price: a layer named
    like another plus ``_<n>`` in the same scope is matched too (kept float32:
    slower, never wrong).

    Example:
      >>> print(every_call("embedding_model_1/dense_1", frozenset({"embedding_model", "dense"})))
      embedding_model(_\d+)?/dense(_\d+)?/
    """
    parts = []
    for part in scope.split("/"):
        base = _CALL_SUFFIX.fullmatch(part)
        if part not in names and base is not None and base.group(1) in names:
            parts.append(re.escape(base.group(1)) + r"(_\d+)?")
        else:
            parts.append(re.escape(part))
    return "/".join(parts) + "/"


def pattern_for(model):
    """``scope -> keep_fp32 pattern`` for `model`'s layers (``every_call``)."""
    names = layer_names(model)
    return lambda scope: every_call(scope, names)


def outside_pattern(model) -> str:
    r"""A keep_fp32 pattern matching every node outside `model`'s calls (and their
    gradients): what a trace of a custom loop's step holds besides the enabled
    model, which ``tfamp.enable`` leaves float32 there.

    Example:
      >>> re.search(outside_pattern(model), "gradient_tape/pipe_1/dense/MatMul") is None
      True
    """
    return rf"^(?!(gradient_tape/)?{re.escape(model.name)}(_\d+)?/)"


def in_model(scope: str, model) -> bool:
    """Is the layer scope `scope` (a trace's: "pipe_1/block/dense_2/einsum") inside
    `model`? Below the model's own scope, a component, with or without TensorFlow's
    ``_<n>`` call suffix, must name one of its layers (Keras names layers uniquely in
    a session, where a pattern for "sequential" also matches "sequential_1")."""
    names = layer_names(model) - {model.name}
    parts = scope.strip("/").split("/")[1:]
    if not parts:
        return True  # (an op in the model's own scope)
    for part in parts:
        base = _CALL_SUFFIX.fullmatch(part)
        if part in names or base is not None and base.group(1) in names:
            return True
    return False
