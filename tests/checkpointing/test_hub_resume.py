"""`finetune train --resume` of a run whose base is a hub id, offline (HF_HUB_OFFLINE=1), from a Hugging Face cache as
huggingface_hub lays it out (tests/export/test_hub_base.py cache_snapshot): run.json `inputs.snapshot` records the
commit the run trained on; after a newer revision was fetched (refs/main moved to other weights) the resume loads the
recorded snapshot by its commit (model.revision), said, as `finetune export` does; without it in the cache the
refusal names the cache, HF_HUB_OFFLINE and `hf download org/tiny --revision <commit>`. Before: refused, "put them
back", which means nothing for a hub id."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import finetune_train
from tests.export.test_hub_base import NEWER, TRAINED, cache_snapshot

pytestmark = pytest.mark.integration


def test_a_resume_after_a_newer_revision_was_fetched_loads_the_snapshot_it_trained_on(
    tmp_path, tiny_model_dir, monkeypatch
):
    from safetensors.torch import load_file, save_file

    home, run = tmp_path / "hf", tmp_path / "run"
    cache_snapshot(home, TRAINED, tiny_model_dir)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--recipe", "demo", "--model.name_or_path=org/tiny", "--data.demo_train_size=16"]
    args += ["--eval.exact_match=false", "--training.max_steps=2", f"--run.output_dir={run}"]
    args += ["--training.save_strategy=steps", "--training.save_steps=1"]
    code, out = finetune_train(args, cwd=tmp_path)
    assert code == 0, out[-3000:]
    assert json.loads((run / "run.json").read_text())["inputs"]["snapshot"] == TRAINED

    newer = shutil.copytree(tiny_model_dir, tmp_path / "newer")  # fetched since: refs/main moves to other weights
    weights = load_file(str(newer / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] *= 1.5
    save_file(weights, str(newer / "model.safetensors"), metadata={"format": "pt"})
    cache_snapshot(home, NEWER, newer)
    resume = [*args, f"--resume={run}/checkpoint-1"]

    trained = home / "hub" / "models--org--tiny" / "snapshots" / TRAINED
    trained.rename(tmp_path / "aside")  # the cache holds only the newer snapshot: refused, naming the download
    code, out = finetune_train(resume, cwd=tmp_path)
    assert code == 2, out[-3000:]
    assert "checkpoint-1 was trained on other inputs: the base weights changed" in out, out[-3000:]
    said = " ".join(out.split())  # the problem's lines wrapped
    assert f"the Hugging Face cache {home / 'hub'} (HF_HUB_CACHE, else HF_HOME/hub), HF_HUB_OFFLINE=1" in said, said
    assert f"holds snapshot {NEWER} and no other with the weights it was trained on" in said, said
    assert f"`hf download org/tiny --revision {TRAINED}`" in said and "put them back" not in said, said
    (tmp_path / "aside").rename(trained)

    code, out = finetune_train(resume, cwd=tmp_path)  # before: refused, "put them back"
    assert code == 0, out[-3000:]
    assert f"base: the cached snapshot {TRAINED} (model.revision), which holds the weights checkpoint-1" in out, out
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["model"]["revision"] == TRAINED and record["inputs"]["snapshot"] == TRAINED
    assert record["resumes"][-1]["input_changes"] == [], record["resumes"][-1]  # the settings too: nothing changed
    assert record["summary"]["status"] == "completed" and record["summary"]["resumed_at_step"] == 1
