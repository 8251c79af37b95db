"""The two Pythons a run needs: the project's (TensorFlow, Keras 3, tfamp) and JAX 0.11.2's venv.

JAX 0.11.2 wheels need Python 3.12 and stay out of tfamp's dependencies: on first use the
benchmark makes a venv under the work folder from a Python 3.12 it finds (pyenv's
``~/.pyenv/versions/3.12*``, then ``python3.12`` on PATH) and installs the pinned packages
into it (about 1.2 GB). ``--jax-python`` points at an existing one instead.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess

log = logging.getLogger("h100_program")

JAX_VERSION = "0.11.2"
#: the JAX venv's packages: the CUDA plugin holds XLA:GPU; nvcc's wheel brings ptxas, which
#: XLA:GPU calls to turn its PTX into machine code, device or not
JAX_PACKAGES = (f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}",
                f"jax-cuda12-plugin=={JAX_VERSION}", f"jax-cuda12-pjrt=={JAX_VERSION}",
                "nvidia-cuda-nvcc-cu12==12.9.86")
READY = ".tfamp-h100-ready"


class ToolchainError(RuntimeError):
    """A Python the benchmark needs is missing or broken; the message says how to fix it."""


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def python_312_candidates() -> list[str]:
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    on_path = shutil.which("python3.12")
    return found + ([on_path] if on_path else [])


def check_jax_python(python: str) -> str:
    """``python`` if it imports JAX at the pinned version, else a ToolchainError."""
    if not os.path.exists(python):
        raise ToolchainError(f"--jax-python {python!r} does not exist; expected the python of "
                             f"a venv with jax=={JAX_VERSION} and jax-cuda12-plugin")
    probe = _run([python, "-c", "import jax, jax_plugins; print(jax.__version__)"],
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
    version = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    if probe.returncode or version != JAX_VERSION:
        error = (probe.stderr.strip().splitlines() or [""])[-1]
        got = f"jax {version}" if version else f"an error ({error})"
        raise ToolchainError(
            f"--jax-python {python!r} should import jax {JAX_VERSION} with its CUDA plugin; "
            f"it gave {got}. Leave the option out to let the benchmark make its own venv.")
    return python


def jax_python(venv: str) -> str:
    """The JAX venv's python, made (with a message) on first use."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(os.path.join(venv, READY)):
        return python
    bases = [p for p in python_312_candidates() if _run([p, "--version"]).returncode == 0]
    if not bases:
        raise ToolchainError(
            f"JAX {JAX_VERSION} needs Python 3.12 and none was found (looked for "
            "~/.pyenv/versions/3.12*/bin/python and python3.12 on PATH). Install one "
            "(e.g. `pyenv install 3.12`) or pass --jax-python PATH of a venv with "
            f"{' '.join(JAX_PACKAGES)}.")
    log.info("first use: making a JAX %s venv in %s from %s (about 1.2 GB, a few minutes; "
             "later runs reuse it)", JAX_VERSION, venv, bases[0])
    made = _run([bases[0], "-m", "venv", "--clear", venv])
    if made.returncode:
        raise ToolchainError(f"could not make a venv in {venv}: {made.stderr.strip()[-500:]}")
    pip = _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                *JAX_PACKAGES])
    if pip.returncode:
        raise ToolchainError(f"installing {' '.join(JAX_PACKAGES)} into {venv} failed "
                             f"(pip's last lines below); fix and run again, or pass "
                             f"--jax-python.\n{pip.stderr.strip()[-1500:]}")
    check_jax_python(python)
    with open(os.path.join(venv, READY), "w") as f:
        f.write("\n".join(JAX_PACKAGES) + "\n")
    return python


def project_facts(python: str) -> dict:
    """Keras's version and the folder of the tfamp that ``TFAMP_ENABLE=1`` would load.

    Asked of a subprocess started outside the checkout, so the installed tfamp answers
    (the start-up hook imports it before the script's folder is on the path).
    """
    code = ("import os, json, keras, tfamp; print(json.dumps({'keras': keras.__version__, "
            "'tfamp_dir': os.path.dirname(os.path.abspath(tfamp.__file__))}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    probe = _run([python, "-c", code], cwd=os.path.expanduser("~"), env=env)
    if probe.returncode:
        raise ToolchainError(f"{python} could not import keras and tfamp (run "
                             f"scripts/setup.sh first): {probe.stderr.strip()[-500:]}")
    import json
    return json.loads(probe.stdout.strip().splitlines()[-1])
