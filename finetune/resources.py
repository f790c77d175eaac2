"""Where the shipped recipes/, accelerate_configs/ and ds_configs/ are.

In the repository they are top-level folders beside the package (users launch from there:
`accelerate launch --config_file accelerate_configs/zero2.yaml finetune/train.py ...`). A built
wheel, or `pip install .`, carries copies of them inside the package as finetune/shipped/
(setup.py's build step), because nothing outside the package is installed. ROOT is whichever
of the two exists: the installed copy first (an installed package's parent folder is
site-packages, which holds no recipes of ours), else the repository's top level (a source
checkout or an editable install).

Paths inside the shipped files stay relative to ROOT: the accelerate configs name their
DeepSpeed JSON as `ds_configs/zero2.json`, which `resolve()` turns into ROOT/ds_configs/zero2.json.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
FOLDERS = ("recipes", "accelerate_configs", "ds_configs")
INSTALLED_DIR = "shipped"  # finetune/shipped/ in a built wheel (setup.py)

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
    """The accelerate_configs/cpu/ config of the same name (2 processes over gloo, for machines
    without a GPU; finetune/launch/cpu_rehearsal.py), or `config` itself when there is none or it
    already is one."""
    variant = ACCELERATE_CONFIGS / "cpu" / config.name
    return variant if variant.is_file() and config.parent.name != "cpu" else config
