"""The fresh process of the export check: a new interpreter, no process group, nothing of the caller's memory; it loads
a saved folder the way a user would (transformers' from_pretrained for full weights; peft's PeftModel.from_pretrained on
the base for an adapter; peft made unimportable when the folder must load without it) or a consolidated checkpoint,
computes the probe batch's loss and logits, reads every tensor of the folder's files, and writes what it found.

    python -m finetune.export.reload REQUEST.json        # what `fresh(request)` runs
    python -m finetune.export.reload --wait KEEP_OUT     # what `start(keep_out)` runs: the request's path on stdin

Started ahead (`start`, by finetune/export/live.py started_ahead), the process imports what loading needs (torch,
transformers, peft: 3-4 s of CPU) while the run trains and saves, and `fresh(..., started)` hands it the request; on its
own it starts when asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# the launch's variables: without them the process joins no group and runs no drill
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
_LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_", "FINETUNE_FAULT_INJECT", "FINETUNE_CPU_DISTRIBUTED")
HOST_MARGIN = 1.25  # a second copy of the weights plus the forward's working memory: what the fresh process needs


def start(keep_out: list[str]) -> subprocess.Popen:
    """A fresh process started before its request, importing what loading needs meanwhile (module docstring); it
    keeps `keep_out` out. Closing its stdin without a request ends it."""
    cmd = [sys.executable, "-m", "finetune.export.reload", "--wait", json.dumps(keep_out)]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # a session of its own: a signal to the run's process group is the run's to handle, not a reason to end it
    return subprocess.Popen(cmd, env=clean_environment(), start_new_session=True, **pipes)


def stop(started: subprocess.Popen | None) -> None:
    """End a started process that got no request (the check streamed instead, or the run failed first): it has only
    imported, so it is killed rather than waited for."""
    if started is not None and started.poll() is None:
        started.kill()
        started.communicate()


def fresh(request: dict, work: Path, timeout: float, started: subprocess.Popen | None = None) -> dict:
    """Run `request` in a fresh process (its files under `work`; `started`: one started ahead with the request's
    keep_out) and return what it found, the logits as a tensor; a process that fails or times out comes back as
    `load_error`."""
    from safetensors.torch import load_file

    work.mkdir(parents=True, exist_ok=True)
    (work / "request.json").write_text(json.dumps({**request, "out": str(work)}), encoding="utf-8")
    cmd = [sys.executable, "-m", "finetune.export.reload", str(work / "request.json")]
    pipes = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if started is not None and started.poll() is not None:  # ended before its request (killed): start one now
        started = None
    proc = started or subprocess.Popen(cmd, env=clean_environment(), **pipes)
    try:
        _, stderr = proc.communicate(f"{work / 'request.json'}\n" if started else None, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"load_error": f"the fresh process did not finish in {timeout:.0f} s", "problems": []}
    result_file = work / "result.json"
    if proc.returncode != 0 or not result_file.is_file():
        text = stderr if isinstance(stderr, str) else stderr.decode(errors="replace")
        tail = "\n".join(text.strip().splitlines()[-6:])
        return {"load_error": f"the fresh process failed (exit {proc.returncode}): {tail}", "problems": []}
    result = json.loads(result_file.read_text(encoding="utf-8"))
    if (work / "logits.safetensors").is_file():
        result["logits"] = load_file(str(work / "logits.safetensors"))["logits"]
    return result


def clean_environment() -> dict:
    """This process's environment without the launch's variables (and the drills'): a child joins no group."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith(_LAUNCH_PREFIXES)}
    return env | {"PYTHONUNBUFFERED": "1"}


def main(argv: list[str] | None = None) -> int:
    from finetune.errors import imports_without_gc

    argv = argv or sys.argv[1:]
    waits = argv[0] == "--wait"  # started ahead: keep out, import, then wait for the request's path
    request = None if waits else json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    # peft blocked: the folder must load without it; keep_out: the optional packages the run kept out of its
    # ranks (finetune/training/rank_imports.py), which loading its save does not need either (bitsandbytes: 0.8 s)
    _keep_out(
        json.loads(argv[1]) if waits else ["peft"] * bool(request.get("block_peft")) + request.get("keep_out", [])
    )
    with imports_without_gc():
        with contextlib.suppress(ImportError):  # what loading an adapter imports, unless kept out
            import peft  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        from finetune.export import figures  # noqa: F401
    if waits:
        line = sys.stdin.readline().strip()
        if not line:  # not needed after all
            return 0
        request = json.loads(Path(line).read_text(encoding="utf-8"))
    result = measure(request)
    Path(request["out"], "result.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


def _keep_out(names: list[str]) -> None:
    if names and "transformers" in sys.modules:  # too late to keep them out of it
        raise RuntimeError(f"transformers was imported before {', '.join(names)} could be kept out")
    for name in names:
        sys.modules[name] = None  # `import peft` raises ImportError; importlib.util.find_spec("peft") is None


def measure(request: dict) -> dict:
    """What the fresh process finds: the folder's tensors (when asked), then the model loaded and its figures."""
    from safetensors.torch import load_file, save_file

    from finetune.export import figures

    started = time.perf_counter()
    result: dict = {"problems": [], "load_error": None}
    if request.get("stats"):
        result["stats"], result["problems"] = figures.tensor_stats(Path(request["folder"]))
    device = _device(request.get("bytes", 0))
    try:
        model = load(request).to(device).eval()
    except Exception as e:  # noqa: BLE001 - a folder that does not load is a finding: named
        lines = f"{type(e).__name__}: {e}".splitlines()  # a state dict mismatch lists every tensor: the first says it
        result["load_error"] = lines[0][:500] + (f" (and {len(lines) - 1} more lines)" if len(lines) > 1 else "")
        return result | {"seconds": time.perf_counter() - started}
    batch = load_file(request["probe"])
    loss, logits = figures.forward(model, batch, device, request.get("autocast"))
    save_file({"logits": logits.contiguous()}, str(Path(request["out"]) / "logits.safetensors"))
    loaded = [name for name in ("peft", "bitsandbytes", "deepspeed") if sys.modules.get(name) is not None]
    result.update(loss=loss, device=str(device), loaded=loaded)
    if request.get("tokenizer"):
        from transformers import AutoTokenizer

        result["chat_template"] = AutoTokenizer.from_pretrained(request["folder"]).chat_template
    return result | {"seconds": time.perf_counter() - started}


def load(request: dict):
    """The model as a user loads it: `folder` with from_pretrained, or the `base` with the adapter in `folder` through
    peft; `consolidated`: a checkpoint's weights (finetune/export/sources.py) into the model built from `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = request.get("dtype") or "float32"
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)  # auto: as saved (config.json's dtype)
    if request.get("consolidated"):
        return _consolidated(request, dtype)
    if not (Path(request["folder"]) / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(request["folder"], dtype=dtype)
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(request, dtype), request["folder"])


def _base(request: dict, dtype):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.modeling.load import differentiable_4bit

    quantized = request.get("quantization")
    extra = {"quantization_config": BitsAndBytesConfig.from_dict(quantized)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(request["base"], dtype=dtype, **extra)
    return differentiable_4bit(model) if quantized else model  # the 4-bit base computes as it trained


def _consolidated(request: dict, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.export import sources

    source = sources.open_source(Path(request["consolidated"]), adapter=False)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(request["folder"]), dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(source.tensors()), strict=False)
    missing = [k for k in missing if k not in model.all_tied_weights_keys]
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def _device(needed: int):
    """The accelerator when its free memory holds the model with the margin, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.mem_get_info()[0] >= needed * HOST_MARGIN:
        return torch.device("cuda")
    return torch.device("cpu")


if __name__ == "__main__":
    from finetune.errors import exit_without_teardown

    returned = exit_without_teardown()  # what it found is written: no teardown of torch and transformers (1.3 s)
    returned.append(main())
    sys.exit(returned[0])
