"""A run knows what it was made from (issue 46): run.json `inputs` holds content fingerprints of the base weights, the
tokenizer, its chat template, each data file and the settings; a `--resume` compares them with the checkpoint's and
names exactly what changed, refused (exit 2) unless --allow-input-change, which is recorded. Before: base weights
replaced in place (same config.json) resumed silently, exit 0, and an edited chat template was refused as "the
training data differs".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from datetime import datetime
from types import SimpleNamespace

import pytest
import xxhash

from finetune import fingerprints
from finetune.checkpointing import provenance
from finetune.config.validate import build_config
from tests.training.test_faults import cli_train

ROWS = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(16)]


def _checksum(path) -> str:
    """xxh3-128 of the file, read here (not through finetune)."""
    return xxhash.xxh3_128(open(path, "rb").read()).hexdigest()


def _edit_template(model) -> None:
    template = model / "chat_template.jinja"
    template.write_text("{{ 'You are brief.' }}\n" + template.read_text())


def _other_weights(model) -> None:
    """Other weights saved over model.safetensors in place; config.json untouched."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, model / "model.safetensors", metadata={"format": "pt"})


def test_the_cache_reads_a_file_once_and_again_when_it_is_rewritten_in_place(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(1 << 22))
    cache = fingerprints.Cache(tmp_path / "cache.json")
    assert cache.of(path) == _checksum(path) and cache.bytes_read == 1 << 22
    cache.save()
    again = fingerprints.Cache(tmp_path / "cache.json")
    assert again.of(path) == _checksum(path) and again.bytes_read == 0  # from the cache: not read
    st = path.stat()
    with open(path, "r+b") as f:  # same size, same mtime set back: only the ctime tells
        f.write(b"\xff" * 16)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    third = fingerprints.Cache(tmp_path / "cache.json")
    assert third.of(path) == _checksum(path) and third.bytes_read == 1 << 22  # read again: the change is seen


