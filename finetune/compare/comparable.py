"""When two runs' losses may be compared: the same model, data and sequence length, precision
policy, effective batch and applied learning rate (docs/compare.md). Runs are
finetune/compare/table.py `Run`s (anything with `.get(section, *keys, default=)` and `.label`).
"""

from __future__ import annotations

import json

MODEL_KEYS = ("name_or_path", "revision")
# data.max_length is the sequence length (tokens per example and per packed row)
DATA_KEYS = ("path", "format", "split", "max_length", "packing", "max_samples", "eval_fraction", "train_on_prompt")
DEMO_DATA_KEYS = ("demo_train_size", "demo_heldout_size")
RUN_KEYS = (("precision", "policy"), ("batch", "effective"), ("lr", "applied"))
NOT_COMPARABLE = "not comparable"  # the warnings' prefix and the loss cells' mark


def comparison_keys(run) -> dict[str, object]:
    """The values two runs must share for their losses to be compared (docs/compare.md).
    A record without a `precision` section (written before it existed) has policy None: unknown."""
    out: dict[str, object] = {}
    for section, keys in (("model", MODEL_KEYS), ("data", DATA_KEYS)):
        body = run.get("config", section, default={})
        for key in keys + (DEMO_DATA_KEYS if section == "data" and body.get("path") == "demo" else ()):
            out[f"{section}.{key}"] = body.get(key)
    for section, key in RUN_KEYS:
        out[f"{section}.{key}"] = run.get(section, key)
    return out


def differences(run, reference) -> list[str]:
    """The comparison keys on which `run` differs from `reference` ("lr.applied 0.001 != 0.0001")."""
    mine, theirs = comparison_keys(run), comparison_keys(reference)
    return [
        f"{k} {mine.get(k)!r} != {theirs.get(k)!r}"
        for k in dict.fromkeys([*theirs, *mine])
        if json.dumps(mine.get(k), default=str) != json.dumps(theirs.get(k), default=str)
    ]


def warnings(runs: list) -> list[str]:
    """One warning per comparison key on which the runs (with records) differ, naming who has what."""
    out = []
    keys = dict.fromkeys(k for run in runs for k in comparison_keys(run))
    for key in keys:
        values: dict[str, list[str]] = {}
        for run in runs:
            mine = comparison_keys(run)
            if key in mine:
                values.setdefault(json.dumps(mine[key], sort_keys=True, default=str), []).append(run.label)
        if len(values) > 1:
            detail = "; ".join(f"{json.loads(v)!r}: {', '.join(labels)}" for v, labels in values.items())
            out.append(f"{NOT_COMPARABLE}: {key} differs between runs ({detail})")
    return out
