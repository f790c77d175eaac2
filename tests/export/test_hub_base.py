"""`finetune export` of a run whose base is a hub id, offline (HF_HUB_OFFLINE=1), its files in a Hugging Face cache
as huggingface_hub lays it out (HF_HOME/hub/models--org--tiny: blobs, snapshots/<commit>, refs/main): the exported
adapter names the hub id at the snapshot's commit, not this machine's cache path; a newer revision fetched since the
run (refs/main moved to other weights) exports on the snapshot the run trained on, said; without that snapshot, or
without the cache, the refusal names the cache and the download. Control: the merged weights are the trained snapshot's, not
the newer one's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, finetune_train

TRAINED, NEWER = "a" * 40, "b" * 40


def cache_snapshot(home: Path, commit: str, model: Path) -> Path:
    """`model`'s files as snapshot `commit` of org/tiny in the cache under `home`, refs/main at it."""
    repo = home / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in model.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # as huggingface_hub writes it: no newline
    return snapshot


def _export(run: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "finetune.cli", "export", str(run), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory, tiny_model_dir):
    """(the run, HF_HOME): 2 LoRA steps of the demo recipe on org/tiny from the cache, offline."""
    root = tmp_path_factory.mktemp("hub")
    cache_snapshot(root / "hf", TRAINED, tiny_model_dir)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(root / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        args = ["--recipe", "demo", "--model.name_or_path=org/tiny", "--data.demo_train_size=16"]
        args += ["--eval.exact_match=false", "--training.max_steps=2", f"--run.output_dir={root / 'run'}"]
        code, out = finetune_train(args, cwd=root)
    assert code == 0, out[-3000:]
    return root / "run", root / "hf"


def test_a_hub_base_exports_by_its_id_and_on_the_snapshot_it_trained_on(hub_run, tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    run, home = hub_run
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = _export(run, "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("org/tiny", TRAINED), config

    newer = tmp_path / "newer"  # a revision fetched after the run: refs/main moves to other weights
    shutil.copytree(tiny_model_dir, newer)
    weights = load_file(str(newer / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] *= 1.5
    save_file(weights, str(newer / "model.safetensors"), metadata={"format": "pt"})
    snapshot = cache_snapshot(home, NEWER, newer)
    try:
        proc = _export(run, "--merge", "--out", str(tmp_path / "merged"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"the cached snapshot {NEWER} holds other weights" in proc.stdout, proc.stdout
        assert f"the base is snapshot {TRAINED}, which holds those the source was trained on" in proc.stdout
        key = "model.layers.0.mlp.up_proj.weight"
        merged = load_file(str(tmp_path / "merged" / "model.safetensors"))[key]
        base = load_file(str(tiny_model_dir / "model.safetensors"))[key]
        assert (merged - base).abs().max() < (merged - weights[key]).abs().max() / 10  # the adapter moved it little

        trained = home / "hub" / "models--org--tiny" / "snapshots" / TRAINED
        trained.rename(home / "aside")  # the cache holds only the newer snapshot
        proc = _export(run, "--merge", "--out", str(tmp_path / "refused"))
        assert proc.returncode == 2 and not (tmp_path / "refused").exists(), proc.stderr
        assert f"holds snapshot {NEWER} and no other with the weights it was trained on" in proc.stderr, proc.stderr
        assert (
            f"the Hugging Face cache {home / 'hub'} (HF_HUB_CACHE, else HF_HOME/hub), HF_HUB_OFFLINE=1" in proc.stderr
        )
        assert f"`hf download org/tiny --revision {TRAINED}`" in proc.stderr, proc.stderr  # run.json inputs.snapshot
        (home / "aside").rename(trained)
    finally:
        shutil.rmtree(snapshot)
        (home / "hub" / "models--org--tiny" / "refs" / "main").write_text(TRAINED)

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))  # the cache moved away
    proc = _export(run, "--merge", "--out", str(tmp_path / "refused"))
    assert proc.returncode == 2, proc.stderr
    empty = tmp_path / "empty" / "hub"
    assert f"not in the Hugging Face cache {empty} (HF_HUB_CACHE, else HF_HOME/hub), HF_HUB_OFFLINE=1" in proc.stderr
    assert "download it (`hf download org/tiny`) or set HF_HOME to the cache it is in" in proc.stderr, proc.stderr
