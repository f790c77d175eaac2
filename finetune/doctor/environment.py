"""The environment section: what is installed and what this machine offers, one line per check.

Every check takes the facts it reads as arguments (an importer, the devices of devices.py, paths,
the environment), so that each problem it can report is provoked in tests/doctor/test_environment.py.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from finetune.doctor import report
from finetune.doctor.devices import Devices
from finetune.units import GIB

S = report.Section("environment")
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes")
# The doctor's own runs write a 13 MB model and a few MB per run; a disk with less than this free
# cannot hold even that with room for the logs. Real runs need far more (their checkpoints).
MIN_FREE_DISK_GIB = 1.0
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # wandb 0.31 Settings.mode
CPU_ADAM_BUILD_TIMEOUT_S = 900


def requirement(package: str) -> str:
    """`name>=version` as this project requires it (its installed metadata), else the bare name."""
    from packaging.requirements import Requirement

    try:
        required = metadata.requires("finetune") or []
    except metadata.PackageNotFoundError:
        return package
    for text in required:
        req = Requirement(text)
        if req.name == package and req.marker is None:
            return str(req)
    return package


def versions(importer=importlib.import_module, imports: bool = True) -> list[report.Line]:
    """One line per package: its version, or why it does not import. Without `imports` (`doctor --quick`) the
    installed version, read from the package's metadata: importing transformers and peft (with bitsandbytes) took
    3.9 s of CPU of the quick check's 6 (2-core machine), and the full doctor's runs import them all. The quick
    check's other lines still import torch (the CUDA and GPU lines), accelerate (its default config), DeepSpeed's op
    builder (CPU Adam) and bitsandbytes (the 4-bit round trip)."""
    if not imports:
        return [_installed(name) for name in PACKAGES]
    out = []
    for name in PACKAGES:
        try:
            module = importer(name)
        except Exception as e:  # not installed, or installed and broken (e.g. a CUDA mismatch at import)
            what = "not installed" if isinstance(e, ModuleNotFoundError) else "does not import"
            detail = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            fix = f'pip install "{requirement(name)}" (or pip install -e . in the repository)'
            out.append(S.problem(name, detail, fix))
            continue
        version = getattr(module, "__version__", None)
        out.append(S.ok(name, str(getattr(module, "__version__", "unknown version")), version=version))
    return out


def _installed(name: str) -> report.Line:
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        fix = f'pip install "{requirement(name)}" (or pip install -e . in the repository)'
        return S.problem(name, "not installed (no package metadata)", fix)
    return S.ok(name, f"{version} (installed; the full doctor imports it)", version=version)


def cuda(dev: Devices) -> list[report.Line]:
    """CUDA, NCCL and one line per GPU."""
    torch_version = dev.torch_version.split("+")[0]
    if not dev.cuda_build:
        if dev.driver_gpus:
            return [
                S.problem(
                    "CUDA",
                    f"torch {dev.torch_version} is the CPU build, but the NVIDIA driver lists {dev.driver_gpus} GPU(s)",
                    f"pip install --force-reinstall torch=={torch_version} --index-url "
                    f"https://download.pytorch.org/whl/cuXYZ (XYZ: a CUDA version your driver supports, "
                    f"nvidia-smi shows it)",
                )
            ]
        return _no_gpu(f"no CUDA: torch {dev.torch_version} is the CPU build and no NVIDIA GPU is present")
    visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    if not dev.cuda_available and not dev.driver_gpus:
        return _no_gpu(
            f"no NVIDIA GPU: the NVIDIA driver lists none ({visible}; torch {dev.torch_version}: {dev.cuda_error})"
        )
    if not dev.cuda_available:
        return [
            S.problem(
                "CUDA",
                f"the NVIDIA driver lists {dev.driver_gpus} GPU(s) and torch "
                f"{dev.torch_version} is built for CUDA {dev.cuda_build}, but CUDA is unusable "
                f"({visible}): {dev.cuda_error}",
                "run nvidia-smi: update a driver older than CUDA " + dev.cuda_build + ", or install the "
                "torch build for your driver's CUDA; error 802 on NVSwitch machines: systemctl start "
                "nvidia-fabricmanager",
            )
        ]
    out = [S.ok("CUDA", f"CUDA {dev.cuda_build}, {len(dev.gpus)} GPU(s) visible ({visible})", build=dev.cuda_build)]
    if dev.nccl_available:
        out.append(S.ok("NCCL", dev.nccl_version or "unknown version", version=dev.nccl_version))
    else:
        out.append(
            S.problem(
                "NCCL",
                f"torch {dev.torch_version} has no NCCL backend: GPU collectives cannot run",
                f"install torch's CUDA build for Linux (it ships NCCL): pip install --force-reinstall "
                f"torch=={torch_version}",
            )
        )
    for gpu in dev.gpus:
        mig = {True: "yes", False: "no", None: "unknown (no NVML)"}[gpu.mig]
        detail = (
            f"{gpu.name}, {gpu.memory_gib:.1f} GiB, {gpu.sm}, bf16 {'yes' if gpu.bf16 else 'no (auto precision: 16-mixed)'}"
            f", MIG {mig}"
        )
        data = {"name": gpu.name, "memory_gib": gpu.memory_gib, "capability": list(gpu.capability), "bf16": gpu.bf16}
        data.update(mig=gpu.mig, pcie=list(gpu.pcie) if gpu.pcie else None)
        if has_kernels(dev.arch_list, gpu.capability):
            out.append(S.ok(f"GPU {gpu.index}", detail, **data))
        else:
            out.append(
                S.problem(
                    f"GPU {gpu.index}",
                    f"{detail}: torch {dev.torch_version} has no kernels for "
                    f"{gpu.sm} (it has {', '.join(dev.arch_list) or 'none'})",
                    "install a torch build for this GPU (a newer CUDA wheel: pip install --upgrade "
                    "torch --index-url https://download.pytorch.org/whl/cuXYZ)",
                    **data,
                )
            )
    return out


def _no_gpu(why: str) -> list[report.Line]:
    return [
        S.skipped("CUDA", why + "; the strategies run as the CPU rehearsal (processes over gloo)"),
        S.skipped("NCCL", "no CUDA: collectives use gloo"),
        S.skipped("GPUs", "no CUDA device"),
    ]


def has_kernels(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """torch runs on a GPU with a binary for the same major and a lower or equal minor (sm_XY), or
    PTX (compute_XY) for an older or equal architecture, which the driver compiles."""
    major, minor = capability
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        if not digits[:-1].isdigit() or not digits[-1].isdigit():
            continue
        m, n = int(digits[:-1]), int(digits[-1])
        if (kind == "sm" and m == major and n <= minor) or (kind == "compute" and (m, n) <= (major, minor)):
            return True
    return False


def peer_access(dev: Devices, env=os.environ) -> list[report.Line]:
    if len(dev.gpus) < 2:
        return [S.skipped("GPU peer access", f"{len(dev.gpus)} GPU(s): no pair to connect")]
    matrix = "; ".join(f"{p.a}-{p.b} P2P {'yes' if p.peer_access else 'no'}, {p.link}" for p in dev.pairs)
    data = {"pairs": [vars(p) for p in dev.pairs], "nvml": dev.nvml_note}
    broken = [p for p in dev.pairs if p.nvlinks and not p.peer_access]
    if broken:
        return [
            S.problem(
                "GPU peer access",
                f"{matrix}: NVLink is up but CUDA peer access is off for {', '.join(f'{p.a}-{p.b}' for p in broken)}",
                "on NVSwitch machines: systemctl start nvidia-fabricmanager; then check `nvidia-smi topo -p2p r`",
                **data,
            )
        ]
    if env.get("NCCL_P2P_DISABLE", "0") not in ("", "0") and any(p.peer_access for p in dev.pairs):
        return [
            S.problem(
                "GPU peer access",
                f"{matrix}; but NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']} keeps NCCL off these links",
                "unset NCCL_P2P_DISABLE",
                **data,
            )
        ]
    note = "" if dev.nvml_note is None else f" ({dev.nvml_note})"
    return [S.ok("GPU peer access", matrix + note, **data)]


def host_memory(processes: int, on_gpu: bool, virtual_memory=None) -> report.Line:
    """Available RAM against what the doctor's runs take: each process's base RSS (the planner's
    constants, finetune/planning/prediction.py) for the ranks plus the launcher."""
    import psutil

    from finetune.planning import prediction

    vm = virtual_memory or psutil.virtual_memory()
    base = prediction.HOST_CUDA_PROCESS_BASE_GIB if on_gpu else prediction.HOST_CPU_PROCESS_BASE_GIB
    need = (processes + 1) * base
    detail = f"{vm.total / GIB:.1f} GiB total, {vm.available / GIB:.1f} GiB available"
    data = {
        "total_gib": round(vm.total / GIB, 2),
        "available_gib": round(vm.available / GIB, 2),
        "need_gib": round(need, 2),
    }
    if vm.available / GIB < need:
        return S.problem(
            "host RAM",
            f"{detail}: the doctor's {processes} rank(s) + launcher need about "
            f"{need:.1f} GiB ({base} GiB each, finetune/planning/prediction.py)",
            "stop other processes using memory (see `top`), or use a machine with more RAM",
            **data,
        )
    return S.ok("host RAM", detail, **data)


def disk(out_dir: Path, disk_usage=shutil.disk_usage) -> report.Line:
    where = Path(out_dir).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    usage = disk_usage(where)
    free = usage.free / GIB
    detail = f"{free:.1f} GiB free of {usage.total / GIB:.1f} GiB at {where}"
    if free < MIN_FREE_DISK_GIB:
        return S.problem(
            "disk",
            f"{detail}: under {MIN_FREE_DISK_GIB:g} GiB",
            "free space on that disk, or give --out a directory on another one (checkpoints of "
            "full fine-tuning hold weights and Adam states: 12+ bytes per parameter)",
            free_gib=round(free, 2),
            path=str(where),
        )
    return S.ok("disk", detail, free_gib=round(free, 2), path=str(where))


def default_accelerate_config(recipe: str | None, path: Path | None = None) -> report.Line:
    """Whether `accelerate config` left a default config, what it sets up, and (with --recipe)
    whether a plain `accelerate launch` of that recipe would be refused (docs/preflight.md)."""
    from finetune.launch.configs import from_config_file

    if path is None:
        from accelerate.commands.config.config_args import default_config_file

        path = Path(default_config_file)
    name = "accelerate default config"
    if not path.is_file():
        return S.ok(name, f"none at {path}: each recipe sets up its own strategy")
    facts = from_config_file(path)
    facts.default_config = str(path)
    if facts.problems:
        return S.problem(
            name,
            f"{path}: {facts.problems[0]}",
            f"fix the file, or move it aside: mv {path} {path}.off",
            path=str(path),
        )
    strategy, offload = facts.strategy()
    detail = (
        f"{path} sets up {strategy} (offload {offload}, {facts.distributed_type}, {facts.num_processes} "
        f"process(es)) for every `accelerate launch` without --config_file"
    )
    data = {"path": str(path), "strategy": strategy, "offload": offload}
    if recipe is None:
        return S.ok(name, detail + "; recipes of other strategies are refused under it (check one: --recipe R)", **data)
    from finetune.config.recipe import load_recipe
    from finetune.launch.plan import LaunchPlan
    from finetune.preflight.checks import strategy_matches_recipe

    cfg, _ = load_recipe(recipe, [])
    refused = strategy_matches_recipe(cfg, LaunchPlan.of(cfg, facts), in_process=False)
    if refused:
        return S.problem(
            name,
            f"{detail}: recipe {recipe!r} is meant for {cfg.run.strategy} "
            f"(offload {cfg.run.offload}) and `accelerate launch finetune/train.py --recipe {recipe}` "
            f"is refused",
            f"mv {path} {path}.off (the recipe then sets up its strategy), or use finetune train --recipe {recipe}",
            refusal=refused[0],
            **data,
        )
    return S.ok(name, detail + f"; recipe {recipe!r} matches it", **data)


def wandb_state(env=os.environ, has_key=None, version_of=metadata.version) -> report.Line:
    """W&B mode and login from the environment and ~/.netrc (the product's rule,
    finetune/telemetry/wandb_logging.py); the W&B server is never called, nor wandb imported (0.6 s of CPU)."""
    from finetune.telemetry import wandb_logging

    try:
        version = version_of("wandb")
    except metadata.PackageNotFoundError as e:
        return S.skipped(
            "W&B",
            f"wandb is not installed ({type(e).__name__}); only --logging.report_to=[wandb] "
            f'needs it: pip install "{requirement("wandb")}"',
        )
    logged_in = (has_key or wandb_logging.has_api_key)()
    mode = env.get("WANDB_MODE", "")
    login = "API key found (WANDB_API_KEY or ~/.netrc)" if logged_in else "no API key (WANDB_API_KEY, ~/.netrc)"
    data = {"version": version, "mode": mode or None, "api_key": logged_in}
    if mode and mode not in WANDB_MODES:
        return S.problem(
            "W&B",
            f"WANDB_MODE={mode!r} is not a W&B mode (allowed: {', '.join(WANDB_MODES)})",
            "unset WANDB_MODE (runs then log online with a key, offline without)",
            **data,
        )
    if mode == "online" and not logged_in:
        return S.problem(
            "W&B",
            f"WANDB_MODE=online but {login}: a run with --logging.report_to=[wandb] would stop at wandb.init",
            "wandb login (or unset WANDB_MODE to log offline)",
            **data,
        )
    effective = mode or ("online" if logged_in else "offline (the product's fallback; `wandb sync` uploads later)")
    return S.ok("W&B", f"wandb {version}, mode {effective}, {login}", **data)


def cpu_adam(build: bool, builder=None, which=shutil.which, run=subprocess.run) -> report.Line:
    """DeepSpeed's CPU Adam (every offload recipe steps the optimizer with it): its prerequisites,
    and with `build` the JIT build itself (~60 s the first time, cached by torch_extensions)."""
    name = "DeepSpeed CPU Adam"
    try:
        if builder is None:
            from deepspeed.ops.op_builder import CPUAdamBuilder

            builder = CPUAdamBuilder()
        compatible = builder.is_compatible()
    except Exception as e:
        return S.problem(
            name, f"the op builder does not load: {type(e).__name__}: {e}", f'pip install "{requirement("deepspeed")}"'
        )
    if not compatible:
        return S.problem(
            name,
            f"not buildable here: {getattr(builder, 'error_log', None) or 'is_compatible() False'}",
            "DS_BUILD_CPU_ADAM=1 pip install --no-cache-dir --force-reinstall deepspeed (prints why)",
        )
    if not which("ninja"):
        return S.problem(name, "ninja is missing: the JIT build of CPU Adam needs it", "pip install ninja")
    compiler = os.environ.get("CXX") or "c++"
    if not which(compiler):
        return S.problem(
            name,
            f"no C++ compiler ({compiler}): the JIT build of CPU Adam needs one",
            "install one: apt-get install build-essential (or set CXX)",
        )
    if not build:
        return S.ok(
            name,
            "buildable (is_compatible, ninja, c++); not built: --offload or --build-cpu-adam "
            "builds it (~60 s the first time)",
            built=False,
        )
    print(
        "[doctor] building DeepSpeed's CPU Adam (JIT, ~60 s the first time; cached in ~/.cache/torch_extensions)",
        flush=True,
    )
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('loaded')"
    try:
        proc = run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CPU_ADAM_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return S.problem(
            name,
            f"the build did not finish in {CPU_ADAM_BUILD_TIMEOUT_S} s",
            'build it alone to see why: python -c "from deepspeed.ops.op_builder import '
            'CPUAdamBuilder; CPUAdamBuilder().load(verbose=True)"',
        )
    if proc.returncode != 0 or "loaded" not in proc.stdout:
        tail = [t for t in (proc.stderr or proc.stdout).splitlines() if t.strip()][-1:] or ["no output"]
        return S.problem(
            name,
            f"the build failed (exit {proc.returncode}): {tail[0][:300]}",
            "build it alone to see the compiler's error: python -c \"from deepspeed.ops.op_builder "
            'import CPUAdamBuilder; CPUAdamBuilder().load(verbose=True)"',
        )
    return S.ok(name, "built and loaded", built=True)


def bitsandbytes_4bit(on_gpu: bool, functional=None) -> report.Line:
    """QLoRA's NF4 kernels: quantize and dequantize a random matrix on the GPU (on CPU: the CPU
    kernels the QLoRA rehearsal uses). The round trip may err by half the widest gap between NF4
    code values (of each block's absmax); broken kernels return garbage, zeros or NaN."""
    import torch

    name = "bitsandbytes 4-bit"
    try:
        functional = functional or importlib.import_module("bitsandbytes.functional")
        device = "cuda" if on_gpu else "cpu"
        codes = functional.get_4bit_type("nf4", device="cpu")
        bound = float((codes[1:] - codes[:-1]).max()) / 2 * 1.01  # + fp rounding of the absmax
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)).to(device)
        q, state = functional.quantize_4bit(x, quant_type="nf4")
        err = float(((functional.dequantize_4bit(q, state) - x).abs().max() / x.abs().max()).cpu())
    except Exception as e:
        where = "CUDA" if on_gpu else "CPU"
        return S.problem(
            name,
            f"{where} NF4 round trip failed: {type(e).__name__}: {str(e)[:200]}",
            f'pip install --force-reinstall "{requirement("bitsandbytes")}" (QLoRA needs its {where} kernels)',
        )
    data = {"device": "cuda" if on_gpu else "cpu", "max_relative_error": round(err, 4), "bound": round(bound, 4)}
    if not err <= bound:
        return S.problem(
            name,
            f"NF4 round trip off by {err:.3g} of the absmax (bound {bound:.3g}): the kernels compute wrong values",
            f'pip install --force-reinstall "{requirement("bitsandbytes")}"',
            **data,
        )
    if not on_gpu:
        return S.skipped(
            name,
            f"no CUDA GPU for the CUDA kernels; the CPU kernels (the QLoRA rehearsal) work: "
            f"NF4 round trip error {err:.3f} of the absmax (bound {bound:.3f})",
            **data,
        )
    return S.ok(name, f"CUDA NF4 round trip error {err:.3f} of the absmax (bound {bound:.3f})", **data)
