"""Fault injection for tests and drills: FINETUNE_FAULT_INJECT="KIND@rankR,stepS[;...]" makes one
rank misbehave at one step (docs/faults.md "Drills" lists the kinds). Unset, nothing here does
anything; a value that does not parse is an error, so a drill never runs without its fault.
"""

from __future__ import annotations

import os
import re
import signal
import time
from functools import cache

from finetune.errors import UserError

ENV = "FINETUNE_FAULT_INJECT"
KINDS = tuple(
    "nan_loss inf_loss kill hang pause sigterm slow_load slow_save slow_eval slow_export disk_full fail_export "
    "fail_eval fail_exact_match fail_record stray_collective sp_late_shift tp_partial_sums export_ungathered oom "
    "export_truncated export_zeroed export_missing_shard".split()
)
# seconds a pause holds its step open: time for a test to see step 1 in run.json and signal a rank
# (polled every 0.2 s), short enough to add little to the run
PAUSE_S = 5.0
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@rank(?P<rank>\d+),step(?P<step>\d+)$")


@cache
def faults() -> tuple[tuple[str, int, int], ...]:
    raw = os.environ.get(ENV, "").strip()
    out = []
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        m = _SPEC.match(part)
        if not m or m["kind"] not in KINDS:
            raise UserError(
                f"{ENV}={raw!r}: cannot read {part!r}; expected KIND@rankR,stepS with KIND one of "
                f"{', '.join(KINDS)}, e.g. nan_loss@rank1,step3"
            )
        out.append((m["kind"], int(m["rank"]), int(m["step"])))
    return tuple(out)


def _active(kinds: tuple[str, ...], rank: int, step: int) -> str | None:
    for kind, r, s in faults():
        if kind in kinds and r == rank and s == step:
            return kind
    return None


def corrupt_loss(loss, *, rank: int, step: int):
    """The loss, made NaN/Inf when a *_loss fault names this rank and step; `oom` raises what torch raises when a GPU
    allocation fails there (torch.OutOfMemoryError, with CUDA's wording), on any device; `hang` stalls the rank there
    forever, past the forward's collectives (DDP's buffer broadcast), as a rank waits in NCCL on a peer gone."""
    if _active(("hang",), rank, step):
        print(f"[fault injection] rank {rank} stalls at step {step}", flush=True)
        while True:
            time.sleep(3600)
    if _active(("oom",), rank, step):
        import torch

        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
            "is free. (fault injection)"
        )
    kind = _active(("nan_loss", "inf_loss"), rank, step)
    if kind is None:
        return loss
    return loss * float("nan" if kind == "nan_loss" else "inf")


def late_shift(*, rank: int, step: int) -> bool:
    """sp_late_shift: this rank scores its sequence shard with the labels shifted after the split
    (its last position unscored) instead of before: the mistake the sequence-parallel equivalence
    tests must catch (finetune/training/trainer.py sequence_parallel_loss)."""
    return _active(("sp_late_shift",), rank, step) is not None


def install_tp_partial_sums(model, *, rank: int, step) -> None:
    """tp_partial_sums: this rank's row-parallel layers (AutoTP's LinearAllreduce) return their local
    partial sums at that step, as if the all-reduce that combines the tensor-parallel shards were
    missing: the mistake the tensor-parallel equivalence tests must catch. `step()` is the step running."""
    if not any(kind == "tp_partial_sums" and r == rank for kind, r, _ in faults()):
        return
    import torch

    def partial(module, args, output):
        if _active(("tp_partial_sums",), rank, step()) is None:
            return output
        local = torch.matmul(args[0], module.weight.transpose(-1, -2))
        return local + module.bias if module.bias is not None else local

    for m in model.modules():
        if type(m).__name__ == "LinearAllreduce":
            m.register_forward_hook(partial)


