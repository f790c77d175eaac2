"""Packing: whole examples concatenated into rows of at most max_length tokens (data.packing).

Best-fit decreasing: examples sorted longest first, each put into the open row whose free space is the SMALLEST that
still holds it, else into a new row (docs/speed.md "Packing": 0.33% of positions empty where next-fit left 13.6%).
"Smallest free space >= n" is a search in a max-segment-tree over the free-space values 1..max_length, so packing is O(n
log n + n log max_length): 200,000 lengths at 2,048 in under 2 s.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

from finetune.data.render import IGNORE_INDEX, Example

ALGORITHM = "best_fit_decreasing"


class _FreeSpaceTree:
    """Max-segment-tree over free-space values 1..capacity: leaf v holds v while some row has v free."""

    def __init__(self, capacity: int):
        self.size = 1 << max(capacity - 1, 0).bit_length()
        self.tree = [0] * (2 * self.size)

    def set(self, value: int, present: bool) -> None:
        i = self.size + value - 1
        self.tree[i] = value if present else 0
        i >>= 1
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i >>= 1

    def smallest_at_least(self, need: int) -> int:
        """The smallest present value >= need, or 0 when there is none."""
        if self.tree[1] < need:
            return 0
        i = 1
        while i < self.size:  # the leftmost leaf holding a value >= need
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        return self.tree[i]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of example indices, each row's lengths summing to <= capacity. Deterministic: ties in
    length are taken in index order, rows with equal free space first-opened first."""
    bad = [n for n in lengths if not 0 < n <= capacity]
    if bad:
        raise ValueError(f"packing: example lengths must be in 1..{capacity} (max_length), got {bad[:5]}")
    tree = _FreeSpaceTree(capacity)
    with_free: dict[int, deque] = defaultdict(deque)  # free space -> rows that have exactly that much
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        space = tree.smallest_at_least(n)
        if space:
            r = with_free[space].popleft()
            if not with_free[space]:
                tree.set(space, False)
        else:
            r = len(rows)
            rows.append([])
            free.append(capacity)
        rows[r].append(i)
        free[r] -= n
        if free[r]:
            if not with_free[free[r]]:
                tree.set(free[r], True)
            with_free[free[r]].append(r)
    return rows


def pack(examples: list[Example], max_length: int, seed: int) -> list[dict]:
    """Whole examples in rows of <= max_length tokens (best-fit decreasing), rows in seeded
    shuffled order (best-fit emits them longest example first)."""
    return [
        packed_row([examples[i] for i in group])
        for group in bins([len(e.input_ids) for e in examples], max_length, seed)
    ]


def bins(lengths: list[int], max_length: int, seed: int) -> list[list[int]]:
    """The packed rows as example indices (best-fit decreasing), in seeded shuffled order."""
    groups = best_fit_decreasing(lengths, max_length)
    random.Random(seed).shuffle(groups)
    return groups


def packed_row(examples: list[Example]) -> dict:
    """One packed row. position_ids restart at 0 for each example; with no attention mask, transformers turns that into
    a block-diagonal causal mask, so examples in a row do not attend to each other. Labels are shifted inside the model
    (logits[t] is scored against labels[t + 1]), so the label at the first token of every example after the first would
    be predicted from the last token of the previous example; it is set to -100 to drop that cross-example target."""
    row: dict = {"input_ids": [], "labels": [], "position_ids": []}
    for k, ex in enumerate(examples):
        labels = list(ex.labels)
        if k:
            labels[0] = IGNORE_INDEX
        row["input_ids"].extend(ex.input_ids)
        row["labels"].extend(labels)
        row["position_ids"].extend(range(len(ex.input_ids)))
    return row
