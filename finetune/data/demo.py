"""The demo dataset: short instructions whose answers can be checked exactly, in five task families
(add, upper, reverse, date, sort), each with a terse output format the untrained instruct model
does not use on its own, so exact match is low before fine-tuning and rises once the model learns
the tasks. Seeded and deterministic; the held-out split shares no instruction with training.

    add       What is 23 + 48? Reply with the number only.                 -> 71
    reverse   Reverse the order of this list: lamp, frog, nut              -> nut, frog, lamp
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = ("add", "upper", "reverse", "date", "sort")

WORDS = (
    "apple river stone cloud tiger lamp frog nut quiet green bread house chair water light "
    "music paper storm candle garden horse silver window winter summer pocket ladder rocket "
    "forest island yellow orange purple violet basket button camera dragon engine falcon "
    "guitar hammer jacket kettle lemon mirror needle ocean pepper rabbit saddle tomato "
    "turtle velvet wagon zebra anchor bridge copper desert feather glove honey iron jungle "
    "kitten meadow nickel orbit pillow quartz ribbon shadow thunder valley walnut"
).split()


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 60), rng.randint(1, 60)
    return f"What is {a} + {b}? Reply with the number only.", str(a + b)


def _upper(rng: random.Random) -> tuple[str, str]:
    words = " ".join(rng.sample(WORDS, 2))
    return f"Write in capital letters: {words}", words.upper()


def _reverse(rng: random.Random) -> tuple[str, str]:
    items = rng.sample(WORDS, 3)
    return f"Reverse the order of this list: {', '.join(items)}", ", ".join(reversed(items))


def _date(rng: random.Random) -> tuple[str, str]:
    y, m, d = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28)
    return f"Rewrite the date {y:04d}-{m:02d}-{d:02d} as DD/MM/YYYY.", f"{d:02d}/{m:02d}/{y:04d}"


def _sort(rng: random.Random) -> tuple[str, str]:
    nums = rng.sample(range(1, 100), 3)
    return (
        f"Sort these numbers from smallest to largest: {', '.join(map(str, nums))}",
        ", ".join(map(str, sorted(nums))),
    )


_MAKERS = {"add": _add, "upper": _upper, "reverse": _reverse, "date": _date, "sort": _sort}


def generate(train_size: int, heldout_size: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows); tasks interleaved round-robin, instructions unique overall."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    total = train_size + heldout_size
    attempts = 0
    while len(rows) < total:
        attempts += 1
        if attempts > 50 * total:
            raise RuntimeError(f"could not generate {total} distinct demo rows")
        task = TASKS[len(rows) % len(TASKS)]
        instruction, output = _MAKERS[task](rng)
        if instruction in seen:
            continue
        seen.add(instruction)
        rows.append({"instruction": instruction, "input": "", "output": output, "task": task})
    # Held-out rows come from the same stream, after the training rows: same distribution,
    # no shared instruction.
    return rows[:train_size], rows[train_size:]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_demo(directory: Path, train_size: int, heldout_size: int, seed: int = 0) -> tuple[Path, Path]:
    """Write train.jsonl and heldout.jsonl into `directory`; returns their paths."""
    train, heldout = generate(train_size, heldout_size, seed)
    return write_jsonl(train, directory / "train.jsonl"), write_jsonl(heldout, directory / "heldout.jsonl")


def paths(cfg, run_dir: Path) -> tuple[str, str | None]:
    """(data.path, eval.heldout_path) as a run reads them: `demo` is its run directory's data/."""
    if cfg.data.path != "demo":
        return cfg.data.path, cfg.eval.heldout_path
    heldout = str(run_dir / "data" / "heldout.jsonl") if cfg.eval.heldout_path == "demo" else cfg.eval.heldout_path
    return str(run_dir / "data" / "train.jsonl"), heldout
