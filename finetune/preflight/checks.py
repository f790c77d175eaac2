"""Preflight's entry points and the checks of the configs themselves: every problem the configs show, found before any
weights load and raised together as one ConfigError (exit 2). What is checked, and where: docs/preflight.md."""

from __future__ import annotations

import os
from pathlib import Path

from finetune import precision
from finetune.errors import ConfigError, DataError, ReportedElsewhere, UserError
from finetune.launch.configs import DeclaredLaunch
from finetune.launch.plan import LaunchPlan
from finetune.preflight import devices, model_files, parallel
from finetune.strategies import by_name, launch_line

SOURCE = "preflight (nothing was started, loaded or written)"


OTHER_RANKS_WAIT_S = 30  # for the launcher to stop them once rank 0 has exited


def check_before_processes(
    cfg, setup, env=os.environ, wait_s: float = OTHER_RANKS_WAIT_S, stopped=lambda: False
) -> None:
    """In each launched process, before its process group: a launch whose processes could only run
    alone is refused before any collective or DeepSpeed op build (devices.lone_processes_problem).
    Rank 0 says why and exits 2 at once. The other ranks wait, silently, for the launcher to stop them
    (torchrun and accelerate launch terminate the others when one exits): were one of them to exit
    first, the launcher could kill rank 0 before it printed. They exit 2 once `stopped()` (a stop
    signal arrived: the ranks record signals instead of dying, finetune/training/signals.py), else after
    `wait_s`; before, a rank slept through the launcher's SIGTERM until torchrun killed it 30 s later."""
    problem = devices.lone_processes_problem(cfg, setup, env)
    if problem is None:
        return
    if env.get("RANK", "0") != "0":
        import time

        deadline = time.monotonic() + wait_s
        while not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ReportedElsewhere(problem)
    raise ConfigError([problem], SOURCE)


def check_before_loading(
    cfg, state, *, setup=None, resume: str | None = None, launch: LaunchPlan | None = None
) -> None:
    """In each launched process: raise one ConfigError listing every problem; ranks agree. `launch`:
    this process's launch (resolved from `state` and `setup` when not given). `resume` (--resume)
    lets the run directory exist: a resumed run continues it."""
    launch = launch or LaunchPlan.resolve(cfg, state, setup)
    found = (
        devices.world_size_problem(state, cfg, launch.setup),
        devices.launcher_processes_problem(launch.setup, cfg),
        devices.machines_problem(launch),
    )
    problems = [p for p in found if p] + run_checks(cfg, launch, in_process=True, resume=resume)
    problems = _gather(problems, state)
    if problems and not state.is_main_process:  # rank 0 prints the list; the others say where it is
        raise UserError(f"preflight found {len(problems)} problem(s) (listed by rank 0); nothing was started")
    if problems:
        raise ConfigError(problems, SOURCE)


def check_launch(launch_args: list[str], resume_check=None, resume_config=None, problems=None) -> None:
    """For `finetune train`: the same checks from the accelerate config it is about to launch.
    With --resume, `resume_config(recipe, overrides, allow_change=) -> ResumedConfig` gives the
    configuration (the run's saved one) and `resume_check(cfg, launch, resume, overrides) -> (problems, cfg)`
    runs first. `problems`: those found before (the command line's, the recipe's); the recipe's own
    are added, and with any of them only the inputs are checked (accelerate config, model, data, run
    directory): the rest judges a configuration that holds together. All raised at once."""
    from accelerate.commands.launch import launch_command_parser

    from finetune import resources
    from finetune.config.command_line import parse_train_args
    from finetune.config.recipe import load_recipe
    from finetune.launch.configs import DeclaredLaunch, from_config_file

    problems = [] if problems is None else problems
    parsed = launch_command_parser().parse_args(launch_args)
    args, overrides = parse_train_args(parsed.training_script_args)
    path = None  # the recipe's file
    if args.resume and resume_config:
        resumed = resume_config(args.recipe, overrides, allow_change=args.allow_config_change, resume=args.resume)
        cfg, overrides = resumed.cfg, resumed.overrides  # a resolved `auto` as the run recorded it
    else:
        cfg, path = load_recipe(args.recipe, overrides, problems)
    cfg.run.overwrite = cfg.run.overwrite or args.overwrite
    if parsed.config_file:
        facts = from_config_file(
            Path(parsed.config_file),
            num_processes=parsed.num_processes,
            cpu=parsed.cpu,
            deepspeed_config_file=parsed.deepspeed_config_file,
            base_dirs=[resources.ROOT],
        )
    else:
        facts = DeclaredLaunch(
            source="accelerate launch without a config file",
            num_processes=parsed.num_processes or 1,
            use_cpu=parsed.cpu,
        )
    if problems:  # the command line's or the recipe's, named by the recipe they are about
        for check in (model_source, model_kind_and_files, dataset, run_directory):
            problems += check(cfg, None, in_process=False)
        overridden = " + command-line overrides" if overrides else ""
        raise ConfigError(problems + facts.problems, f"{path or 'configuration'}{overridden}: {SOURCE}")
    launch = LaunchPlan.of(cfg, facts)
    if args.resume and resume_check:
        found, cfg = resume_check(cfg, launch, args.resume, overrides, allow_input_change=args.allow_input_change)
        problems += found
    problems += run_checks(cfg, launch, in_process=False, resume=args.resume)
    if problems:
        raise ConfigError(problems, SOURCE)


