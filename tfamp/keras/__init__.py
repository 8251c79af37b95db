"""Keras integration: ``tfamp.enable(model)`` and the loss-scale optimizer."""
