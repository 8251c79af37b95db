"""Packaging: metadata is in setup.cfg; this adds the interpreter start-up hook.

``tfamp_startup.pth`` lands at the root of site-packages, where Python runs its
``import`` line at every start-up. The line only reads TFAMP_ENABLE (``os`` is
already imported by then) and imports tfamp only when it is set.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = "tfamp_startup.pth"


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        self.copy_file(HOOK, os.path.join(self.build_lib, HOOK))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, HOOK)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
