"""Preflight: every mistake that can be seen in the configs, found before any weights load.

    check_before_loading(cfg, state, setup=setup)   # finetune/training/run.py, right after PartialState
    check_launch(launch_args, resume_check)   # `finetune train`, before `accelerate launch` starts anything

With `--resume`, `check_launch` also takes the resume check (finetune/training/resume_plan.py
preflight_problems, handed in by the CLI: training sits above this module): a checkpoint that
cannot resume under this launch is refused before any process starts, and the plan it makes
(accumulation recomputed, DDP on one process = single) is what the other checks see. In a
launched process finetune/training/run.py applies the same plan before check_before_loading.

Each check returns problems (strings naming what, where and the fix) instead of raising, and
all of them are raised together as one ConfigError (exit 2). What is checked:

* launcher world size vs the processes Accelerate set up (in a launched process only);
* the launch's machine count vs the machines it runs on (SLURM's nodes, --machine_rank;
  finetune/launch/nodes.py, in a launched process only);
* processes per machine vs visible CUDA devices (or no GPU at all for a GPU launch);
* one process with several CUDA devices visible (Trainer would use nn.DataParallel);
* DeepSpeed batch / accumulation / clipping / precision values that fight TrainingArguments;
* the strategy and offload the launch config will give vs the recipe's run.strategy / run.offload
  (when a launcher config set one up; else the recipe's own row is engaged: finetune/launch/setup.py);
* `accelerate launch --num_processes N` that started fewer processes;
* DeepSpeed and FSDP asked for at once;
* QLoRA under ZeRO-3/FSDP: the 4-bit storage dtype must be the float compute dtype;
* the precision policy (finetune/launch/precision_checks.py): 16-mixed on CPU, bf16 on a GPU without
  it, bf16-true with ZeRO offload, model.dtype / QLoRA compute dtype / the launch's mixed_precision /
  DeepSpeed bf16 and fp16 values that contradict it;
* the model (and tokenizer) is a local model directory, or a hub id that is cached or reachable;
* the dataset file exists and its first rows have the format's fields (finetune/data/build.py);
* the run directory would not clobber an existing one (one left by a run that failed before its
  first step is reused: finetune/launch/rundir.py).

What engaged is still proven on the live engine after Trainer is built (finetune/training/engaged.py);
this module catches what the configs already show, minutes of model loading earlier.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.errors import ConfigError, UserError
from finetune.launch import data_parallel, nodes, precision_checks
from finetune.launch.facts import LaunchFacts
from finetune.strategies import ACCELERATOR_TYPES, by_key, launch_line

SOURCE = "preflight (nothing was started, loaded or written)"


def check_before_loading(cfg, state, *, setup=None, resume: str | None = None) -> None:
    """In each launched process: raise one ConfigError listing every problem; ranks agree.
    `setup` (finetune/launch/setup.py) says who sets up the strategy: under `recipe` the facts are
    the recipe's row, else what the launcher exported. `resume` (train.py's --resume) lets the
    run directory exist: a resumed run continues it."""
    facts = launch_facts(state, setup)
    found = (world_size_problem(state, cfg.recipe if _in_script(setup) else None), launcher_processes_problem(setup, cfg),
             nodes.machines_problem(nodes.gather(state), setup.launcher if setup else None))
    problems = [p for p in found if p] + run_checks(cfg, facts, in_process=True, resume=resume)
    problems = _gather(problems, state)
    if problems and not state.is_main_process:  # rank 0 prints the list; the others say where it is
        raise UserError(f"preflight found {len(problems)} problem(s) (listed by rank 0); nothing was started")
    if problems:
        raise ConfigError(problems, SOURCE)


def launch_facts(state, setup=None) -> LaunchFacts:
    """What this process's launch sets up: under `recipe` the recipe's row, else what the launcher
    exported (also what finetune/training/run.py resolves the precision policy for)."""
    from finetune import resources
    from finetune.launch.facts import from_environment, from_recipe

    if setup is not None and setup.set_up_by == "recipe":
        return from_recipe(setup, state, resources.ROOT)
    facts = from_environment(state, source=_launcher_source(setup))
    if setup is not None and setup.launcher.config_from == "default config":
        facts.default_config = setup.launcher.config_file
    return facts


def _launcher_source(setup) -> str | None:
    if setup is None or setup.launcher.config_file is None:
        return None  # from_environment's own naming
    return setup.launcher.describe()


def _in_script(setup) -> bool:
    return setup is not None and setup.set_up_by == "recipe"


def check_launch(launch_args: list[str], resume_check=None) -> None:
    """For `finetune train`: the same checks from the accelerate config it is about to launch.
    `resume_check(cfg, facts, resume, overrides) -> problems` runs first when --resume is given."""
    from accelerate.commands.launch import launch_command_parser

    from finetune import resources
    from finetune.config.recipe import load_recipe
    from finetune.launch.facts import from_config_file
    from finetune.launch.script_args import parse_train_args

    parsed = launch_command_parser().parse_args(launch_args)
    args, overrides = parse_train_args(parsed.training_script_args)
    cfg, _ = load_recipe(args.recipe, overrides)
    cfg.run.overwrite = cfg.run.overwrite or args.overwrite
    if parsed.config_file:
        facts = from_config_file(Path(parsed.config_file), num_processes=parsed.num_processes,
                                               cpu=parsed.cpu, deepspeed_config_file=parsed.deepspeed_config_file,
                                               base_dirs=[resources.ROOT])
    else:
        facts = LaunchFacts(source="accelerate launch without a config file", num_processes=parsed.num_processes or 1,
                            use_cpu=parsed.cpu)
    problems = resume_check(cfg, facts, args.resume, overrides) if args.resume and resume_check else []
    problems += run_checks(cfg, facts, in_process=False, resume=args.resume)
    if problems:
        raise ConfigError(problems, SOURCE)


def run_checks(cfg, facts: LaunchFacts, *, in_process: bool, resume: str | None = None) -> list[str]:
    problems = list(facts.problems)
    checks = [devices, data_parallel.check, deepspeed_values, strategy_matches_recipe, qlora_storage,
              precision_checks.policy_problems, model_source, dataset]
    if not resume:  # a resumed run continues its directory (finetune/training/resume.py checks it exists)
        checks.append(run_directory)
    for check in checks:
        problems += check(cfg, facts, in_process=in_process)
    return problems


# --- the checks ------------------------------------------------------------------------------


def world_size_problem(state, in_script_recipe: str | None = None) -> str | None:
    """The launcher's world size must equal the processes Accelerate set up (DESIGN.md: a
    2-process launch without use_cpu on a machine without a GPU gives two lone runs).
    `in_script_recipe`: the recipe sets up its strategy itself, so the fix is a plain torchrun line."""
    launcher = int(os.environ.get("WORLD_SIZE", "1"))
    if launcher == state.num_processes:
        return None
    head = (f"the launcher started {launcher} processes but Accelerate set up {state.num_processes} "
            f"(distributed type {state.distributed_type.value}); each process would train alone. On a "
            f"machine without a GPU ")
    if in_script_recipe:
        return head + (f"opt in to gloo (the recipe sets up its strategy itself), e.g.\n"
                       f"    FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node {launcher} finetune/train.py "
                       f"--recipe {in_script_recipe}\n  (see finetune/launch/cpu_rehearsal.py)")
    return head + (f"use a CPU config and opt in to gloo, e.g.\n"
                   f"    FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file {by_key('ddp').cpu_config} "
                   f"finetune/train.py --recipe ddp\n  (or `finetune train --recipe ddp --cpu`; see "
                   f"finetune/launch/cpu_rehearsal.py)")


def launcher_processes_problem(setup, cfg) -> str | None:
    """`accelerate launch --num_processes N` that started fewer: with at most one GPU visible and
    no config file, accelerate's simple launcher starts ONE process (accelerate 1.15
    commands/launch.py _validate_launch_command: multi_gpu only when cuda.device_count() > 1),
    which would train alone at another batch size than asked for."""
    if setup is None or setup.launcher.kind != "accelerate launch" or not setup.launcher.num_processes:
        return None
    asked, got = setup.launcher.num_processes, int(os.environ.get("WORLD_SIZE", "1"))
    if asked <= got:
        return None
    return (f"accelerate launch --num_processes {asked} started {got} process(es): without a config file, accelerate "
            f"starts several only when more than one GPU is visible. For {asked} processes on CPU:\n"
            f"    FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node {asked} finetune/train.py --recipe {cfg.recipe}\n"
            f"  or `finetune train --recipe {cfg.recipe} --cpu`; for one process leave out --num_processes")


def devices(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """One CUDA device per process on each machine, for launches that need accelerators."""
    import torch

    from finetune.launch import cpu_rehearsal

    if facts.distributed_type not in ACCELERATOR_TYPES or facts.use_cpu or facts.gloo or cpu_rehearsal.requested():
        return []
    per_machine = facts.processes_per_machine
    if not torch.cuda.is_available():
        if in_process or per_machine < 2:  # in a process, world_size_problem already says it
            return []
        return [(f"{facts.source}: {facts.distributed_type} with {per_machine} processes per machine, but no CUDA "
                f"GPU is visible here: each process would train alone. Rehearse on CPU with "
                f"`finetune train --recipe {cfg.recipe} --cpu` (2 processes over gloo), or launch on a GPU machine")]
    visible = torch.cuda.device_count()
    ids = facts.gpu_ids
    if not in_process and ids not in (None, "all"):
        visible = min(visible, len([x for x in str(ids).split(",") if x.strip()]))
        where = f"gpu_ids {ids} of {torch.cuda.device_count()} visible"
    else:
        where = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    if in_process:
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", per_machine))
    if per_machine <= visible:
        return []
    return [(f"{facts.source}: {per_machine} processes per machine but only {visible} CUDA device(s) ({where}); "
            f"set num_processes to at most {visible} (--num_processes {visible}) or make more GPUs visible")]


# DeepSpeed key -> (TrainingArguments field it must equal, how the value follows from the args)
def deepspeed_values(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """Explicit DeepSpeed values must equal what Trainer computes; "auto" lets Trainer fill them in
    (transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process)."""
    ds = facts.deepspeed
    if facts.distributed_type != "DEEPSPEED" or not ds:
        return []
    a = cfg.training.args
    per_device, accum = a.get("per_device_train_batch_size", 8), a.get("gradient_accumulation_steps", 1)
    expected = {
        "train_micro_batch_size_per_gpu": (per_device, "training.per_device_train_batch_size"),
        "gradient_accumulation_steps": (accum, "training.gradient_accumulation_steps"),
        "train_batch_size": (per_device * accum * facts.num_processes,
                             (f"training.per_device_train_batch_size x gradient_accumulation_steps x "
                             f"{facts.num_processes} processes = {per_device} x {accum} x {facts.num_processes}")),
        "gradient_clipping": (a.get("max_grad_norm", 1.0), "training.max_grad_norm"),
    }  # bf16/fp16: the precision policy's (finetune/launch/precision_checks.py)
    problems = []
    for key, (want, field) in expected.items():
        section, _, leaf = key.rpartition(".")
        value = (ds.get(section) or {}).get(leaf) if section else ds.get(key)
        if value is None or value == "auto":
            continue
        if _as_number(value) != _as_number(want):
            problems.append(f"{facts.deepspeed_source}: {key} is {value!r} but {field} gives {want!r}; "
                            f"set it to \"auto\" (Trainer fills it in) or make the two agree")
    return problems


def strategy_matches_recipe(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """The recipe's run.strategy / run.offload against what the launch config will set up."""
    want, want_offload = cfg.run.strategy, cfg.run.offload
    if (want == "any" and want_offload == "any") or facts.problems:
        return []
    got, got_offload = facts.strategy()
    if (want in ("any", got)) and (want_offload in ("any", got_offload)):
        return []
    where = facts.deepspeed_source if facts.distributed_type == "DEEPSPEED" else facts.source
    launch = launch_line(want if want != "any" else got, want_offload if want_offload != "any" else "none", cfg.recipe)
    aside = "" if not facts.default_config else (
        f"\n  or, to let the recipe set up its strategy itself, move your default config aside (e.g. "
        f"`mv {facts.default_config} {facts.default_config}.off`) and launch without one:\n"
        f"    accelerate launch finetune/train.py --recipe {cfg.recipe}")
    return [(f"recipe {cfg.recipe!r} is meant for strategy {want!r} with offload {want_offload!r} (run.strategy, "
             f"run.offload) but {where} sets up {got!r} with offload {got_offload!r} ({facts.distributed_type}, "
             f"{facts.num_processes} process(es)). Launch it with:\n{launch}{aside}\n  or set run.strategy: any "
             f"(and run.offload: any) to accept whatever the launch gives")]


