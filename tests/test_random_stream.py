"""tfamp leaves the script's own Python random stream where float32 leaves it.

A tf_keras script that picks test sentences with ``random.choice`` after
training (keras.io's translation example) picked other sentences under
``tfamp.enable``: the first enabled fit imported Keras 3, whose import draws
from Python's global stream (rich's style ids). Run in a fresh interpreter, the
only place where Keras 3 is not imported yet.
"""

from __future__ import annotations

import subprocess
import sys

from tests import processes

SCRIPT = r"""
import random
import numpy as np
import tf_keras as keras
import tfamp

inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
model.compile("sgd", "mse")
model = tfamp.enable(model, verbose=False)
random.seed(0)
want = random.random()
random.seed(0)
model.fit(np.ones((64, 4), "float32"), np.zeros((64, 2), "float32"), epochs=1, verbose=0)
print("STREAM", "untouched" if random.random() == want else "moved")
print("KERAS3", "keras" in __import__("sys").modules)
"""


def test_the_first_enabled_fit_draws_nothing_from_pythons_random():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=processes.environment({"TF_USE_LEGACY_KERAS": "1"}))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.startswith(("STREAM", "KERAS3")))
    # (Keras 3 is imported there: the fallback's and the range monitor's helpers
    # serve both Kerases; what matters is the stream.)
    assert lines == {"STREAM": "untouched", "KERAS3": "True"}, (lines, done.stderr[-2000:])
