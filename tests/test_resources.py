"""Resources that install: a wheel built from the repository carries the shipped recipes and
accelerate/DeepSpeed configs, and an installed `finetune` (a fresh virtual environment, run from
another directory) lists the recipes and resolves `--recipe zero2` to its accelerate config and
DeepSpeed JSON inside the installed package. The source checkout's own lookup is checked too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from finetune import resources
from tests.conftest import REPO

# What a build needs from the repository (setup.py copies the three folders into the wheel).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "finetune", *resources.FOLDERS)


def shipped_files() -> set[str]:
    return {str(p.relative_to(REPO)) for name in resources.FOLDERS for p in (REPO / name).rglob("*") if p.is_file()}


def test_a_source_checkout_finds_the_top_level_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # from any directory
    assert resources.ROOT == REPO and resources.RECIPES == REPO / "recipes"
    assert resources.locate("accelerate_configs/zero2.yaml") == REPO / "accelerate_configs" / "zero2.yaml"
    assert resources.locate("accelerate_configs/nope.yaml") is None
    assert (
        resources.cpu_variant(REPO / "accelerate_configs" / "zero2.yaml")
        == REPO / "accelerate_configs" / "cpu" / "zero2.yaml"
    )


def _run(cmd, *, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # only the venv's finetune
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


RESOLVE = r"""
import json, finetune
from finetune import resources
from finetune.launch.accelerate import launch_command
args = launch_command("zero2", [], None, None)
print(json.dumps({"package": finetune.__file__, "root": str(resources.ROOT), "args": args}))
"""


@pytest.mark.integration
def test_an_installed_wheel_lists_the_recipes_and_resolves_configs(tmp_path, tiny_model_dir):
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src],
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("finetune-*.whl")
    carried = {
        n.removeprefix("finetune/shipped/")
        for n in zipfile.ZipFile(wheel).namelist()
        if n.startswith("finetune/shipped/")
    }
    assert carried == shipped_files()

    venv = tmp_path / "venv"
    # no pip of its own (ensurepip costs seconds): this interpreter's pip installs into it
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=tmp_path)
    _run(
        [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q", wheel],
        cwd=tmp_path,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    listed = _run([venv / "bin" / "finetune", "recipes"], cwd=elsewhere)
    assert [line.split()[0] for line in listed.splitlines() if not line.startswith(" ")] == sorted(
        p.stem for p in (REPO / "recipes").glob("*.yaml")
    )
    # issue 27 item 7: the model configs ship as package data and `finetune plan` takes them by name
    assert {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("finetune/model_configs/")} == {
        f"finetune/model_configs/{p.name}" for p in (REPO / "finetune" / "model_configs").glob("*.json")
    }
    planned = json.loads(
        _run(
            [venv / "bin" / "finetune", "plan", "--recipe", "zero2", "--model", "Llama-3.2-1B", "--json"], cwd=elsewhere
        )
    )
    assert planned["model"]["name"] == "Llama-3.2-1B" and planned["model"]["layers"] == 16
    # ... and `accelerate launch -m finetune.train` trains from outside a clone (one process, 2 steps)
    run = elsewhere / "runs" / "m"
    _run(
        [
            venv / "bin" / "python", "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "finetune.train", "--recipe", "zero2",
            f"--model.name_or_path={tiny_model_dir}", "--data.demo_train_size=16", "--eval.exact_match=false",
            "--training.max_steps=2", f"--run.output_dir={run}",
        ],
        cwd=elsewhere,
    )  # fmt: skip
    record = json.loads((run / "run.json").read_text())
    assert record["summary"]["status"] == "completed" and record["strategy"]["name"] == "zero2"
    assert record["strategy"]["setup"]["launcher"] == "accelerate launch"

    got = json.loads(_run([venv / "bin" / "python", "-c", RESOLVE], cwd=elsewhere).strip().splitlines()[-1])
    installed = Path(got["package"]).parent
    assert installed.is_relative_to(venv) and Path(got["root"]) == installed / "shipped"
    args = got["args"]
    config, ds_json = Path(args[args.index("--config_file") + 1]), Path(args[args.index("--deepspeed_config_file") + 1])
    assert config == installed / "shipped" / "accelerate_configs" / "zero2.yaml" and config.is_file()
    assert ds_json == installed / "shipped" / "ds_configs" / "zero2.json" and ds_json.is_file()
    assert Path(args[args.index("--recipe") - 1]) == installed / "train.py"
