"""Best-fit-decreasing packing (finetune/data/pack.py): little padding on realistic lengths, whole
examples, boundaries masked, deterministic.

Lengths: the benchmark's distribution (prompt log-normal median 60, sigma 0.8; response median 180,
sigma 0.9; clipped to the row), drawn here with its own generator. The control is the packing this
replaced (next-fit on a seeded shuffle), written out below: on the same lengths it leaves > 10% of
the row positions empty, so the < 2% bound is not met by any packing.
"""

from __future__ import annotations

import math
import random

import pytest

from finetune.data import pack
from finetune.data.render import IGNORE_INDEX, Example


def padding_share(row_lengths: list[int], max_length: int) -> float:
    """1 - real tokens / (rows x max_length): the share of row positions that hold no token."""
    return 1 - sum(row_lengths) / (len(row_lengths) * max_length) if row_lengths else 0.0


def lengths(n: int, row: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = max(4, min(int(rng.lognormvariate(math.log(60), 0.8)), row // 2))
        response = max(4, min(int(rng.lognormvariate(math.log(180), 0.9)), row - prompt))
        out.append(prompt + response)
    return out


def next_fit_shuffled(lens: list[int], capacity: int, seed: int) -> list[list[int]]:
    """The previous packing: seeded shuffle, close the row as soon as the next example does not fit."""
    order = list(range(len(lens)))
    random.Random(seed).shuffle(order)
    rows, current, used = [], [], 0
    for i in order:
        if current and used + lens[i] > capacity:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += lens[i]
    return rows + [current]


@pytest.mark.parametrize("row", [2048, 512])
def test_padding_below_two_percent_on_realistic_lengths(row):
    lens = lengths(2000, row)
    rows = pack.best_fit_decreasing(lens, row)
    totals = [sum(lens[i] for i in r) for r in rows]
    assert sorted(i for r in rows for i in r) == list(range(len(lens)))  # every example once
    assert max(totals) <= row
    share = padding_share(totals, row)
    assert share == 1 - sum(lens) / (len(rows) * row)
    assert share < 0.02, share
    old = padding_share([sum(lens[i] for i in r) for r in next_fit_shuffled(lens, row, 0)], row)
    assert old > 0.10, old  # control: the packing this replaced
    assert len(rows) <= math.ceil(sum(lens) / row) * 1.02  # within 2% of the lower bound on rows


def test_best_fit_takes_the_tightest_row():
    # decreasing: 6 opens row 0 (2 free), 5 opens row 1 (3 free), 4 opens row 2 (4 free);
    # 3 -> row 1 (the tightest with room, 0 free left), 2 -> row 0, 2 -> row 2, 1 -> row 2
    assert pack.best_fit_decreasing([2, 5, 1, 6, 3, 4, 2], 8) == [[3, 0], [1, 4], [5, 6, 2]]
    assert pack.best_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match=r"1\.\.8"):
        pack.best_fit_decreasing([3, 9], 8)


def test_rows_keep_examples_whole_and_mask_boundaries():
    rng = random.Random(1)
    examples = []
    for n in lengths(300, 256, seed=2):
        ids = [rng.randrange(1, 1000) for _ in range(n)]
        examples.append(Example(ids, [IGNORE_INDEX] * (n // 4) + ids[n // 4 :]))
    rows = pack.pack(examples, 256, seed=0)
    assert rows == pack.pack(examples, 256, seed=0)  # deterministic
    assert [r["input_ids"] for r in rows] != [r["input_ids"] for r in pack.pack(examples, 256, seed=1)]  # seeded order
    pieces = []
    for row in rows:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) <= 256
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for k, (a, b) in enumerate(zip(starts, starts[1:])):
            assert row["position_ids"][a:b] == list(range(b - a))
            pieces.append((tuple(row["input_ids"][a:b]), k, row["labels"][a:b]))
    by_ids = {tuple(e.input_ids): e.labels for e in examples}
    assert sorted(p[0] for p in pieces) == sorted(tuple(e.input_ids) for e in examples)  # whole, once
    for ids, k, labels in pieces:
        want = list(by_ids[ids])
        if k:  # predicted from the previous example's last token: never a target
            want[0] = IGNORE_INDEX
        assert labels == want
