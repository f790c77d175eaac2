"""Where the shipped recipes/, accelerate_configs/ and ds_configs/ are: the repository's top level, or the copies a
built wheel carries inside the package (finetune/shipped/, setup.py). ROOT is the installed copy when there is one, else
the repository; paths inside the shipped files stay relative to ROOT (`resolve("ds_configs/zero2.json")`).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
FOLDERS = ("recipes", "accelerate_configs", "ds_configs")
INSTALLED_DIR = "shipped"  # finetune/shipped/ in a built wheel (setup.py)

MODEL_CONFIGS = PACKAGE_DIR / "model_configs"  # package data: the published configs `finetune plan --model` knows

ROOT = PACKAGE_DIR / INSTALLED_DIR if (PACKAGE_DIR / INSTALLED_DIR).is_dir() else PACKAGE_DIR.parent
RECIPES = ROOT / "recipes"
ACCELERATE_CONFIGS = ROOT / "accelerate_configs"
DS_CONFIGS = ROOT / "ds_configs"


def resolve(relative: str) -> Path:
    """A path named relative to the resources root (a row of finetune/strategies.py, a
    deepspeed_config_file in an accelerate config) as an absolute path under ROOT."""
    return ROOT / relative


def locate(name: str) -> Path | None:
    """A file as given (absolute, or relative to the working directory), else relative to ROOT
    (`accelerate_configs/zero2.yaml` from any directory); None when neither exists."""
    path = Path(name)
    if not path.is_file() and (ROOT / path).is_file():
        path = ROOT / path
    return path if path.is_file() else None


def cpu_variant(config: Path) -> Path:
    """The accelerate_configs/cpu/ config of the same name (2 processes over gloo, for machines without a GPU;
    finetune/launch/cpu_rehearsal.py), or `config` itself when there is none or it already is one."""
    variant = ACCELERATE_CONFIGS / "cpu" / config.name
    return variant if variant.is_file() and config.parent.name != "cpu" else config


def shown(path: Path) -> str:
    """A path as a launch line should show it: relative to the working directory when under it (from
    the repository root: accelerate_configs/cpu/zero3.yaml), else absolute (an installed package)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
