"""Build step for setuptools: empty ``build/lib`` before copying the packages into it.

setuptools copies everything already in ``build/lib`` into the wheel, so a module deleted from
git, or anything an earlier build left there, would ship again. Not part of the product (it is
used only by ``pip install .`` / ``pip wheel .``; pyproject.toml names it as ``build_py``).
"""

from __future__ import annotations

import shutil

from setuptools.command.build_py import build_py


class CleanBuildPy(build_py):
    def run(self) -> None:
        if not self.editable_mode:
            shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()
