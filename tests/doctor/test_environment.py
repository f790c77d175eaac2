"""Every problem line of the environment section, provoked, with its fix; and the skipped lines of a
machine without CUDA with their reasons (finetune/doctor/environment.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.doctor import devices, environment
from finetune.units import GIB
from tests.conftest import REPO
from tests.doctor.fakes import FakeCuda, FakeNvml, fake_torch, gpu, nvswitch_h100s


def by_name(lines, name):
    (line,) = [x for x in lines if x.name == name]
    return line


def gpu_machine(gpus, tmp_path, nvml=True, **cuda_kwargs):
    return devices.probe(
        cuda=FakeCuda(gpus, **cuda_kwargs),
        nvml=FakeNvml(gpus) if nvml else "no NVML",
        torch_module=fake_torch(),
        proc=tmp_path / "absent",
    )


# --- versions ----------------------------------------------------------------------------------


def test_a_package_missing_at_import_is_a_problem_with_the_projects_requirement(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ModuleNotFoundError
    line = by_name(environment.versions(), "deepspeed")
    assert line.status == "problem" and line.detail.startswith("not installed: ModuleNotFoundError")
    assert line.fix == 'pip install "deepspeed>=0.19.8" (or pip install -e . in the repository)'
    assert by_name(environment.versions(), "torch").status == "ok"


def test_the_quick_checks_versions_are_the_installed_metadatas_without_importing(monkeypatch):
    """`doctor --quick` (issue 43): versions read, nothing imported; a package without metadata is not installed."""
    from importlib import metadata

    def importer(name):
        raise AssertionError(f"{name} imported")

    lines = environment.versions(importer, imports=False)
    assert by_name(lines, "peft").detail == f"{metadata.version('peft')} (installed; the full doctor imports it)"
    assert all(line.status == "ok" for line in lines), lines
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda n: real("no-such-dist") if n == "deepspeed" else real(n))
    line = by_name(environment.versions(importer, imports=False), "deepspeed")
    assert line.status == "problem" and line.detail == "not installed (no package metadata)"
    assert line.fix == 'pip install "deepspeed>=0.19.8" (or pip install -e . in the repository)'


def test_a_package_that_breaks_at_import_is_a_problem_too():
    def importer(name):
        if name == "bitsandbytes":
            raise RuntimeError("CUDA Setup failed despite GPU being available")
        return SimpleNamespace(__version__="1.0")

    line = by_name(environment.versions(importer), "bitsandbytes")
    assert line.status == "problem" and "does not import: RuntimeError: CUDA Setup failed" in line.detail
    assert line.fix.startswith('pip install "bitsandbytes>=0.50"')


# --- CUDA, NCCL, GPUs ----------------------------------------------------------------------------


def test_no_cuda_skips_the_gpu_lines_and_says_why(tmp_path):
    lines = environment.cuda(devices.probe(torch_module=fake_torch(cuda_build=None), proc=tmp_path / "absent"))
    assert [(x.name, x.status) for x in lines] == [("CUDA", "skipped"), ("NCCL", "skipped"), ("GPUs", "skipped")]
    assert lines[0].detail.startswith("no CUDA: torch 2.13.0+cpu is the CPU build and no NVIDIA GPU is present")


def test_a_cpu_torch_on_a_machine_with_an_nvidia_gpu_is_a_problem(tmp_path):
    (tmp_path / "0000:3b:00.0").mkdir()
    (line,) = environment.cuda(devices.probe(torch_module=fake_torch(cuda_build=None), proc=tmp_path))
    assert line.status == "problem" and "the NVIDIA driver lists 1 GPU(s)" in line.detail
    assert line.fix.startswith(
        "pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cu"
    )


def test_a_cuda_torch_that_cannot_start_cuda_is_a_problem_naming_the_driver_error(tmp_path):
    (tmp_path / "0000:18:00.0").mkdir()
    cuda = FakeCuda([gpu()], available=False, init_error="CUDA error 802: system not yet initialized")
    (line,) = environment.cuda(devices.probe(cuda=cuda, torch_module=fake_torch(cuda), proc=tmp_path))
    assert line.status == "problem" and "the NVIDIA driver lists 1 GPU(s)" in line.detail
    assert "CUDA is unusable (CUDA_VISIBLE_DEVICES=" in line.detail and "RuntimeError: CUDA error 802" in line.detail
    assert "nvidia-fabricmanager" in line.fix and "update a driver older than CUDA 12.8" in line.fix


def test_a_cuda_torch_on_a_machine_without_an_nvidia_gpu_is_the_cpu_rehearsal_not_a_problem(tmp_path):
    cuda = FakeCuda([], available=False, init_error="Found no NVIDIA driver on your system")
    lines = environment.cuda(devices.probe(cuda=cuda, torch_module=fake_torch(cuda), proc=tmp_path / "absent"))
    assert [(x.name, x.status) for x in lines] == [("CUDA", "skipped"), ("NCCL", "skipped"), ("GPUs", "skipped")]
    assert lines[0].detail.startswith("no NVIDIA GPU: the NVIDIA driver lists none")
    assert "Found no NVIDIA driver" in lines[0].detail


def test_a_torch_without_nccl_is_a_problem(tmp_path):
    gpus = nvswitch_h100s(2)
    dev = devices.probe(
        cuda=FakeCuda(gpus),
        nvml=FakeNvml(gpus),
        torch_module=fake_torch(nccl_available=False),
        proc=tmp_path / "absent",
    )
    line = by_name(environment.cuda(dev), "NCCL")
    assert line.status == "problem" and line.fix.startswith("install torch's CUDA build for Linux")


def test_each_gpu_is_a_line_and_one_torch_has_no_kernels_for_is_a_problem(tmp_path):
    gpus = [gpu(), gpu(name="NVIDIA B200", capability=(10, 0), uuid="b200", bus="00000000:19:00.0", memory_gib=180)]
    lines = environment.cuda(gpu_machine(gpus, tmp_path, arch_list=("sm_80", "sm_86", "sm_90")))
    ok, bad = by_name(lines, "GPU 0"), by_name(lines, "GPU 1")
    assert ok.status == "ok" and ok.detail == "NVIDIA H100 80GB HBM3, 80.0 GiB, sm_90, bf16 yes, MIG no"
    assert bad.status == "problem" and "has no kernels for sm_100 (it has sm_80, sm_86, sm_90)" in bad.detail
    assert bad.fix.startswith("install a torch build for this GPU")


@pytest.mark.parametrize(
    "arch, capability, usable",
    [
        (["sm_86"], (8, 9), True),  # same major, lower minor: binary compatible
        (["sm_90"], (8, 0), False),  # a newer binary does not run on an older GPU
        (["compute_90"], (10, 0), True),  # PTX is compiled by the driver for newer GPUs
        (["sm_80", "sm_90"], (12, 0), False),
    ],
)
def test_which_gpus_a_torch_build_has_kernels_for(arch, capability, usable):
    assert environment.has_kernels(arch, capability) is usable


def test_a_gpu_without_bf16_says_auto_picks_16_mixed(tmp_path):
    lines = environment.cuda(
        gpu_machine([gpu(name="Tesla T4", capability=(7, 5), memory_gib=15)], tmp_path, arch_list=("sm_75",))
    )
    assert "bf16 no (auto precision: 16-mixed)" in by_name(lines, "GPU 0").detail


# --- peer access ---------------------------------------------------------------------------------


def test_nvlink_up_but_no_peer_access_is_a_problem(tmp_path):
    dev = gpu_machine(nvswitch_h100s(2), tmp_path, peer=lambda a, b: False)
    (line,) = environment.peer_access(dev, env={})
    assert line.status == "problem" and "NVLink is up but CUDA peer access is off for 0-1" in line.detail
    assert line.fix.startswith("on NVSwitch machines: systemctl start nvidia-fabricmanager")


def test_nccl_p2p_disable_is_a_problem_when_peer_access_works(tmp_path):
    (line,) = environment.peer_access(gpu_machine(nvswitch_h100s(2), tmp_path), env={"NCCL_P2P_DISABLE": "1"})
    assert line.status == "problem" and line.fix == "unset NCCL_P2P_DISABLE"
    (line,) = environment.peer_access(gpu_machine(nvswitch_h100s(2), tmp_path), env={})
    assert line.status == "ok" and line.detail == "0-1 P2P yes, NVLink x18 (NVSwitch)"


def test_one_gpu_has_no_pair(tmp_path):
    (line,) = environment.peer_access(gpu_machine(nvswitch_h100s(1), tmp_path), env={})
    assert line.status == "skipped" and line.detail == "1 GPU(s): no pair to connect"


# --- host RAM and disk ----------------------------------------------------------------------------


def test_too_little_available_ram_is_a_problem():
    low = SimpleNamespace(total=16 * GIB, available=1 * GIB)
    line = environment.host_memory(2, on_gpu=False, virtual_memory=low)
    assert line.status == "problem" and "need about 1.7 GiB" in line.detail  # 3 processes x 0.55 GiB = 1.65
    assert line.fix.startswith("stop other processes using memory")
    line = environment.host_memory(2, on_gpu=True, virtual_memory=SimpleNamespace(total=64 * GIB, available=6 * GIB))
    assert line.status == "problem" and "need about 6.6 GiB" in line.detail  # 3 x 2.2 GiB (GPU process base)
    assert environment.host_memory(2, False, SimpleNamespace(total=16 * GIB, available=8 * GIB)).status == "ok"


def test_a_full_disk_is_a_problem_at_the_nearest_existing_directory(tmp_path):
    seen = []

    def full(path):
        seen.append(path)
        return shutil._ntuple_diskusage(100 * GIB, 100 * GIB - GIB // 2, GIB // 2)

    line = environment.disk(tmp_path / "not" / "yet", disk_usage=full)
    assert seen == [tmp_path.resolve()] and line.status == "problem"
    assert line.detail == f"0.5 GiB free of 100.0 GiB at {tmp_path.resolve()}: under 1 GiB"
    assert line.fix.startswith("free space on that disk, or give --out a directory on another one")


# --- accelerate default config ----------------------------------------------------------------------


def test_a_default_config_of_another_strategy_refuses_the_recipe(tmp_path):
    path = tmp_path / "default_config.yaml"
    shutil.copy(REPO / "accelerate_configs" / "ddp.yaml", path)
    line = environment.default_accelerate_config("zero2", path)
    assert line.status == "problem"
    assert f"{path} sets up ddp (offload none, MULTI_GPU, 2 process(es))" in line.detail
    assert "recipe 'zero2' is meant for zero2 (offload none)" in line.detail
    assert (
        line.fix == f"mv {path} {path}.off (the recipe then sets up its strategy), or use finetune train --recipe zero2"
    )
    assert "move your default config aside" in line.data["refusal"]  # the product's own preflight message
    assert environment.default_accelerate_config("ddp", path).status == "ok"
    unjudged = environment.default_accelerate_config(None, path)
    assert unjudged.status == "ok" and "recipes of other strategies are refused under it" in unjudged.detail


def test_a_broken_default_config_is_a_problem_and_none_is_fine(tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text("distributed_type: [oops\n")
    line = environment.default_accelerate_config(None, path)
    assert line.status == "problem" and "invalid YAML" in line.detail and line.fix.endswith(f"mv {path} {path}.off")
    line = environment.default_accelerate_config(None, tmp_path / "absent.yaml")
    assert line.status == "ok" and line.detail.endswith("each recipe sets up its own strategy")


# --- W&B ------------------------------------------------------------------------------------------


def test_wandb_modes_and_login():
    bad = environment.wandb_state(env={"WANDB_MODE": "offlne"}, has_key=lambda: False)
    assert bad.status == "problem" and "not a W&B mode" in bad.detail and bad.fix.startswith("unset WANDB_MODE")
    online = environment.wandb_state(env={"WANDB_MODE": "online"}, has_key=lambda: False)
    assert online.status == "problem" and online.fix.startswith("wandb login")
    fine = environment.wandb_state(env={}, has_key=lambda: False)
    assert fine.status == "ok" and "mode offline (the product's fallback" in fine.detail
    assert "mode online, API key found" in environment.wandb_state(env={}, has_key=lambda: True).detail


def test_wandb_missing_is_skipped_with_how_to_get_it():
    from importlib import metadata

    def version_of(name):
        raise metadata.PackageNotFoundError(name)

    line = environment.wandb_state(env={}, has_key=lambda: False, version_of=version_of)
    assert line.status == "skipped" and 'pip install "wandb>=0.31"' in line.detail


def test_wandb_modes_are_the_installed_wandbs():
    import typing

    from wandb.sdk.wandb_settings import Settings

    assert set(environment.WANDB_MODES) == set(typing.get_args(Settings.model_fields["mode"].annotation))


# --- DeepSpeed CPU Adam ---------------------------------------------------------------------------


class Builder:
    def __init__(self, compatible=True):
        self.compatible, self.error_log = compatible, "cpu_adam requires the 'lscpu' command"

    def is_compatible(self):
        return self.compatible


def tools(*present):
    return lambda name: f"/usr/bin/{name}" if name in present else None


def test_cpu_adam_problems_each_with_its_fix():
    line = environment.cpu_adam(False, Builder(False), tools("ninja", "c++"))
    assert (
        line.status == "problem" and "lscpu" in line.detail and line.fix.startswith("DS_BUILD_CPU_ADAM=1 pip install")
    )
    line = environment.cpu_adam(False, Builder(), tools("c++"))
    assert line.status == "problem" and line.fix == "pip install ninja"
    line = environment.cpu_adam(False, Builder(), tools("ninja"))
    assert line.status == "problem" and line.fix.startswith("install one: apt-get install build-essential")
    line = environment.cpu_adam(False, Builder(), tools("ninja", "c++"))
    assert line.status == "ok" and line.data == {"built": False} and "not built" in line.detail


def test_cpu_adam_build_failure_and_timeout_are_problems():
    failed = lambda *a, **k: subprocess.CompletedProcess(a[0], 1, "", "error: command 'c++' failed\nexit 1")  # noqa: E731
    line = environment.cpu_adam(True, Builder(), tools("ninja", "c++"), run=failed)
    assert line.status == "problem" and line.detail == "the build failed (exit 1): exit 1"
    assert "CPUAdamBuilder().load(verbose=True)" in line.fix

    def slow(*a, **k):
        raise subprocess.TimeoutExpired(a[0], k["timeout"])

    line = environment.cpu_adam(True, Builder(), tools("ninja", "c++"), run=slow)
    assert line.status == "problem" and "did not finish in 900 s" in line.detail


def test_cpu_adam_builder_that_does_not_load_is_a_problem():
    class Broken:
        def is_compatible(self):
            raise ImportError("libaio")

    line = environment.cpu_adam(False, Broken(), tools("ninja", "c++"))
    assert line.status == "problem" and "ImportError: libaio" in line.detail


# --- bitsandbytes ----------------------------------------------------------------------------------


def test_bitsandbytes_without_kernels_or_with_wrong_values_is_a_problem():
    import torch
    from bitsandbytes import functional as real

    class NoKernels:
        get_4bit_type = staticmethod(real.get_4bit_type)

        @staticmethod
        def quantize_4bit(x, quant_type):
            raise RuntimeError("CUDA Setup failed: libbitsandbytes_cuda128.so not found")

    line = environment.bitsandbytes_4bit(True, NoKernels)
    assert line.status == "problem" and "CUDA NF4 round trip failed" in line.detail
    assert line.fix.startswith('pip install --force-reinstall "bitsandbytes>=0.50" (QLoRA needs its CUDA kernels)')

    class Zeros(NoKernels):
        @staticmethod
        def quantize_4bit(x, quant_type):
            return x, None

        @staticmethod
        def dequantize_4bit(q, state):
            return torch.zeros_like(q)

    line = environment.bitsandbytes_4bit(False, Zeros)
    assert line.status == "problem" and line.detail.startswith("NF4 round trip off by 1 of the absmax")


def test_bitsandbytes_on_cpu_checks_the_cpu_kernels_and_skips_cuda():
    line = environment.bitsandbytes_4bit(False)
    assert line.status == "skipped" and line.detail.startswith("no CUDA GPU for the CUDA kernels; the CPU kernels")
    assert 0 < line.data["max_relative_error"] <= line.data["bound"] < 0.16  # half the widest NF4 gap, 0.152


def test_host_memory_need_uses_the_planners_constants():
    from finetune.planning import prediction

    line = environment.host_memory(4, True, SimpleNamespace(total=512 * GIB, available=400 * GIB))
    assert line.data["need_gib"] == pytest.approx(5 * prediction.HOST_CUDA_PROCESS_BASE_GIB)


def test_disk_ok_names_the_directory(tmp_path):
    line = environment.disk(tmp_path)
    assert line.status == "ok" and line.data["path"] == str(Path(tmp_path).resolve())
