"""Shared test set-up: quiet TensorFlow, and tiny-graph helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402


@pytest.fixture
def check_calls(monkeypatch):
    """Records every graph tfamp validated (check=True) before running it."""
    import tfamp.runtime.runner

    calls = []
    real = tfamp.runtime.runner.assert_valid_graph_def

    def spy(graph_def):
        calls.append(graph_def)
        return real(graph_def)

    monkeypatch.setattr(tfamp.runtime.runner, "assert_valid_graph_def", spy)
    return calls