def qlora_storage(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """ZeRO-3 and FSDP flatten and shard parameters of one float dtype, so QLoRA's packed 4-bit
    weights must be stored in the compute dtype (bnb_4bit_quant_storage; see finetune/modeling/load.py)."""
    strategy, _ = facts.strategy()
    m = cfg.method
    if m.name != "qlora" or strategy not in ("zero3", "fsdp"):
        return []
    compute_name = precision_checks.resolve_policy(cfg, facts).compute_dtype
    if m.quant_storage in ("auto", compute_name):
        return []
    return [(f"method.quant_storage: {m.quant_storage!r} under {strategy}: ZeRO-3 and FSDP shard only float "
            f"parameters of one dtype, so QLoRA's 4-bit weights must be stored as the compute dtype "
            f"({compute_name} here, from training.precision); set method.quant_storage: auto")]


def model_source(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """model.name_or_path / model.tokenizer_name_or_path: an existing model directory, or a hub
    id that is in the local Hugging Face cache or whose hub can be reached. Without this, an
    uncached id on a machine without network costs a minute of retries inside from_pretrained."""
    from finetune.config.sections import BUNDLED_MODEL

    problems = []
    for key, name, marker in (("model.name_or_path", cfg.model.name_or_path, "config.json"),
                              ("model.tokenizer_name_or_path", cfg.model.tokenizer_name_or_path, "tokenizer_config.json")):
        if not name or name == BUNDLED_MODEL:
            continue
        if name.startswith("bundled:"):
            problems.append(f"{key}: unknown bundled model {name!r}; the bundled model is {BUNDLED_MODEL!r}")
            continue
        path = Path(name).expanduser()
        if path.exists():
            if key == "model.name_or_path" and not (path / "config.json").is_file():
                problems.append(f"{key}: {name} exists but is not a transformers model directory (no config.json)")
            continue
        if name.startswith(("/", ".", "~")) or name.count("/") != 1:
            problems.append(f"{key}: {name!r}: no such local directory (and not a hub id of the form org/name)")
            continue
        problem = _hub_problem(name, cfg.model.revision, marker)
        if problem:
            problems.append(f"{key}: {problem}")
    return problems


def _hub_problem(repo_id: str, revision: str | None, marker: str) -> str | None:
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, marker, revision=revision), str):
            return None  # cached: loads without network
    except ValueError as e:  # huggingface_hub's HFValidationError: not a valid repo id
        return f"{repo_id!r} is neither a local directory nor a valid hub id: {e}"
    fix = (f"download it where there is network (`hf download {repo_id}`, then copy ~/.cache/huggingface) "
           f"or pass a local model directory")
    if constants.HF_HUB_OFFLINE:
        return f"hub id {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {fix}"
    endpoint = urlparse(constants.ENDPOINT)
    try:  # seconds, not the minute of retries from_pretrained spends before giving up
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as e:
        return (f"hub id {repo_id!r} is not in the local Hugging Face cache and {endpoint.hostname} cannot be "
                f"reached ({e}); {fix}")
    return None


