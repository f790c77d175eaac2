"""The data prepared once per machine on `datasets` (finetune/data/prepare.py): the same examples as a
direct render of each row, reused across runs and prepared anew for each key input, prepared by the
local main process and opened by the others without tokenizing, and visibly progressing in a log.
On main the examples were Python lists in every rank, cached (opt-in) as gzip'd JSON."""

from __future__ import annotations

import copy
import logging
import os
import re
import threading

import pytest

from finetune.data import prepare
from finetune.data.build import build_datasets
from finetune.data.read import DataError
from finetune.data.render import IGNORE_INDEX, Renderer, tokenize
from tests.data.test_data import make_cfg, write_jsonl

ALPACA = [{"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(6)]
CHAT = [
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        + [
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue " * 40}]},
]


def _direct(rows, fmt, tokenizer, cfg):
    """The examples of a per-row render, tokenize and cut, with no datasets and no cache."""
    renderer = Renderer(tokenizer, fmt, cfg, cfg.path)
    out = []
    for ex in tokenize([renderer.render(r) for r in rows], tokenizer):
        ids, labels = ex.input_ids[: cfg.max_length], ex.labels[: cfg.max_length]
        if any(x != IGNORE_INDEX for x in labels):
            out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize(
    "rows,fmt,settings",
    [
        (ALPACA, "alpaca", {}),
        (ALPACA, "alpaca", {"chat_template": False}),
        (ALPACA, "alpaca", {"train_on_prompt": True}),
        (CHAT, "messages", {"max_length": 40}),  # the long answer is cut
        ([{"text": "Plain text to learn."}], "text", {}),
    ],
)
def test_the_prepared_examples_are_those_of_a_direct_render(tokenizer, tmp_path, rows, fmt, settings):
    """Labels identical to a per-row render (the label tests in test_label_rules.py, test_data.py check the
    rules themselves), through the map's processes too (data.num_proc 2)."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = make_cfg(path, cache_dir=str(tmp_path / "cache"), **settings)
    expected = _direct(rows, fmt, tokenizer, cfg)
    assert build_datasets(cfg, tokenizer, seed=0).train.to_list() == expected
    two = make_cfg(path, cache_dir=str(tmp_path / "cache2"), num_proc=2, **settings)
    environ = os.environ
    assert build_datasets(two, tokenizer, seed=0).train.to_list() == expected
    assert os.environ is environ  # datasets' pool rebinds it; defaults bound to the original saw no later change


def test_the_prepared_data_is_reused_and_each_key_input_prepares_anew(tokenizer, tmp_path, caplog, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", ALPACA)
    cache = tmp_path / "cache"

    def build(tok=tokenizer, seed=0, **settings):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="finetune.data.prepare"):
            bundle = build_datasets(make_cfg(path, cache_dir=str(cache), **settings), tok, seed=seed)
        return bundle, "prepared data found" in caplog.text

    first, hit = build()
    assert not hit and len(list(cache.iterdir())) == 1
    second, hit = build(seed=1)  # the seed is not a key input without a split or packing
    assert hit and second.train.to_list() == first.train.to_list() and vars(second.stats) == vars(first.stats)
    assert second.train.cache_files[0]["filename"].startswith(str(cache))  # memory-mapped from the entry
    changes = [{"max_length": 64}, {"format": "alpaca"}, {"train_on_prompt": True}, {"system_prompt": "Be brief."}]
    changes += [{"chat_template": False}, {"on_bad_rows": "skip"}, {"max_samples": 2}, {"split": "other"}]
    changes += [{"eval_fraction": 0.5}, {"eval_fraction": 0.5, "seed": 1}, {"packing": True}]
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template + "\n"
    changes += [{"tok": other}]
    for n, change in enumerate(changes, start=2):
        assert not build(**change)[1], change
        assert len(list(cache.iterdir())) == n, change
        assert build(**change)[1], change  # and reused
    monkeypatch.setattr(prepare, "FORMAT_VERSION", prepare.FORMAT_VERSION + 1)
    assert not build()[1]
    monkeypatch.undo()
    write_jsonl(path, ALPACA[:2])  # other bytes
    changed, hit = build()
    assert not hit and changed.stats.train_examples == 2
    private = build_datasets(make_cfg(path, cache_dir=str(tmp_path / "own"), cache_tokenized=False), tokenizer, seed=0)
    assert private.train.to_list() == changed.train.to_list() and list((tmp_path / "own").iterdir()) == []


def test_the_other_ranks_wait_for_the_local_main_process_and_do_not_tokenize(tokenizer, tmp_path, monkeypatch):
    """LOCAL_RANK 1 waits (checking for a stop) until LOCAL_RANK 0 has prepared the entry, then opens
    it; it never builds. A bad file fails on both, with the main process's message."""
    path = write_jsonl(tmp_path / "rows.jsonl", ALPACA)
    cfg = make_cfg(path, cache_dir=str(tmp_path / "cache"))
    waiting, result = threading.Event(), {}

    def never(*_):
        raise AssertionError("a rank other than the local main process prepared the data")

    def rank_1():
        try:
            result["rank 1"] = prepare.load(cfg, tokenizer, 0, never, waiting.set)
        except BaseException as e:  # noqa: BLE001 - seen by the assertion below
            result["rank 1"] = e

    monkeypatch.setenv("LOCAL_RANK", "1")
    thread = threading.Thread(target=rank_1)
    thread.start()
    assert waiting.wait(30)  # rank 1 polls for the entry
    monkeypatch.setenv("LOCAL_RANK", "0")
    rank_0 = build_datasets(cfg, tokenizer, seed=0)
    thread.join(30)
    train, eval_, facts = result["rank 1"]
    assert train.to_list() == rank_0.train.to_list() and facts["stats"]["train_examples"] == 6

    bad = write_jsonl(tmp_path / "bad.jsonl", [ALPACA[0], {"instruction": 5, "output": "x"}])
    cfg = make_cfg(bad, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as main_error:
        build_datasets(cfg, tokenizer, seed=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DataError) as other_error:
        prepare.load(cfg, tokenizer, 0, never, None)
    assert str(other_error.value) == str(main_error.value) and "row 2: 'instruction' must be a string" in str(
        main_error.value
    )


def test_the_preparation_prints_progress_lines_in_a_log(tokenizer, tmp_path, caplog, capsys, monkeypatch):
    """Not on a terminal (pytest captures stderr): a line with rows done, rows/s and the ETA at least
    every PROGRESS_EVERY_S (30 s; 0.2 s here), and no progress bar. On main nothing was printed."""
    monkeypatch.setattr(prepare, "PROGRESS_EVERY_S", 0.2)
    path = write_jsonl(
        tmp_path / "rows.jsonl", [{"instruction": f"Add {i} and 1.", "output": str(i)} for i in range(8000)]
    )
    with caplog.at_level(logging.INFO, logger="finetune.data.prepare"):
        build_datasets(make_cfg(path, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    lines = re.findall(r"preparing the data: (\d+) of 8000 rows \((\d+) rows/s, ETA (\d+) s\)", caplog.text)
    assert len(lines) >= 2 and int(lines[-1][0]) > int(lines[0][0]) > 0, caplog.text
    assert "prepared 8000 rows in" in caplog.text
    assert "%|" not in capsys.readouterr().err  # datasets' bar is for terminals


def test_every_bad_row_is_named_in_one_message_whichever_process_met_it(tokenizer, tmp_path):
    """Before: the map stopped at the first bad row its share met, so with data.num_proc 2 the row named could be a
    later one (with a note that an earlier one may be bad) and the second was never said. Now every bad row is named,
    in file order, with one process or two."""
    rows = [dict(r) for r in ALPACA * 4]
    rows[2]["output"], rows[19]["output"] = 7, 8  # rows 3 and 20: in the first and the second share
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    for procs in (1, 2):
        with pytest.raises(DataError) as bad:
            build_datasets(make_cfg(path, cache_dir=str(tmp_path / f"c{procs}"), num_proc=procs), tokenizer, seed=0)
        said = str(bad.value)
        assert said.startswith(f"{path}: 2 bad rows"), said
        assert said.index("row 3: 'output' must be a string, got number 7") < said.index("row 20: 'output'"), said