def test_each_input_is_fingerprinted_and_only_what_changed_is_named(tmp_path, tiny_model_dir):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    data = tmp_path / "shards"
    data.mkdir()
    for i in range(2):
        (data / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[8 * i : 8 * i + 8]))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    asked = {"exact_match": True, "heldout_path": str(heldout)}
    cfg = build_config({"model": {"name_or_path": str(model)}, "data": {"path": str(data)}, "eval": asked})
    before = provenance.inputs(cfg, str(data), str(heldout))
    assert before["heldout_files"] == {"": _checksum(heldout)}
    assert before["weight_files"] == {n: _checksum(model / n) for n in ("config.json", "model.safetensors")}
    assert before["data_files"] == {f"part-{i}.jsonl": _checksum(data / f"part-{i}.jsonl") for i in range(2)}
    assert before["chat_template_files"] == {"chat_template.jinja": _checksum(model / "chat_template.jinja")}
    assert set(before["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert provenance.input_changes(before, provenance.inputs(cfg, str(data), str(heldout))) == []  # nothing changed

    _edit_template(model)
    changes = provenance.input_changes(before, provenance.inputs(cfg, str(data), str(heldout)))
    assert [c["input"] for c in changes] == ["chat_template"], changes  # not the tokenizer, not the data
    assert "chat_template.jinja differs" in changes[0]["said"]

    _other_weights(model)
    (data / "part-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[8:15]))
    (data / "part-2.jsonl").write_text(json.dumps(ROWS[15]) + "\n")
    heldout.write_text("".join(json.dumps(r) + "\n" for r in ROWS[4:8]))  # the held-out answers replaced in place
    changes = provenance.input_changes(before, provenance.inputs(cfg, str(data), str(heldout)))
    said = {c["input"]: c["said"] for c in changes}
    assert list(said) == ["weights", "chat_template", "data", "heldout"], said
    assert said["heldout"].startswith("the held-out evaluation data changed")
    assert "model.safetensors differs" in said["weights"] and "config.json" not in said["weights"]
    assert "part-1.jsonl differs, part-2.jsonl is new" in said["data"]
    moved = build_config(
        {"model": {"name_or_path": str(model)}, "data": {"path": str(data), "max_length": 99}, "eval": asked}
    )
    assert [c["input"] for c in provenance.input_changes(before, provenance.inputs(moved, str(data), str(heldout)))][
        -1
    ] == "settings"
    unevaluated = build_config({"model": {"name_or_path": str(model)}, "data": {"path": str(data)}})
    assert provenance.inputs(unevaluated, str(data), str(heldout))["heldout"] is None  # read only by exact match


@pytest.mark.integration
def test_a_resume_names_what_changed_and_allow_input_change_records_it(tmp_path, tiny_model_dir):
    """Through `finetune train`, as users resume: a run of two steps, then its checkpoint-1 resumed after the weights
    were replaced in place, after the template was edited too, and then with --allow-input-change."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run_dir = tmp_path / "run"
    args = [
        *("--recipe", "demo", f"--model.name_or_path={model}", f"--data.path={data}", "--eval.exact_match=false"),
        *("--training.max_steps=2", "--training.save_strategy=steps", "--training.save_steps=1"),
        *("--training.per_device_train_batch_size=4", "--training.logging_steps=1"),
    ]
    code, out, _ = cli_train(args, run_dir=run_dir, env={})
    assert code == 0, out[-4000:]
    inputs = json.loads((run_dir / "run.json").read_text())["inputs"]
    assert inputs["weight_files"]["model.safetensors"] == _checksum(model / "model.safetensors")
    assert inputs["data_files"] == {"": _checksum(data)}
    resume = [*args, f"--resume={run_dir}/checkpoint-1"]

    _other_weights(model)  # replaced in place: before, this resumed silently onto the other weights, exit 0
    code, out, _ = cli_train(resume, run_dir=run_dir, env={})
    assert code == 2, out[-4000:]
    assert "checkpoint-1 was trained on other inputs: the base weights changed" in out, out[-4000:]
    assert "model.safetensors differs" in out and "--allow-input-change" in out and "Traceback" not in out

    _edit_template(model)  # before: "the training data differs from the data it was trained on"
    code, out, _ = cli_train(resume, run_dir=run_dir, env={})
    assert code == 2, out[-4000:]
    assert "the base weights changed" in out and "the chat template changed" in out, out[-4000:]
    assert "training data" not in out, out[-4000:]
    assert json.loads((run_dir / "run.json").read_text())["inputs"] == inputs  # the run's record untouched

    code, out, _ = cli_train([*resume, "--allow-input-change"], run_dir=run_dir, env={})
    assert code == 0, out[-4000:]
    record = json.loads((run_dir / "run.json").read_text())
    changed = record["resumes"][-1]["input_changes"]
    assert [c["input"] for c in changed] == ["weights", "chat_template"], changed
    assert record["inputs"]["weight_files"]["model.safetensors"] == _checksum(model / "model.safetensors")
    assert record["summary"]["status"] == "completed" and record["summary"]["resumed_at_step"] == 1
    assert "inputs changed (--allow-input-change" in out, out[-4000:]
    # the summary covers the whole run: both segments' wall time (each from its start to its end), and says it resumed
    segments = record["resumes"]
    assert [s["steps_trained"] for s in segments] == [2, 1], segments
    walls = [(datetime.fromisoformat(s["ended"]) - datetime.fromisoformat(s["at"])).total_seconds() for s in segments]
    assert record["summary"]["run_wall_s"] == pytest.approx(sum(walls), abs=0.05), (record["summary"], walls)
    lines = [" ".join(line.split()) for line in out.splitlines()]  # the table's columns padded: one space
    assert f"resumed 1 time(s), last from {run_dir}/checkpoint-1 at step 1" in lines, out[-3000:]
    assert any(line.startswith(f"wall time {sum(walls):.0f} s over 2 segments; this launch") for line in lines)


@pytest.mark.parametrize(
    "changes,compared,said",
    [
        ([], False, "the training data differs from the data it was trained on"),  # a checkpoint without `inputs`
        ([], True, "its data files, tokenizer and chat template are the ones it was trained on, so the tokenizing"),
        ([{"input": "settings", "said": "the settings changed"}], True, "the settings --allow-config-change applied"),
    ],
)
def test_rows_that_differ_are_blamed_on_their_actual_cause(changes, compared, said):
    """Once the data is built: other rows with the same inputs are the tokenizing's doing, not the data's (before,
    every difference was "the training data differs"); other rows after --allow-input-change are said, not refused."""
    from finetune.checkpointing import resume_plan
    from finetune.errors import UserError

    plan = SimpleNamespace(checkpoint="runs/x/checkpoint-3", data={"train_rows": 8, "fingerprint": "a" * 64})
    plan.input_changes, plan.inputs_compared = changes, compared
    with pytest.raises(UserError, match=re.escape(said)):
        resume_plan.check_data(plan, rows=8, fingerprint="b" * 64)
    plan.input_changes = [{"input": "chat_template", "said": "the chat template changed"}]  # allowed
    resume_plan.check_data(plan, rows=8, fingerprint="b" * 64)
