"""The GPUs of this machine and the links between them, read from torch and (where installed) NVML. `probe(cuda=...,
nvml=...)` takes torch.cuda-like and pynvml-like objects so that the GPU paths run in unit tests
(tests/doctor/fakes.py). The expected link figure is NCCL's own model of the link (docs/doctor.md gives the sources).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from finetune.strategies import SHIPPED_PROCESSES
from finetune.units import GIB

# NCCL src/graph/topo.h: usable GB/s per NVLink and direction, by compute capability.
NCCL_NVLINK_GBS = {(6, 0): 18.0, (7, 0): 20.0, (8, 0): 20.0, (8, 6): 12.0, (9, 0): 20.6, (10, 0): 40.1}
# NCCL src/graph/topo.cc kvDictPciGen: 100 Mbit/s per lane by PCIe generation; GB/s = lanes x value / 80.
NCCL_PCIE_LANE_100MBPS = {1: 15, 2: 30, 3: 60, 4: 120, 5: 240, 6: 480}
# NVML nvmlGpuTopologyLevel_t values and the names `nvidia-smi topo -m` prints for them.
TOPOLOGY = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_SYSTEM = 50
NVLINK_REMOTE_GPU, NVLINK_REMOTE_SWITCH = 0, 2  # nvmlIntNvLinkDeviceType_t
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the kernel driver sees


@dataclass
class Gpu:
    index: int
    name: str
    memory_gib: float
    capability: tuple[int, int]
    mig: bool | None  # None: unknown (no NVML and the name does not say)
    bus_id: tuple | None = None  # (domain, bus, device, function) from NVML
    pcie: tuple[int, int] | None = None  # NVML's maximum (generation, width)
    nvlinks: dict = field(default_factory=dict)  # active links: peer GPU index, "switch" or "unresolved" -> count
    nvml_note: str | None = None  # why NVML facts are missing for this GPU

    @property
    def bf16(self) -> bool:
        """Native bf16: compute capability 8.0 or newer (torch.cuda.is_bf16_supported(including_emulation=False))."""
        return self.capability[0] >= 8

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def pcie_gbs(self) -> float | None:
        if self.pcie is None or self.pcie[0] not in NCCL_PCIE_LANE_100MBPS:
            return None
        return self.pcie[1] * NCCL_PCIE_LANE_100MBPS[self.pcie[0]] / 80


@dataclass
class Pair:
    a: int
    b: int
    peer_access: bool  # CUDA peer access both ways (torch.cuda.can_device_access_peer)
    nvlinks: int | None  # NVLinks between them (direct + through NVSwitch); None: unknown
    link: str  # what connects them, e.g. "NVLink x18 (NVSwitch)", "PCIe Gen4 x16 (PXB)", "unknown (...)"
    expected_gbs: float | None  # NCCL's figure for the link, GB/s per direction; None: unknown
    source: str  # how expected_gbs was derived, or why it is unknown


@dataclass
class Devices:
    torch_version: str
    cuda_build: str | None  # torch.version.cuda: None for a CPU build
    cuda_available: bool
    cuda_error: str | None  # why CUDA is unusable in a CUDA build
    arch_list: list[str]  # torch.cuda.get_arch_list(): the GPU architectures this torch has kernels for
    nccl_version: str | None
    nccl_available: bool
    gpus: list[Gpu]
    pairs: list[Pair]
    nvml_note: str | None  # why NVML is not used (None when it is)
    driver_gpus: int  # GPUs the NVIDIA kernel driver lists (/proc/driver/nvidia/gpus), torch aside

    @property
    def on_gpu(self) -> bool:
        return self.cuda_available and bool(self.gpus)

    @property
    def world_size(self) -> int:
        """The doctor's ranks: every visible GPU, or without CUDA the processes of the shipped
        accelerate_configs/cpu/ variants (the CPU rehearsal over gloo)."""
        return len(self.gpus) if self.cuda_available else SHIPPED_PROCESSES

    def expected_busbw(self) -> tuple[float | None, str]:
        """(GB/s, how) for a collective over all GPUs: the slowest pair (a ring passes every GPU),
        known only when every pair's figure is known and all pairs are links of one kind."""
        if len(self.gpus) < 2:
            return None, "fewer than 2 GPUs"
        unknown = [p for p in self.pairs if p.expected_gbs is None]
        if unknown:
            return None, f"GPU {unknown[0].a}-{unknown[0].b}: {unknown[0].source}"
        kinds = {p.link.split()[0] for p in self.pairs}
        if len(kinds) > 1:
            return None, f"mixed links ({', '.join(sorted(kinds))}): the figure depends on the rings NCCL builds"
        slowest = min(self.pairs, key=lambda p: p.expected_gbs)
        return slowest.expected_gbs, f"{slowest.link}, {slowest.source}"


