"""What the export check compares (docs/run_record.md `export.check`): the probe batch (a few rows of the run's own
data), a model's figures on it (the mean loss over its trained tokens, the logits), the tensors a saved folder holds
(read one at a time: shape, dtype, norm; a file that does not read is named) and the comparison of two models' figures
and tensors against the tolerance of the dtype they were computed or stored in.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.data.build import head_examples

PROBE_ROWS = 4  # rows of the run's data ...
PROBE_TOKENS = 32  # ... each its last 32 tokens up to its last trained one: 128 positions x the vocabulary in logits
WEIGHT_INDEXES = ("model.safetensors.index.json",)
WEIGHT_FILES = ("adapter_model.safetensors", "model.safetensors")

# Unit roundoff u of each dtype (round to nearest: half the spacing at 1, 2^-p for p significant bits).
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


@dataclass(frozen=True)
class Tolerance:
    """How far two forwards of the same weights may differ when they compute in that dtype (TOLERANCE).

    fp32: the same arithmetic in another order (another process, batch layout, kernel), ~sqrt(operations) x 2^-24
    relative per logit: measured 0 to 4e-7 here. 1e-4 of the largest logit is the bound issue 45 sets for a merged
    model, and far below what a wrong weight does: on the 2-step test run (largest logit 1.37) a zeroed LoRA B
    matrix moved the logits by 2.4e-3, a zeroed base matrix by 0.31. The tensor comparison names what the logits
    cannot (tensor_problems).

    16-bit: the fresh process may round at other points than the live model (autocast over the saved fp32 weights
    where FSDP2 computes with bf16 working copies; docs/precision.md): measured on bf16-mixed runs of the test model,
    at most 1.5 u of the largest logit (full fine-tuning under FSDP2; DDP, ZeRO-3 and LoRA: 0) and 0.003 u relative
    on the mean loss, whose rounding errors average out over the trained tokens. A bf16 merge rounds every merged
    weight once more: 6.9 u and u/16 against the base + adapter on the 24-layer 0.5B model of docs/benchmarks.md
    (its adapter as large as 16% of the weights). Bounds: 16 u on the logits, u/4 on the loss.
    """

    logits: float  # max |z_a - z_b| <= logits * max(1, max |z_a|)
    loss: float  # |loss_a - loss_b| <= loss * max(1, |loss_a|)


TOLERANCE = {
    "float32": Tolerance(logits=1e-4, loss=1e-5),
    "bfloat16": Tolerance(logits=16 * UNIT_ROUNDOFF["bfloat16"], loss=UNIT_ROUNDOFF["bfloat16"] / 4),
    "float16": Tolerance(logits=16 * UNIT_ROUNDOFF["float16"], loss=UNIT_ROUNDOFF["float16"] / 4),
}


def probe_batch(data_cfg, tokenizer) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels (-100 where nothing is trained) of the probe rows, right-padded."""
    examples = head_examples(data_cfg, tokenizer, count=PROBE_ROWS, window=PROBE_TOKENS)
    width = max(len(e.input_ids) for e in examples)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [(e.input_ids, e.labels, width - len(e.input_ids)) for e in examples]
    return {
        "input_ids": torch.tensor([ids + [pad] * n for ids, _, n in rows]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * n for ids, _, n in rows]),
        "labels": torch.tensor([labels + [-100] * n for _, labels, n in rows]),
    }


def describe_probe(batch: dict[str, torch.Tensor], source: str) -> dict:
    """run.json `export.check.probe`: what the figures were computed on."""
    return {
        "rows": int(batch["input_ids"].shape[0]),
        "tokens": int(batch["attention_mask"].sum()),
        "trained_tokens": int((batch["labels"][:, 1:] != -100).sum()),
        "source": source,
    }