def run_checks(cfg, launch: LaunchPlan, *, in_process: bool, resume: str | None = None) -> list[str]:
    problems = list(launch.facts.problems)
    checks = [
        devices.one_device_per_process,
        devices.one_process_many_devices,
        deepspeed_values,
        strategy_matches_recipe,
        qlora_storage,
        parallel.problems,
        policy_problems,
        model_source,
        model_kind_and_files,
        dataset,
    ]
    if not resume:  # a resumed run continues its directory (finetune/checkpointing/resume.py checks it exists)
        checks.append(run_directory)
    for check in checks:
        problems += check(cfg, launch, in_process=in_process)
    from finetune.launch import rundir

    # a live run's directory or one that cannot be written, first (nothing else matters then); in the
    # launched processes rank 0 decides as it locks and creates it (finetune/launch/rundir.py create)
    return (rundir.directory_problems(cfg) if not in_process else []) + problems


# --- the checks ------------------------------------------------------------------------------


# DeepSpeed key -> (TrainingArguments field it must equal, how the value follows from the args)
def deepspeed_values(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """Explicit DeepSpeed values must equal what Trainer computes; "auto" lets Trainer fill them in
    (transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process)."""
    facts, ds, dp = launch.facts, launch.facts.deepspeed, launch.data_parallel_size
    if facts.distributed_type != "DEEPSPEED" or not ds or not launch.mesh.divides:
        return []
    a = cfg.training.typed
    per_device, accum = a.per_device_train_batch_size, a.gradient_accumulation_steps
    expected = {
        "train_micro_batch_size_per_gpu": (per_device, "training.per_device_train_batch_size"),
        "gradient_accumulation_steps": (accum, "training.gradient_accumulation_steps"),
        "train_batch_size": (
            launch.effective_batch(per_device, accum),
            f"training.per_device_train_batch_size x gradient_accumulation_steps x "
            f"{dp} data-parallel ranks = {per_device} x {accum} x {dp}",
        ),
        "gradient_clipping": (a.max_grad_norm, "training.max_grad_norm"),
    }  # bf16/fp16: the precision policy's (policy_problems)
    if per_device == "auto":  # the run plans the batch layout, then checks again (finetune/training/planned.py)
        expected = {"gradient_clipping": expected["gradient_clipping"]}
    problems = []
    for key, (want, field) in expected.items():
        section, _, leaf = key.rpartition(".")
        value = (ds.get(section) or {}).get(leaf) if section else ds.get(key)
        if value is None or value == "auto":
            continue
        if _as_number(value) != _as_number(want):
            problems.append(
                f"{facts.deepspeed_source}: {key} is {value!r} but {field} gives {want!r}; "
                f'set it to "auto" (Trainer fills it in) or make the two agree'
            )
    return problems


def strategy_matches_recipe(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """The recipe's run.strategy / run.offload against what the launch config will set up."""
    facts, want, want_offload = launch.facts, cfg.run.strategy, cfg.run.offload
    if (want == "any" and want_offload == "any") or facts.problems:
        return []
    got, got_offload = launch.strategy, launch.offload
    if (want in ("any", got)) and (want_offload in ("any", got_offload)):
        return []
    where = facts.deepspeed_source if facts.distributed_type == "DEEPSPEED" else facts.source
    line = launch_line(want if want != "any" else got, want_offload if want_offload != "any" else "none", cfg.recipe)
    aside = (
        ""
        if not facts.default_config
        else (
            f"\n  or, to let the recipe set up its strategy itself, move your default config aside (e.g. "
            f"`mv {facts.default_config} {facts.default_config}.off`) and launch without one:\n"
            f"    accelerate launch finetune/train.py --recipe {cfg.recipe}"
        )
    )
    return [
        f"recipe {cfg.recipe!r} is meant for strategy {want!r} with offload {want_offload!r} (run.strategy, "
        f"run.offload) but {where} sets up {got!r} with offload {got_offload!r} ({facts.distributed_type}, "
        f"{facts.num_processes} process(es)). Launch it with:\n{line}{aside}\n  or set run.strategy: any "
        f"(and run.offload: any) to accept whatever the launch gives"
    ]


def qlora_storage(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """ZeRO-3 and FSDP flatten and shard parameters of one float dtype, so QLoRA's packed 4-bit
    weights must be stored in the compute dtype (bnb_4bit_quant_storage; see finetune/modeling/load.py)."""
    strategy, m = launch.strategy, cfg.method
    row = by_name(strategy)
    if m.name != "qlora" or not (row and row.shards_params):
        return []
    compute_name = launch.policy.compute_dtype
    if m.quant_storage in ("auto", compute_name):
        return []
    return [
        f"method.quant_storage: {m.quant_storage!r} under {strategy}: ZeRO-3 and FSDP shard only float "
        f"parameters of one dtype, so QLoRA's 4-bit weights must be stored as the compute dtype "
        f"({compute_name} here, from training.precision); set method.quant_storage: auto"
    ]


def model_source(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """model.name_or_path / model.tokenizer_name_or_path: an existing model directory, or a hub
    id that is in the local Hugging Face cache or whose hub can be reached. Without this, an
    uncached id on a machine without network costs a minute of retries inside from_pretrained."""
    from finetune.config.sections import BUNDLED_MODEL

    problems = []
    for key, name, marker in (
        ("model.name_or_path", cfg.model.name_or_path, "config.json"),
        ("model.tokenizer_name_or_path", cfg.model.tokenizer_name_or_path, "tokenizer_config.json"),
    ):
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


def model_kind_and_files(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """A causal LM (not an encoder or a seq2seq model), with whole weight files (finetune/preflight/model_files.py)."""
    return model_files.model_problems(cfg)


def _hub_problem(repo_id: str, revision: str | None, marker: str) -> str | None:
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    from finetune.modeling.load import hub_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, marker, revision=revision), str):
            return None  # cached: loads without network
    except ValueError as e:  # huggingface_hub's HFValidationError: not a valid repo id
        return f"{repo_id!r} is neither a local directory nor a valid hub id: {e}"
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    fix = (
        f"download it where there is network (`{fetch}`) and copy that cache's models--{repo_id.replace('/', '--')} "
        f"into this one, set HF_HOME to a cache that holds it, or pass a local model directory"
    )
    missing = f"hub id {repo_id!r} is not in {hub_cache()}"
    if constants.HF_HUB_OFFLINE:
        return f"{missing}, so the Hub is not tried: {fix}"
    endpoint = urlparse(constants.ENDPOINT)
    try:  # seconds, not the minute of retries from_pretrained spends before giving up
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as e:
        return f"{missing} and {endpoint.hostname} cannot be reached ({e}): {fix}"
    return None


def dataset(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """The data file and the held-out file read as the run reads them: the training file's first rows
    (finetune/data/build.py check_head), and the exact-match rows the evaluation will use, each
    validated as evaluation reads it (before training and after it)."""
    from finetune.data import build, prepare

    problems = [] if cfg.data.path == "demo" else build.check_head(cfg.data)
    problems += [p for p in [prepare.cache_problem(cfg.data)] if p]  # the prepared data's cache folder
    if cfg.eval.exact_match and cfg.eval.heldout_path not in (None, "demo"):
        problem = heldout_problem(cfg.eval.heldout_path, cfg.eval.samples)
        if problem:
            problems.append(f"eval.heldout_path: {problem}")
    return problems


def heldout_problem(path: str, samples: int) -> str | None:
    """The first `samples` held-out rows read and turned into prompts and answers as evaluation does."""
    from finetune.data import read
    from finetune.data.formats import prompt_and_answer

    if not read.is_local(path):
        return None  # a Hub dataset: read by the run (needs the network)
    try:
        for i, row in enumerate(read.read_rows(path)[:samples], start=1):
            prompt_and_answer(row, f"{path} row {i}")
    except DataError as e:
        return str(e)
    return None


def run_directory(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """An existing, non-empty run directory is never replaced without --overwrite, and a folder finetune
    did not make never is (finetune/launch/rundir.py problem)."""
    from finetune.launch import run_lock, rundir

    if not (cfg.run.name or cfg.run.output_dir):
        return []  # a default name is new (it carries the time)
    path = rundir.resolve_run_dir(cfg.run.name, cfg.run.output_dir)
    if run_lock.live_run(path):
        return []  # named first by directory_problems, or by rank 0 as it locks
    given_by = "--run.output_dir" if cfg.run.output_dir else "--run.name"
    why = rundir.problem(path, overwrite=cfg.run.overwrite, inputs=rundir.inputs(cfg), name_given_by=given_by)
    return [why] if why else []


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


# ---- The precision policy against the launch: combinations it cannot honour, each with the
# alternative. The policy itself is resolved with the launch (finetune/launch/plan.py); what engaged
# is proven later from the live objects (finetune/training/precision_evidence.py).


def policy_problems(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """Combinations the policy cannot honour, each with the alternative (docs/bad_inputs.md)."""
    import torch

    facts, policy, fam, cuda = launch.facts, launch.policy, launch.family, launch.cuda
    label = precision.policy_label(policy, cfg.training.precision)
    problems = []
    if cfg.training.precision == "auto":  # explicit policies were checked with the config
        problems += precision.config_problems(
            policy,
            model_dtype=cfg.model.dtype,
            method=cfg.method.name,
            compute_dtype=cfg.method.compute_dtype,
            requested="auto",
        )
    if policy.needs_cuda and not cuda:
        problems.append(
            f"training.precision {label} on CPU: Accelerate skips fp16 autocast and loss scaling on "
            f"CPU and would train in fp32 while reporting fp16 (accelerate/accelerator.py), and "
            f"DeepSpeed refuses fp16 there; use --training.precision=bf16-mixed (bf16 autocast runs "
            f"on CPU) or --training.precision=32-true"
        )
    if cuda and "bfloat16" in (policy.compute_dtype, policy.master_dtype) and not torch.cuda.is_bf16_supported():
        problems.append(
            f"training.precision {label} needs bf16, but {torch.cuda.get_device_name(0)} has none "
            f"(compute capability 8.0+, Ampere or newer); use --training.precision=16-mixed "
            f"(or auto, which picks it on this GPU)"
        )
    strategy, offload = launch.strategy, launch.offload
    if fam == "deepspeed" and offload != "none" and not policy.deepspeed_offload_ok:
        problems.append(
            f"training.precision {label} with {strategy} offload {offload!r} ({facts.deepspeed_source}): "
            f"DeepSpeed's offloaded optimizer (DeepSpeedCPUAdam, built by Accelerate) keeps fp32 states "
            f"and asserts on bf16 ones; use --training.precision=bf16-mixed with offload, or "
            f"bf16-true with the {strategy} config without offload"
        )
    want = policy.training_args(fam)
    want_mp = "bf16" if want["bf16"] else "fp16" if want["fp16"] else "no"
    if facts.mixed_precision in ("bf16", "fp16") and facts.mixed_precision != want_mp and fam != "deepspeed":
        problems.append(
            f"{facts.source}: mixed_precision {facts.mixed_precision!r} contradicts training.precision "
            f"{label} (which needs Accelerate's mixed precision {want_mp!r}); remove mixed_precision from "
            f"the accelerate config (the policy sets it) or choose the matching training.precision"
        )
    if fam == "deepspeed" and facts.deepspeed:
        problems += _deepspeed_keys(policy, label, facts)
    return problems


def _deepspeed_keys(policy: precision.Policy, label: str, facts: DeclaredLaunch) -> list[str]:
    """Explicit DeepSpeed precision values must be the policy's; "auto" or absent: the policy fills
    them in (TrainingArguments for bf16/fp16.enabled, finetune/training/precision_evidence.py apply for the rest)."""
    low = policy.deepspeed_low_precision_master
    wanted = {
        ("bf16", "enabled"): policy.deepspeed_bf16,
        ("fp16", "enabled"): policy.deepspeed_fp16,
        ("bf16", "bf16_master_weights_and_grads"): low,
        ("bf16", "bf16_optimizer_states"): low,
    }
    problems = []
    for (section, key), want in wanted.items():
        have = (facts.deepspeed.get(section) or {}).get(key)
        if have in (None, "auto") or bool(have) == want:
            continue
        problems.append(
            f"{facts.deepspeed_source}: {section}.{key} is {have!r} but training.precision {label} "
            f'needs {want!r}; set it to "auto" (or remove it): the policy fills it in'
        )
    return problems
