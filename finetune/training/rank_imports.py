"""What a rank loads besides the run's own code (docs/speed.md "Start-up").

Optional packages: a rank imports one only where its run uses it. W&B and matplotlib are imported where they are used.
DeepSpeed and bitsandbytes have to be kept out by hand. accelerate 1.15 imports DeepSpeed wherever it is installed
when it unwraps a model (accelerate/utils/other.py extract_model_from_parallel: `if is_deepspeed_available(): from
deepspeed import DeepSpeedEngine`), which Trainer does when it is built. peft 0.21 imports bitsandbytes whenever peft is
imported
(peft/helpers.py, `try: import bitsandbytes`), transformers imports peft with its Trainer (trainer_utils.py), and
peft's LoRA layers import it again when they are made, wherever `importlib.util.find_spec` finds it
(peft/tuners/lora/model.py). None of them has a switch. A None entry in sys.modules is Python's own way to keep a
module out (the import system reference, "The module cache"): `import bitsandbytes` raises ImportError, which peft
catches, and find_spec answers None, so accelerate, peft and transformers see no DeepSpeed or bitsandbytes. Measured
per rank on the 2-core CPU machine: bitsandbytes 0.9 s of CPU (its import sets up kernels through torch.compile's
machinery), DeepSpeed 0.3 s. A run that quantizes, or whose optimizer may be a bitsandbytes one, keeps bitsandbytes; a
run that engages DeepSpeed keeps DeepSpeed.

DeepSpeed's C++ ops compiled on first use (JIT, torch.utils.cpp_extension): `deepspeed_shm_comm`, built by DeepSpeed's
CPU communication backend when a DeepSpeed run's processes join on CPU (deepspeed/comm/torch.py build_shm_op), and
`cpu_adam`, for an optimizer offloaded to the host (DeepSpeedCPUAdam). A build takes 25-70 s on 2 cores. Whether one is
about to happen is not a file's existence: torch rebuilds an op whose cached build was made with other sources, flags
or include paths, e.g. by another Python environment of the same version. DeepSpeed 0.19.8 has no call that answers
without loading, so the run loads each op through DeepSpeed's own `OpBuilder.load()` before DeepSpeed asks for it
(DeepSpeed then reuses the loaded module, OpBuilder._loaded_ops), and a load still running after BUILD_NOTICE_S is a
build: rank 0 says so then, with the time it takes.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from pathlib import Path

from finetune.checkpointing import resume_config

QUANTIZING_METHODS = ("qlora",)
# TrainingArguments optimizers transformers builds from torch alone (transformers/trainer_optimizer.py); for any
# other name (bitsandbytes' 8-bit and paged ones among them) bitsandbytes stays importable.
TORCH_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
# A cached op loads in well under a second (seen 0.1-0.9 s on the loaded 2-core machine); a build takes 25-70 s.
BUILD_NOTICE_S = 5.0
# DeepSpeed op name -> the op builder class DeepSpeed loads it with (get_accelerator().create_op_builder)
OP_BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}
# third-party packages worth naming in the first-step trace (finetune/training/trainer.py trace_samples)
OPTIONAL = ("bitsandbytes", "deepspeed", "wandb", "datasets", "pandas", "matplotlib")


# --- optional packages ---------------------------------------------------------------------------------------------


def unused(cfg, env=os.environ) -> dict[str, str]:
    """The optional packages this run does not use -> why; kept out of the rank by keep_out()."""
    out = {}
    method, optim = cfg.method.name, cfg.training.typed.optim
    if method not in QUANTIZING_METHODS and optim in TORCH_OPTIMIZERS and not quantized_checkpoint(cfg.model):
        out["bitsandbytes"] = f"method {method} quantizes nothing and optimizer {optim} is torch's"
    if not uses_deepspeed(cfg, env):
        out["deepspeed"] = (
            f"strategy {cfg.run.strategy}, no DeepSpeed from the launcher, no sequence or tensor parallelism"
        )
    return out


def uses_deepspeed(cfg, env=os.environ) -> bool:
    """DeepSpeed engages: the launcher's config set it up, the recipe sets it up itself (finetune/launch/
    strategy_setup.py), Ulysses sequence or AutoTP tensor parallelism, or a DeepSpeed config passed to
    TrainingArguments."""
    return (
        env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        or cfg.run.strategy.startswith("zero")
        or cfg.parallel.sp_size > 1
        or cfg.parallel.tp_size > 1
        or bool(cfg.training.args.get("deepspeed"))
    )


def quantized_checkpoint(model_cfg) -> bool:
    """The model's config.json carries a quantization_config (a checkpoint saved quantized: transformers loads it
    with its quantizer, bitsandbytes' among them). A model whose files are not on this machine counts as one."""
    if model_cfg.name_or_path.startswith("bundled:"):
        return False  # converted to float by finetune/modeling/bundled.py
    from finetune.modeling.load import model_folder  # torch: after the signal handlers (finetune/train.py)
    from finetune.storage import json_object

    folder = model_folder(model_cfg.name_or_path, model_cfg.revision)
    if folder is None or not (folder / "config.json").is_file():
        return True
    return "quantization_config" in json_object(folder / "config.json")  # unreadable: {}, and preflight names it


