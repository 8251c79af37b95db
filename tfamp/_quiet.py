"""Imports TensorFlow without its start-up chatter drowning tfamp's own output.

TensorFlow's C++ side prints CUDA and oneDNN notices to file descriptor 2 before
its logging is configured, so ``TF_CPP_MIN_LOG_LEVEL`` alone does not silence
them. For command-line use only, stderr is captured while TensorFlow loads and
everything that is not a known notice is written back, so real errors still show.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

_CHATTER = re.compile(
    r"All log messages before absl::InitializeLog"
    r"|cudart_stub|cuda_platform|cuda_dnn|cuda_fft|cuda_blas|cuInit"
    r"|Unable to register cu(DNN|FFT|BLAS) factory"
    r"|oneDNN custom operations are on"
    r"|computation placer already registered"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
    r"|To enable the following instructions"
    r"|TF-TRT Warning"
    r"|absl::InitializeLog")


def import_tensorflow_quietly() -> None:
    """Imports tensorflow (and finds its devices) with start-up notices filtered."""
    if "tensorflow" in sys.modules and getattr(import_tensorflow_quietly, "_done", False):
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if line.strip() and not _CHATTER.search(line):
                    print(line, file=sys.stderr)
    import_tensorflow_quietly._done = True
