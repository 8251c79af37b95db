"""Keras integration (tf_keras and Keras 3): ``tfamp.enable(model)`` and one lifecycle per model.

Layers inside, lowest first: ``flavour`` (the adapter: where the two Kerases
differ), ``scale_update`` / ``scale_state`` / ``step_scope`` / ``notices`` /
``replicas``, the loss-scale optimizers and ``tape``, ``custom_loop``,
``range_probe`` / ``overflow_locator`` / ``start_scale`` / ``fallback`` /
``step_metrics`` / ``range_monitor``, then ``lifecycle`` (the one object per
enabled model) and ``activation`` (``tfamp.enable`` / ``disable``).
"""