def keep_out(argv: list[str] | None) -> list[str]:
    """Before the run imports transformers: the optional packages its command line does not use are kept out of
    this process (module docstring). A command line that does not read is left to the run, which says why: then
    nothing is kept out. Returns the names kept out."""
    quiet = io.StringIO()
    try:  # silently: the run reads its command line again and says what there is to say (a damaged run.json)
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            _, _, cfg, _ = resume_config.of_command_line(argv)
        names = [name for name in unused(cfg) if name not in sys.modules]
    except (Exception, SystemExit):  # argparse exits on a bad flag; the run parses again and says so
        return []
    for name in names:
        sys.modules[name] = None
    return names


def loaded() -> list[str]:
    """The optional packages this process has imported (OPTIONAL), for the first-step trace."""
    return [name for name in OPTIONAL if sys.modules.get(name) is not None]


# --- DeepSpeed's ops compiled on first use --------------------------------------------------------------------------


def ops_before_processes(setup, env=os.environ) -> list[str]:
    """Ops the process group's set-up compiles: DeepSpeed's CPU communication op for DeepSpeed
    (launcher config or recipe) on a machine without CUDA."""
    deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or (
        setup.row is not None and setup.row.zero_stage is not None
    )
    if not deepspeed:
        return []
    import torch

    return [] if torch.cuda.is_available() else ["deepspeed_shm_comm"]


def ops_at_optimizer(launch) -> list[str]:
    """Ops the engine's optimizer compiles: DeepSpeedCPUAdam for an optimizer offloaded to the host."""
    return ["cpu_adam"] if launch.family == "deepspeed" and "optimizer" in launch.offload else []


def build_dir(name: str) -> Path:
    """Where torch caches an extension's build: torch/utils/cpp_extension.py _get_build_directory
    ($TORCH_EXTENSIONS_DIR, else the default root / py<version>_<cpu|cuXY> / name)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cu = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{cu}")
    return Path(root) / name


def build_line(name: str) -> str:
    return (
        f"[finetune] DeepSpeed is compiling its {name} op: no build of it for this Python environment yet (about a "
        f"minute on 2 cores; cached in {build_dir(name).parent} and reused afterwards)"
    )


def load_ops(names: list[str], notice_s: float = BUILD_NOTICE_S, builder_for=None) -> None:
    """Load each op through DeepSpeed's op builder, as DeepSpeed would; a load that is still running after
    `notice_s` is a build, which rank 0 announces (module docstring). An op DeepSpeed finds incompatible here
    is left to DeepSpeed (it does without, or says why). `builder_for(name)`: the op's builder (tests)."""
    for name in names:
        builder = (builder_for or _builder)(name)
        if builder is None or not builder.is_compatible():
            continue
        notice = threading.Timer(notice_s, _say, (build_line(name),))
        notice.daemon = True
        notice.start()
        try:
            builder.load()
        finally:
            notice.cancel()


def _builder(name: str):
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(OP_BUILDERS[name])


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
