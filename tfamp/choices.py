"""The closed sets of words a setting accepts, shared by ``env`` and ``config`` (no TensorFlow)."""

# What a rewritten step runs on (tfamp.rewrite.runtime_cost): AmpConfig.runtime, TFAMP_RUNTIME.
RUNTIME_WORDS = ("auto", "executor", "xla")