def at_step_begin(*, rank: int, step: int) -> None:
    """Process-level faults: die without any cleanup (SIGKILL), stall for PAUSE_S, or be preempted (SIGTERM,
    handled as a real one: finetune/training/signals.py)."""
    kind = _active(("kill", "pause", "sigterm"), rank, step)
    if kind == "sigterm":
        print(f"[fault injection] rank {rank} gets SIGTERM at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "kill":
        print(f"[fault injection] rank {rank} kills itself (SIGKILL) at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "pause":
        print(f"[fault injection] rank {rank} pauses {PAUSE_S:g} s at step {step}", flush=True)
        time.sleep(PAUSE_S)


def hold(kind: str, *, rank: int, step: int, what: str) -> None:
    """A slow_* fault: hold `what` open PAUSE_S when `kind` names this rank and step."""
    if _active((kind,), rank, step):
        print(f"[fault injection] rank {rank} holds {what} open {PAUSE_S:g} s", flush=True)
        time.sleep(PAUSE_S)


def at_save(*, rank: int, step: int, ckpt) -> None:
    """In a checkpoint's save, after Trainer wrote its files and before the completion marker: `slow_save` holds it
    open, `disk_full` fails it as a full disk does (OSError ENOSPC naming a file of the checkpoint)."""
    import errno

    hold("slow_save", rank=rank, step=step, what=f"the save of {ckpt}")
    if _active(("disk_full",), rank, step):
        print(f"[fault injection] rank {rank}: no space left writing {ckpt}", flush=True)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected)", str(ckpt / "optimizer.pt"))


def fail(what: str, *, rank: int, step: int) -> None:
    """`fail_<what>`: an error at the end of that step after training (export, eval, exact_match,
    record) ended at `step`, on this rank, once its collectives are done (finetune/training/
    endings.py: the ranks agree on it). `stray_collective` (eval): this rank enters a barrier."""
    if _active((f"fail_{what}",), rank, step):
        raise RuntimeError(f"[fault injection] {what} fails on rank {rank} (training ended at step {step})")
    if what == "eval" and _active(("stray_collective",), rank, step):
        import torch.distributed as dist

        print(f"[fault injection] rank {rank} enters a barrier no other rank enters", flush=True)
        dist.barrier()


def save_ungathered(trainer, model_dir, *, step: int) -> bool:
    """export_ungathered (any rank named: the save is one operation of every rank): the adapter saved with peft's own
    save_pretrained by the main process, nothing gathered first; under ZeRO-3 each parameter is then an empty placeholder
    and so is each saved tensor (DeepSpeed #7900, peft #2500). True when it replaced the export's save."""
    if not any(kind == "export_ungathered" and s == step for kind, _, s in faults()):
        return False
    if trainer.accelerator.is_main_process:
        print("[fault injection] the adapter is saved without gathering ZeRO-3's partitions", flush=True)
        trainer.model.save_pretrained(str(model_dir))
    return True


def damage_export(folder, *, rank: int, step: int) -> None:
    """After a save, before its check: `export_truncated` cuts its largest weights file to half, `export_zeroed`
    zeroes its largest tensor in place (the file stays readable), `export_missing_shard` deletes the last shard its
    index lists. `finetune export` applies them to its folder as rank 0, step 0."""
    from pathlib import Path

    kind = _active(("export_truncated", "export_zeroed", "export_missing_shard"), rank, step)
    if kind is None:
        return
    files = sorted(Path(folder).glob("*.safetensors"), key=lambda p: (p.stat().st_size, p.name))
    if kind == "export_truncated":
        os.truncate(files[-1], files[-1].stat().st_size // 2)
        print(f"[fault injection] {files[-1].name} truncated to half its size", flush=True)
    elif kind == "export_missing_shard":
        index = Path(folder) / "model.safetensors.index.json"
        if not index.is_file():
            raise RuntimeError(f"[fault injection] export_missing_shard: {folder} holds no index (one weights file)")
        import json

        last = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
        (Path(folder) / last).unlink()
        print(f"[fault injection] {last} deleted (listed in the index)", flush=True)
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(files[-1]))
        name = max(sorted(tensors), key=lambda k: tensors[k].numel())
        tensors[name] = tensors[name].zero_()
        save_file(tensors, str(files[-1]), metadata={"format": "pt"})
        print(f"[fault injection] tensor {name} of {files[-1].name} zeroed", flush=True)
