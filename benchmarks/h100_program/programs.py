"""One program, exported and compiled for the H100 once: each step in its own subprocess, cached.

The export runs with the project's Python (TensorFlow traces the step), the compile with the
JAX venv's (XLA:GPU 0.11.2); each writes its files under the cache folders of ``cache.py``,
and a later run finds them there. A failed step raises ProgramError naming its log file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time

from benchmarks.h100_program import cache
from benchmarks.h100_program.plan import Mode, tag

log = logging.getLogger("h100_program")

REPO_ROOT = os.path.dirname(os.path.dirname(cache.HERE))


class ProgramError(RuntimeError):
    """An export or a compile failed; the message names the log to read."""


def _step(cmd, *, env, cwd, log_path, what) -> None:
    started = time.perf_counter()
    with open(log_path, "a") as logf:
        logf.write(f"$ {' '.join(cmd)}\n")
        logf.flush()
        done = subprocess.run(cmd, env=env, cwd=cwd, stdout=logf, stderr=subprocess.STDOUT)
    if done.returncode:
        raise ProgramError(f"{what} failed (exit status {done.returncode}); its output is in "
                           f"{log_path}")
    log.debug("%s: %.0f s", what, time.perf_counter() - started)


def export(layout: cache.Layout, model: str, batch: int, mode: Mode, tf_python: str) -> str:
    """Path of the step's ``.hlo.pb``, exported now unless it is cached."""
    name = tag(model, batch, mode)
    prefix = layout.exported(mode.side if mode.side == "tfamp" else "keras", name)
    if os.path.exists(prefix + ".export.json"):
        return prefix + ".hlo.pb"
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    log.info("exporting %s (TensorFlow traces the step) ...", name)
    env = mode.environment(dict(os.environ))
    env.pop("PYTHONPATH", None)  # tfamp: the installed copy, the one the cache key hashed
    _step([tf_python, "-m", "benchmarks.h100_program.export_step", "--model", model,
           "--mode", mode.name, "--batch", str(batch), "--out", prefix],
          env=env, cwd=REPO_ROOT, log_path=prefix + ".log", what=f"export of {name}")
    return prefix + ".hlo.pb"


def compile_h100(layout: cache.Layout, model: str, batch: int, mode: Mode, hlo: str,
                 jax_python: str) -> tuple[str, dict]:
    """(optimized HLO path, compile info) of the step, compiled now unless it is cached."""
    side = mode.side if mode.side == "tfamp" else "keras"
    prefix = layout.compiled(side, tag(model, batch, mode))
    if not os.path.exists(prefix + ".compile.json"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        log.info("compiling %s for an H100 (XLA:GPU, no device) ...", tag(model, batch, mode))
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        _step([jax_python, os.path.join(cache.HERE, "compile_h100.py"), "--hlo", hlo,
               "--target", cache.TARGET, "--out", prefix],
              env=env, cwd=cache.HERE, log_path=prefix + ".log",
              what=f"compile of {tag(model, batch, mode)}")
    with open(prefix + ".compile.json") as f:
        info = json.load(f)
    return prefix + ".opt.hlo.txt", info


def tfamp_estimate(layout: cache.Layout, model: str, batch: int, mode: Mode,
                   tf_python: str) -> dict:
    """tfamp's own XLA estimate of the step (``step_estimate``), made now unless cached.

    Kept with tfamp's programs for every mode, float32's and Keras's too: the estimate is
    tfamp's code, so it is stale when tfamp changes.
    """
    name = tag(model, batch, mode)
    path = layout.exported("tfamp", name) + ".estimate.json"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        log.info("estimating %s with tfamp's XLA cost model ...", name)
        env = mode.environment(dict(os.environ))
        env.pop("PYTHONPATH", None)
        _step([tf_python, "-m", "benchmarks.h100_program.step_estimate", "--model", model,
               "--mode", mode.name, "--batch", str(batch), "--out", path],
              env=env, cwd=REPO_ROOT, log_path=path[:-len(".json")] + ".log",
              what=f"tfamp's estimate of {name}")
    with open(path) as f:
        return json.load(f)
