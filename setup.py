"""The build step pyproject.toml cannot declare: a wheel (and `pip install .`) carries the shipped
recipes/, accelerate_configs/ and ds_configs/ inside the package, as finetune/shipped/, because
nothing outside a package is installed. In the repository they stay top-level folders, where
users launch from; finetune/resources.py finds either. An editable install reads them from the
repository, so nothing is copied then. Metadata and dependencies: pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

FOLDERS = ("recipes", "accelerate_configs", "ds_configs")  # = finetune/resources.py FOLDERS
INSTALLED_DIR = "shipped"  # = finetune/resources.py INSTALLED_DIR


class BuildPyWithResources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        root = Path(__file__).resolve().parent
        for name in FOLDERS:
            target = Path(self.build_lib) / "finetune" / INSTALLED_DIR / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(root / name, target, ignore=shutil.ignore_patterns("__pycache__"))


setup(cmdclass={"build_py": BuildPyWithResources})