def probe(cuda=None, nvml=None, torch_module=None, proc: Path = NVIDIA_PROC) -> Devices:
    """Read the devices. `cuda`: torch.cuda or a stand-in; `nvml`: an initialised pynvml-like module,
    a string saying why there is none, or None to load pynvml here."""
    torch = torch_module
    if torch is None:
        import torch
    cuda = cuda if cuda is not None else torch.cuda
    build = getattr(torch.version, "cuda", None)
    available = bool(build) and cuda.is_available()
    error = None
    if build and not available:
        try:
            cuda.init()
            error = "torch.cuda.is_available() is False"
        except Exception as e:  # the driver's own reason (too old, error 802: fabric manager not running, ...)
            error = f"{type(e).__name__}: {e}"
    nccl_version, nccl_available = None, False
    if available:
        nccl_available = torch.distributed.is_nccl_available()
        try:
            version = cuda.nccl.version()  # (2, 21, 5); an int in older torch
            nccl_version = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except Exception as e:
            nccl_version = f"unknown ({type(e).__name__})"
    gpus, pairs, nvml_note = [], [], None
    if available:
        n = cuda.device_count()
        for i in range(n):
            props = cuda.get_device_properties(i)
            mig = True if " MIG " in f" {props.name} " else None
            gpus.append(Gpu(i, props.name, round(props.total_memory / GIB, 2), (props.major, props.minor), mig=mig))
        nvml = load_nvml() if nvml is None else nvml
        handles, nvml_note = _nvml_handles(cuda, nvml, n)
        nvml = nvml if not isinstance(nvml, str) else None
        for gpu in gpus:
            _read_nvml(nvml, handles.get(gpu.index), gpu, handles)
        pairs = [_pair(cuda, nvml, handles, gpus[a], gpus[b]) for a in range(n) for b in range(a + 1, n)]
    arch_list = list(cuda.get_arch_list()) if available else []
    driver_gpus = len(list(proc.iterdir())) if proc.is_dir() else 0
    facts = (arch_list, nccl_version, nccl_available, gpus, pairs, nvml_note, driver_gpus)
    return Devices(torch.__version__, build, available, error, *facts)


