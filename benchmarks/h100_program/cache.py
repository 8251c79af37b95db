"""Where programs are kept between runs, and the keys that say when one is stale.

    WORK/jax-venv/                                 JAX 0.11.2 (Python 3.12), made on first use
    WORK/programs/SIDE/TAG.hlo.pb, .export.json    the exported step (TensorFlow, CPU)
    WORK/programs/SIDE/h100-CFG/TAG.opt.hlo.txt    the compiled H100 program
    WORK/programs/SIDE/h100-CFG/TAG.compile.json   its memory sizes, compile time, versions

SIDE is ``keras-VERSION-EXPORT`` for the float32 and Keras-policy programs and
``tfamp-SOURCES-keras-VERSION-EXPORT`` for tfamp's, where EXPORT hashes the benchmark's
model definitions and export code and SOURCES hashes the tfamp package the export imports
(the installed one: ``TFAMP_ENABLE=1`` loads tfamp at interpreter start-up). So a change to
tfamp recompiles only tfamp's programs. CFG hashes the target description.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "data", "h100_sxm.txtpb")
DEFAULT_WORK = os.path.join(os.path.expanduser("~"), ".cache", "tfamp-h100")
#: the files whose change changes an exported program
EXPORT_SOURCES = ("models.py", "export_step.py")
SOURCE_SUFFIXES = (".py", ".json", ".html", ".css", ".js", ".txt")


def hash_files(paths, length: int = 12) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:length]


def hash_tree(root: str, length: int = 12) -> str:
    """Hash of a package's source files (names relative to ``root`` and contents)."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(SOURCE_SUFFIXES):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:length]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The cache folders of one run."""

    work: str
    keras_version: str
    tfamp_sources: str | None = None  # hash of the installed tfamp, when tfamp is compiled

    @property
    def export_key(self) -> str:
        return hash_files([os.path.join(HERE, name) for name in EXPORT_SOURCES], 6)

    @property
    def target_key(self) -> str:
        return hash_files([TARGET], 8)

    @property
    def jax_venv(self) -> str:
        return os.path.join(self.work, "jax-venv")

    def side_dir(self, side: str) -> str:
        base = f"keras-{self.keras_version}-{self.export_key}"
        if side == "tfamp":
            if self.tfamp_sources is None:
                raise ValueError("tfamp's programs need the tfamp sources hash")
            base = f"tfamp-{self.tfamp_sources}-{base}"
        return os.path.join(self.work, "programs", base)

    def exported(self, side: str, tag: str) -> str:
        """Prefix of an exported step's files."""
        return os.path.join(self.side_dir(side), tag)

    def compiled(self, side: str, tag: str) -> str:
        """Prefix of a compiled program's files."""
        return os.path.join(self.side_dir(side), f"h100-{self.target_key}", tag)
