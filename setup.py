"""The one build step pyproject.toml cannot declare: the web view's sources live in the top-level `web/` (static
files, not a Python package) and the wheel ships them inside the service's package, as its `web/` folder.

Everything else (metadata, packages, package data) is in pyproject.toml. pyproject's `package-dir` maps only
packages that `packages` lists, and `packages.find` discovers them by their folder names (so it cannot name
`web/` `replay_service.web`); `data-files` installs outside the packages. Hence this `build_py`: it adds `web/`
to the package data as if it were the package `replay_service.web`, so that the wheel copies it (build_py),
the sdist carries it (sdist reads `data_files`) and SOURCES.txt lists it (egg_info). An editable install copies
nothing: `replay_service.app.WEB_DIR` falls back to the checkout's `web/` when the package has no copy.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

WEB = "web"  # relative to this file's folder, where setuptools runs its commands
PACKAGE = "replay_service.web"  # where the files land in the wheel: the web/ folder of replay_service


class BuildPyWithWeb(build_py):
    """setuptools' build_py, with `web/**` as the package data of `replay_service.web`."""

    def web_data_files(self) -> tuple[str, str, str, list[str]]:
        """One `(package, src_dir, build_dir, filenames)` entry of build_py's `data_files`, as package data has."""
        files = sorted(
            str(p.relative_to(WEB))
            for p in Path(WEB).rglob("*")
            if p.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in p.parts)
        )
        if "index.html" not in files:
            raise FileNotFoundError(f"{os.path.abspath(WEB)}: no index.html, the web view would be left out")
        return PACKAGE, WEB, os.path.join(self.build_lib, *PACKAGE.split(".")), files

    def _get_data_files(self):  # build_py's `data_files`: what it copies, its outputs, what sdist carries
        return [*super()._get_data_files(), self.web_data_files()]

    def get_data_files_without_manifest(self):  # what egg_info lists in SOURCES.txt
        return [*super().get_data_files_without_manifest(), self.web_data_files()]


setup(cmdclass={"build_py": BuildPyWithWeb})
