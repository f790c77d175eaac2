"""Made-up GPUs for the doctor's GPU paths: stand-ins for torch (its `cuda` and `version`) and for
pynvml with the calls finetune/doctor/devices.py makes, so the same code runs without a GPU.
A machine is a list of GPU dicts; NVML may list them in another order than CUDA (matched by UUID).
And hand-made run records (`record`) with the fields of docs/run_record.md the doctor reads."""

from __future__ import annotations

from types import SimpleNamespace

from finetune import strategies

GIB = 2**30


def gpu(
    name="NVIDIA H100 80GB HBM3",
    memory_gib=80,
    capability=(9, 0),
    uuid="aaaa-0",
    bus="00000000:18:00.0",
    pcie=(5, 16),
    mig=0,
    nvlinks=(),
) -> dict:
    """nvlinks: one (remote kind, remote bus id) per active link; kind 0 = GPU, 2 = NVSwitch."""
    return {
        "name": name,
        "memory": memory_gib * GIB,
        "capability": capability,
        "uuid": uuid,
        "bus": bus,
        "pcie": pcie,
        "mig": mig,
        "nvlinks": list(nvlinks),
    }


class FakeCuda:
    def __init__(
        self,
        gpus,
        peer=lambda a, b: True,
        arch_list=("sm_80", "sm_86", "sm_90"),
        available=True,
        init_error=None,
        nccl=(2, 27, 3),
    ):
        self.gpus, self.peer, self.arch_list = gpus, peer, list(arch_list)
        self.available, self.init_error = available, init_error
        self.nccl = SimpleNamespace(version=lambda: nccl)

    def is_available(self):
        return self.available

    def init(self):
        if self.init_error:
            raise RuntimeError(self.init_error)

    def device_count(self):
        return len(self.gpus)

    def get_device_properties(self, i):
        g = self.gpus[i]
        return SimpleNamespace(
            name=g["name"], total_memory=g["memory"], major=g["capability"][0], minor=g["capability"][1], uuid=g["uuid"]
        )

    def can_device_access_peer(self, a, b):
        return self.peer(a, b)

    def get_arch_list(self):
        return self.arch_list


def fake_torch(cuda: FakeCuda | None = None, cuda_build: str | None = "12.8", nccl_available=True):
    return SimpleNamespace(
        __version__="2.13.0+cu128" if cuda_build else "2.13.0+cpu",
        version=SimpleNamespace(cuda=cuda_build),
        cuda=cuda or FakeCuda([], available=False),
        distributed=SimpleNamespace(is_nccl_available=lambda: nccl_available),
    )


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's calls over the same GPU dicts, listed in `order` (NVML index -> CUDA index);
    topology: {(cuda a, cuda b): nvmlGpuTopologyLevel_t}."""

    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, gpus, topology=None, order=None):
        self.gpus = [gpus[i] for i in (order or range(len(gpus)))]
        self.topology = topology or {}
        self.cuda_of = {id(g): i for i, g in enumerate(gpus)}

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for g in self.gpus:
            if "GPU-" + g["uuid"] == uuid:
                return g
        raise NVMLError("NotFound")

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=h["bus"].encode())

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return h["pcie"][0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return h["pcie"][1]

    def nvmlDeviceGetMigMode(self, h):
        return (h["mig"], h["mig"])

    def _link(self, h, link):
        if link >= len(h["nvlinks"]):
            raise NVMLError("NotSupported" if not h["nvlinks"] else "InvalidArgument")
        return h["nvlinks"][link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._link(h, link)
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self._link(h, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self._link(h, link)[1])

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        a, b = sorted((self.cuda_of[id(h1)], self.cuda_of[id(h2)]))
        return self.topology[(a, b)]


def nvswitch_h100s(n=2, links=18) -> list[dict]:
    """An HGX H100 board: every GPU's NVLinks go to the NVSwitches."""
    return [
        gpu(
            uuid=f"h100-{i}",
            bus=f"00000000:{0x18 + i:02X}:00.0",
            nvlinks=[(2, f"00000000:{0xA0 + k:02X}:00.0") for k in range(links)],
        )
        for i in range(n)
    ]


LOSSES = [10.770113, 10.747, 10.76, 10.65, 10.68, 10.58, 10.62, 10.60, 10.61, 10.558376]


# strategy.evidence as the CPU doctor's runs recorded it (world size 2), per strategy row; DeepSpeed's
# offload devices and optimizer per row as DeepSpeed reports them.
_DS = {
    "engine_class": "DeepSpeedEngine",
    "gradient_clipping": 1.0,
    "offload_optimizer_device": "none",
    "offload_param_device": "none",
    "optimizer_offloaded": False,
    "basic_optimizer_class": "AdamW",
}
_FSDP = {
    "engine_class": "FSDPPeftModelForCausalLM",
    "fsdp_modules": 5,
    "dtensor_params": 48,
    "placements": "(Shard(dim=0),)",
    "fsdp_offload_policy": "OffloadPolicy",
    "local_param_fraction": 0.5,
}
EVIDENCE = {
    "single": {},
    "ddp": {"engine_class": "DistributedDataParallel"},
    "zero2": {**_DS, "zero_stage": 2},
    "zero2_offload": {
        **_DS,
        "zero_stage": 2,
        "offload_optimizer_device": "cpu",
        "optimizer_offloaded": True,
        "basic_optimizer_class": "DeepSpeedCPUAdam",
    },
    "zero3": {**_DS, "zero_stage": 3, "params_offloaded": False, "local_param_fraction": 0.5},
    "zero3_offload": {
        **_DS,
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
        "optimizer_offloaded": True,
        "params_offloaded": True,
        "basic_optimizer_class": "DeepSpeedCPUAdam",
        "local_param_fraction": 0.5,
    },
    "fsdp": _FSDP,
    "fsdp_offload": {**_FSDP, "fsdp_offload_policy": "CPUOffloadPolicy"},
}


def record(row_key: str, world: int, losses=LOSSES, policy="32-true", **evidence) -> dict:
    """A completed run.json of a strategy row with the evidence its runs show (EVIDENCE), changed by `evidence`."""
    row = strategies.by_key(row_key)
    ev = {
        "engine_class": "PeftModelForCausalLM",
        "zero_stage": None,
        "fsdp_modules": 0,
        "dtensor_params": 0,
        "params": 48,
        "local_param_fraction": None,
        "world_size": world,
        **EVIDENCE[row_key],
    }
    if ev["local_param_fraction"] is not None:
        ev["local_param_fraction"] = 1 / world
    ev |= evidence
    compute = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16"}[policy]
    return {
        "strategy": {"name": row.name, "offload": row.offload, "world_size": world, "evidence": ev},
        "precision": {"policy": policy, "observed_compute_dtype": compute},
        "batch": {"effective": 8},
        "lr": {"applied": 1e-3},
        "config": {"training": {"max_grad_norm": 1.0}},
        "steps": [
            {"step": i + 1, "loss": x, "grad_norm": 1.2, "trained_tokens": 56 + i, "input_tokens": 400 + i}
            for i, x in enumerate(losses)
        ],
        "summary": {"status": "completed"},
        "predicted_memory": {
            "error": {
                "device_allocated": None,
                "host": {"predicted_gib": 1.49, "measured_gib": 0.70, "relative_error": 1.13},
            }
        },
    }