def dataset(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """The data file exists and its first rows read as the format (finetune/data/build.py's own checks)."""
    from finetune.data import build, read

    problems = [] if cfg.data.path == "demo" else build.check_head(cfg.data)
    held = cfg.eval.heldout_path
    if cfg.eval.exact_match and held and held != "demo" and read.is_local(held) and not os.path.exists(held):
        problems.append(f"eval.heldout_path: {held}: file not found")
    return problems


def run_directory(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """An existing, non-empty run directory is never replaced without --overwrite (finetune/launch/rundir.py)."""
    from finetune.launch import rundir

    if not (cfg.run.name or cfg.run.output_dir) or cfg.run.overwrite:
        return []  # a default name is new (it carries the time)
    path = rundir.resolve_run_dir(cfg.run.name, cfg.run.output_dir)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())) or rundir.reusable(path):
        return []  # a directory a run left by failing before step 1 is reused (said so when it is)
    return [rundir.exists_message(path, "--run.output_dir" if cfg.run.output_dir else "--run.name")]


# --- helpers ---------------------------------------------------------------------------------


def _as_number(value):
    if isinstance(value, bool):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _gather(problems: list[str], state) -> list[str]:
    """Every rank's problems on every rank, so all ranks stop together (none waits at a barrier
    for a rank that already left) and rank 0 can print them all."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return problems
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    merged: list[str] = []
    for rank, found in enumerate(everyone):
        for p in found:
            item = p if all(p in f for f in everyone) else f"[rank {rank}] {p}"
            if item not in merged:
                merged.append(item)
    return merged