def forward(
    model, batch: dict[str, torch.Tensor], device, autocast: str | None, whole=None
) -> tuple[float, torch.Tensor]:
    """(mean loss over the trained tokens, fp32 logits on the CPU) of `model` on the probe batch, without gradients;
    `autocast`: the dtype to compute in under torch.autocast, or None; `whole`: makes a rank's logits the whole
    vocabulary's (a vocabulary-parallel output head), or None."""
    device = torch.device(device)
    inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}
    cast = torch.autocast(device.type, dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()
    with torch.no_grad(), cast:
        logits = model(**inputs, use_cache=False).logits
        logits = whole(logits) if whole else logits
    logits = logits.float().cpu()
    return loss_of(logits, batch["labels"]), logits


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The causal LM loss as training computes it: position t scored against label t + 1, mean over scored ones."""
    shifted = labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shifted).item()


def compare(reference: tuple[float, torch.Tensor], saved: tuple[float, torch.Tensor], mask, dtype: str) -> dict:
    """The figures of export.check: both losses, the largest logit difference over the real positions, the
    tolerances (absolute) of `dtype` and whether both hold."""
    (ref_loss, ref_logits), (got_loss, got_logits) = reference, saved
    real = mask.bool()
    diff = (
        (ref_logits[real] - got_logits[real]).abs().max().item() if ref_logits.shape == got_logits.shape else math.inf
    )
    tol = TOLERANCE[dtype]
    logit_tol = tol.logits * max(1.0, ref_logits[real].abs().max().item())
    loss_tol = tol.loss * max(1.0, abs(ref_loss))
    return {
        "reference_loss": ref_loss,
        "saved_loss": got_loss,
        "max_logit_diff": diff,
        "logit_tolerance": logit_tol,
        "loss_tolerance": loss_tol,
        "within": bool(diff <= logit_tol and abs(ref_loss - got_loss) <= loss_tol),
    }


def weight_files(folder: Path) -> tuple[list[tuple[str, list[str] | None]], list[str]]:
    """([(file name, the keys its index lists, or None: every key it holds)], problems) of a saved folder: the index's
    shards (a listed file that is missing is a problem), or its one weights file."""
    folder = Path(folder)
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                return [], [f"{index}: cannot be read ({type(e).__name__}: {e})"]
            files: dict[str, list[str]] = {}
            for key, name in weight_map.items():
                files.setdefault(name, []).append(key)
            missing = [f"{name}: listed in {index}, missing" for name in files if not (folder / name).is_file()]
            return [(name, keys) for name, keys in files.items() if (folder / name).is_file()], missing
    found = [(name, None) for name in WEIGHT_FILES if (folder / name).is_file()]
    return found, [] if found else [f"no weights file ({', '.join(WEIGHT_INDEXES + WEIGHT_FILES)})"]


def tensor_stats(folder: Path) -> tuple[dict[str, dict], list[str]]:
    """Every tensor of the folder's weight files, one at a time: key -> {shape, dtype, norm}; and the problems (a file
    that does not open or read, a key its index lists that it lacks)."""
    from safetensors import safe_open

    files, problems = weight_files(folder)
    stats: dict[str, dict] = {}
    for name, listed in files:
        try:
            with safe_open(str(Path(folder) / name), "pt") as f:
                keys = list(f.keys())
                problems += [f"{name}: lacks {key}, which the index lists" for key in listed or () if key not in keys]
                for key in keys:
                    stats[key] = summary(f.get_tensor(key))
        except Exception as e:  # noqa: BLE001 - a damaged file is a finding: named, not raised
            problems.append(f"{name}: cannot be read ({type(e).__name__}: {e})")
    return stats, problems


CHUNK = 1 << 20  # elements: what is cast to fp64 at a time, so a large tensor is never copied whole


def summary(t: torch.Tensor) -> dict:
    """A tensor's shape, dtype and norm: each chunk's norm in fp32 (~1e-7 relative; the same values give the same
    figure), their squares summed in fp64."""
    flat = t.detach().reshape(-1)
    squares = sum(torch.linalg.vector_norm(c, dtype=torch.float32).item() ** 2 for c in flat.split(CHUNK))
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "norm": squares**0.5}


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |b|) of two tensors of one shape, in fp64, a chunk at a time."""
    pairs = list(zip(a.detach().reshape(-1).split(CHUNK), b.detach().reshape(-1).split(CHUNK)))
    diff = max(((x.to(torch.float64) - y.to(torch.float64)).abs().max().item() for x, y in pairs), default=0.0)
    return diff, max((y.abs().max().item() for _, y in pairs), default=0.0)


def tensor_problems(expected: dict[str, dict], found: dict[str, dict]) -> tuple[list[str], float]:
    """Each expected tensor against the saved one: missing, empty, another shape, or a norm further off than one
    rounding to the narrower of the two dtypes can move it (a rounded tensor's norm moves by at most u relative; 1e-6
    between equal dtypes). Returns the problems and the largest relative norm difference."""
    problems, worst = [], 0.0
    for key, want in expected.items():
        got = found.get(key)
        if got is None:
            problems.append(f"missing tensor {key} (the trained model has one of shape {want['shape']})")
        elif math.prod(got["shape"]) == 0 and math.prod(want["shape"]) > 0:
            problems.append(f"empty tensor {key}: shape {got['shape']}, the trained one is {want['shape']}")
        elif got["shape"] != want["shape"]:
            problems.append(f"tensor {key} has shape {got['shape']}, the trained one {want['shape']}")
        else:
            rel = abs(got["norm"] - want["norm"]) / max(want["norm"], 1e-30)
            worst = max(worst, rel)
            if rel > rounding(got["dtype"], want["dtype"]):
                zero = " (all zeros)" if got["norm"] == 0 else ""
                problems.append(
                    f"tensor {key} differs from the trained one: norm {got['norm']:.6g} saved{zero}, "
                    f"{want['norm']:.6g} trained"
                )
    return problems, worst


def rounding(a: str, b: str) -> float:
    """The relative change one rounding between dtypes `a` and `b` can make (1e-6 when they are equal: the norm's own
    fp32 arithmetic)."""
    return 1e-6 if a == b else max(UNIT_ROUNDOFF.get(a, 0.0), UNIT_ROUNDOFF.get(b, 0.0))
