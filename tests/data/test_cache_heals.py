"""A prepared-data cache that heals (issue 46): an entry damaged, partly deleted or deleted is said and prepared again,
with the same examples; a cache location that cannot be used (a file, no permission, a read-only disk) is named with
the setting that chose it and the fix, by preflight and by the run. Every test points the cache at its own tmp folder.
Before: a partly deleted entry ended in a FileNotFoundError traceback, a cut-short train.arrow in pyarrow's, a cache
setting naming a file in a FileExistsError traceback.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess

import pytest

from finetune.config.sections import DataConfig
from finetune.data import prepare
from finetune.data.build import build_datasets
from finetune.errors import UserError
from finetune.preflight.checks import dataset

ROWS = [{"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(8)]


def cfg(path, cache, **overrides) -> DataConfig:
    return DataConfig(
        **({"path": str(path), "max_length": 64, "cache_dir": str(cache), "eval_fraction": 0.25} | overrides)
    )


def examples(bundle) -> list:
    return [bundle.train[i]["input_ids"] for i in range(len(bundle.train))] + [
        bundle.eval[i]["input_ids"] for i in range(len(bundle.eval))
    ]


@pytest.fixture
def prepared(tmp_path, tokenizer):
    """(data config, the entry's folder, the examples of a first preparation)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    c = cfg(path, tmp_path / "cache")
    first = build_datasets(c, tokenizer, seed=0)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    return c, entry, examples(first)


def _cut(file) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


DAMAGE = {
    "prepared.json deleted": (lambda e: (e / "prepared.json").unlink(), "prepared.json is missing"),
    "train.arrow deleted": (lambda e: (e / "train.arrow").unlink(), "train.arrow is missing"),
    "eval.arrow deleted": (lambda e: (e / "eval.arrow").unlink(), "eval.arrow is missing"),
    "train.arrow cut short": (lambda e: _cut(e / "train.arrow"), "train.arrow is not the file that was written"),
    "prepared.json not JSON": (lambda e: (e / "prepared.json").write_text("{"), "prepared.json does not read"),
    "entry emptied": (lambda e: [f.unlink() for f in e.iterdir()], "prepared.json is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_or_partly_deleted_entry_is_said_and_prepared_again(prepared, tokenizer, caplog, damage):
    c, entry, before = prepared
    do, said = DAMAGE[damage]
    do(entry)
    with caplog.at_level(logging.WARNING, logger="finetune.data.prepare"):
        again = build_datasets(c, tokenizer, seed=0)
    assert f"the prepared data {entry} is damaged ({said}" in caplog.text, caplog.text
    assert examples(again) == before
    assert (entry / "prepared.json").is_file()  # healed in place: the next run finds it whole
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune.data.prepare"):
        assert examples(build_datasets(c, tokenizer, seed=0)) == before
    assert f"prepared data found: {entry}" in caplog.text and "is damaged" not in caplog.text


def _a_file(tmp_path):
    (tmp_path / "cachefile").write_text("not a folder")
    return tmp_path / "cachefile" / "tokenized", f"{tmp_path / 'cachefile'} is a file, not a folder"


def _no_permission(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through permission bits")
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    return folder / "tokenized", "permission denied"


def _read_only(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    folder = tmp_path / "ro"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)], check=True)
    return folder, "is on a read-only file system"


@pytest.mark.parametrize("where", [_a_file, _no_permission, _read_only], ids=["a file", "no permission", "read-only"])
def test_a_cache_location_that_cannot_be_used_is_named_with_the_fix(tmp_path, tokenizer, where):
    cache, said = where(tmp_path)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    c = cfg(path, cache)
    try:
        fix = "set data.cache_dir (or FINETUNE_CACHE) to a folder you can write"
        problems = dataset(
            type("Cfg", (), {"data": c, "eval": type("E", (), {"exact_match": False})})(), None, in_process=True
        )
        assert len(problems) == 1 and f"the prepared-data cache {cache} (from data.cache_dir)" in problems[0], problems
        assert said in problems[0] and fix in problems[0], problems
        with pytest.raises(UserError) as error:  # the run says it too, never a traceback
            build_datasets(c, tokenizer, seed=0)
        assert said in str(error.value) and fix in str(error.value)
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False, capture_output=True)


def test_the_default_cache_location_names_finetune_cache(tmp_path, monkeypatch):
    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cachefile"))
    problem = prepare.cache_problem(DataConfig(path="x.jsonl"))
    assert problem.startswith(f"the prepared-data cache {tmp_path}/cachefile/tokenized (from FINETUNE_CACHE) cannot")
