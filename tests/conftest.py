"""Shared test set-up: quiet TensorFlow, and tiny-graph helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
