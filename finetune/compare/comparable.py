"""When two runs may be compared: the same work (model, data and task) for a reference a run is measured against (its
speedup, memory ratio, scaling efficiency), and with that the same precision policy, effective batch and applied
learning rate for their losses (docs/compare.md). The model and the data are their content fingerprints (run.json
`inputs`, finetune/checkpointing/provenance.py) when both records have them, else their names. Runs are
finetune/compare/table.py `Run`s (anything with `.get(section, *keys, default=)` and `.label`).
"""

from __future__ import annotations

import json

MODEL_KEYS = ("name_or_path", "revision")
# data.max_length is the sequence length (tokens per example and per packed row)
DATA_KEYS = ("path", "format", "split", "max_length", "packing", "max_samples", "eval_fraction", "train_on_prompt")
# How the rows become examples: the task, beside the data's content.
TASK_KEYS = ("format", "split", "max_length", "packing", "max_samples", "eval_fraction", "train_on_prompt")
TASK_KEYS += ("system_prompt", "chat_template")
DEMO_DATA_KEYS = ("demo_train_size", "demo_heldout_size")
FINGERPRINTS = ("weights", "data", "tokenizer", "chat_template")  # run.json `inputs`
RUN_KEYS = (("precision", "policy"), ("batch", "effective"), ("lr", "applied"))
NOT_COMPARABLE = "not comparable"  # the warnings' prefix and the loss cells' mark
_WORK = {"inputs.weights": "model", "inputs.data": "data", "model.": "model", "data.path": "data", "data.demo_": "data"}


def fingerprinted(run) -> bool:
    """The record holds the content fingerprints of its inputs (run.json `inputs`)."""
    return isinstance(run.get("inputs"), dict)


def work_keys(run, fingerprints: bool) -> dict[str, object]:
    """What a run trained: its model, its data and its task, by fingerprints or (older records) by names."""
    data = run.get("config", "data", default={})
    if fingerprints:
        out = {f"inputs.{k}": run.get("inputs", k) for k in FINGERPRINTS}
        if out["inputs.data"] is None:  # a Hub dataset: its name
            out["data.path"] = data.get("path")
        return out | {f"data.{k}": data.get(k) for k in TASK_KEYS}
    out: dict[str, object] = {}
    for section, keys in (("model", MODEL_KEYS), ("data", DATA_KEYS)):
        body = run.get("config", section, default={})
        for key in keys + (DEMO_DATA_KEYS if section == "data" and body.get("path") == "demo" else ()):
            out[f"{section}.{key}"] = body.get(key)
    return out


def comparison_keys(run, fingerprints: bool = False) -> dict[str, object]:
    """The values two runs must share for their losses to be compared (docs/compare.md).
    A record without a `precision` section (written before it existed) has policy None: unknown."""
    out = work_keys(run, fingerprints)
    for section, key in RUN_KEYS:
        out[f"{section}.{key}"] = run.get(section, key)
    return out


def _differing(mine: dict, theirs: dict) -> list[str]:
    return [
        k
        for k in dict.fromkeys([*theirs, *mine])
        if json.dumps(mine.get(k), default=str) != json.dumps(theirs.get(k), default=str)
    ]


def _shown(value) -> object:
    return value[:12] if isinstance(value, str) and len(value) == 32 else value  # a fingerprint by its start


def differences(run, reference) -> list[str]:
    """The comparison keys on which `run` differs from `reference` ("lr.applied 0.001 != 0.0001")."""
    both = fingerprinted(run) and fingerprinted(reference)
    mine, theirs = comparison_keys(run, both), comparison_keys(reference, both)
    return [f"{k} {_shown(mine.get(k))!r} != {_shown(theirs.get(k))!r}" for k in _differing(mine, theirs)]


def other_work(run, candidate) -> str | None:
    """Why `candidate` cannot be the reference `run` is measured against (other model, data or task), or None."""
    both = fingerprinted(run) and fingerprinted(candidate)
    keys = _differing(work_keys(run, both), work_keys(candidate, both))
    if not keys:
        return None
    kinds = dict.fromkeys(next((w for p, w in _WORK.items() if k.startswith(p)), "task") for k in keys)
    return f"{candidate.label} trained another {' and '.join(kinds)} ({', '.join(keys)})"


def warnings(runs: list) -> list[str]:
    """One warning per comparison key on which the runs (with records) differ, naming who has what."""
    out = []
    both = all(fingerprinted(r) for r in runs)
    keyed = [(run, comparison_keys(run, both)) for run in runs]
    for key in dict.fromkeys(k for _, keys in keyed for k in keys):
        values: dict[str, list[str]] = {}
        for run, mine in keyed:
            if key in mine:
                values.setdefault(json.dumps(_shown(mine[key]), sort_keys=True, default=str), []).append(run.label)
        if len(values) > 1:
            detail = "; ".join(f"{json.loads(v)!r}: {', '.join(labels)}" for v, labels in values.items())
            out.append(f"{NOT_COMPARABLE}: {key} differs between runs ({detail})")
    return out