def load_nvml():
    """pynvml initialised, or a string saying why not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except ImportError:
        return "NVML not available: pip install nvidia-ml-py for link types and figures"
    except Exception as e:
        return f"NVML did not initialise: {type(e).__name__}: {e}"


def _nvml_handles(cuda, nvml, n: int) -> tuple[dict, str | None]:
    """CUDA index -> NVML handle, matched by UUID (NVML's own index order can differ from CUDA's)."""
    if isinstance(nvml, str):
        return {}, nvml
    handles = {}
    for i in range(n):
        uuid = str(getattr(cuda.get_device_properties(i), "uuid", "") or "")
        if not uuid:
            continue
        if not uuid.startswith(("GPU-", "MIG-")):
            uuid = "GPU-" + uuid
        try:
            handles[i] = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            continue
    missing = [i for i in range(n) if i not in handles]
    return handles, (f"NVML has no device with the UUID of CUDA device(s) {missing}" if missing else None)


def bus_id(text) -> tuple | None:
    """'00000000:3B:00.0' (NVML, any domain width) -> (domain, bus, device, function)."""
    text = text.decode() if isinstance(text, bytes) else str(text)
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def _read_nvml(nvml, handle, gpu: Gpu, handles: dict) -> None:
    if nvml is None or handle is None:
        gpu.nvml_note = "no NVML handle"
        return
    try:
        gpu.bus_id = bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
        gpu.pcie = (nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle), nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except Exception as e:
        gpu.nvml_note = f"PCIe link not read: {type(e).__name__}"
    try:
        gpu.mig = nvml.nvmlDeviceGetMigMode(handle)[0] == 1  # (current, pending); 1 = NVML_DEVICE_MIG_ENABLE
    except Exception:
        pass  # not supported on this GPU: MIG stays what the name says
    bus_to_index = {}
    for i, h in handles.items():
        try:
            bus_to_index[bus_id(nvml.nvmlDeviceGetPciInfo(h).busId)] = i
        except Exception:
            continue
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != 1:  # NVML_FEATURE_ENABLED
                continue
        except Exception:
            break  # NotSupported / InvalidArgument: no (more) NVLinks
        try:
            kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            remote = bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except Exception:
            kind, remote = None, None
        key = (
            "switch"
            if kind == NVLINK_REMOTE_SWITCH
            else bus_to_index.get(remote)
            if kind == NVLINK_REMOTE_GPU
            else None
        )
        key = "unresolved" if key is None else key  # an active link whose other end NVML did not name
        gpu.nvlinks[key] = gpu.nvlinks.get(key, 0) + 1


def _pair(cuda, nvml, handles: dict, a: Gpu, b: Gpu) -> Pair:
    peer = bool(cuda.can_device_access_peer(a.index, b.index) and cuda.can_device_access_peer(b.index, a.index))
    pair = functools.partial(Pair, a.index, b.index, peer)
    if nvml is None or a.index not in handles or b.index not in handles:
        why = "NVML not available" if nvml is None else "no NVML handle for one of the GPUs"
        return pair(None, f"unknown ({why})", None, why)
    if a.nvlinks.get("unresolved") or b.nvlinks.get("unresolved"):
        why = "an active NVLink whose other end NVML did not name"
        return pair(None, f"unknown ({why})", None, why)
    direct = a.nvlinks.get(b.index, 0)
    switched = min(a.nvlinks.get("switch", 0), b.nvlinks.get("switch", 0))
    links = direct + switched
    if links:
        link = f"NVLink x{links}" + (" (NVSwitch)" if switched else "")
        per_link = NCCL_NVLINK_GBS.get(a.capability)
        if per_link is None:
            return pair(links, link, None, f"no NCCL per-link figure for {a.sm}")
        return pair(
            links, link, round(links * per_link, 1), f"{links} x {per_link} GB/s per link ({a.sm}, NCCL's model)"
        )
    try:
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a.index], handles[b.index])
    except Exception as e:
        return pair(0, "PCIe (topology not read)", None, f"NVML topology: {type(e).__name__}")
    where = TOPOLOGY.get(level, f"level {level}")
    gens = [g.pcie for g in (a, b)]
    label = f"PCIe Gen{gens[0][0]} x{gens[0][1]} ({where})" if gens[0] else f"PCIe ({where})"
    if level >= TOPOLOGY_SYSTEM:
        return pair(0, label, None, "the path crosses the CPU interconnect, whose bandwidth NVML does not give")
    figures = [g.pcie_gbs() for g in (a, b)]
    if None in figures:
        return pair(0, label, None, "PCIe generation/width not read from NVML")
    return pair(0, label, min(figures), "lanes x NCCL's per-lane PCIe rate, the slower GPU")
