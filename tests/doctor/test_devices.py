"""finetune/doctor/devices.py on made-up machines (tests/doctor/fakes.py): GPU facts, peer access,
link types and the expected link figure. Expected figures are worked out here from NCCL's tables
(src/graph/topo.h per-NVLink GB/s by compute capability; topo.cc PCIe 100 Mbit/s per lane / 80)."""

from __future__ import annotations

import sys

from finetune.doctor import devices
from tests.doctor.fakes import FakeCuda, FakeNvml, fake_torch, gpu, nvswitch_h100s


def probe(gpus, nvml="absent", tmp_path=None, **cuda_kwargs):
    nvml_obj = (
        FakeNvml(gpus, **(nvml if isinstance(nvml, dict) else {}))
        if nvml != "absent"
        else "NVML not available: pip install nvidia-ml-py for link types and figures"
    )
    return devices.probe(
        cuda=FakeCuda(gpus, **cuda_kwargs),
        nvml=nvml_obj,
        torch_module=fake_torch(FakeCuda(gpus)),
        proc=tmp_path or devices.NVIDIA_PROC,
    )


def test_nvswitch_h100_pair_expects_18_links_at_nccls_sm90_figure():
    dev = probe(nvswitch_h100s(2), nvml={})
    assert [g.name for g in dev.gpus] == ["NVIDIA H100 80GB HBM3"] * 2 and dev.gpus[0].bf16
    assert dev.gpus[0].nvlinks == {"switch": 18} and dev.gpus[0].mig is False
    (pair,) = dev.pairs
    assert (pair.a, pair.b, pair.peer_access, pair.nvlinks) == (0, 1, True, 18)
    assert pair.link == "NVLink x18 (NVSwitch)"
    assert pair.expected_gbs == 370.8  # 18 links x 20.6 GB/s (SM90_NVLINK_BW)
    assert dev.expected_busbw()[0] == 370.8
    assert dev.nccl_version == "2.27.3" and dev.nccl_available


def test_direct_nvlinks_are_counted_per_peer_even_when_nvml_orders_gpus_differently():
    a = gpu(
        name="NVIDIA A100-SXM4-40GB",
        capability=(8, 0),
        uuid="a100-0",
        bus="00000000:07:00.0",
        nvlinks=[(0, "00000000:0F:00.0")] * 4,
    )
    b = gpu(
        name="NVIDIA A100-SXM4-40GB",
        capability=(8, 0),
        uuid="a100-1",
        bus="00000000:0F:00.0",
        nvlinks=[(0, "00000000:07:00.0")] * 4,
    )
    dev = probe([a, b], nvml={"order": [1, 0]})
    assert dev.gpus[0].nvlinks == {1: 4} and dev.gpus[1].nvlinks == {0: 4}
    assert dev.pairs[0].link == "NVLink x4" and dev.pairs[0].expected_gbs == 80.0  # 4 x 20.0 (SM80)


def test_pcie_pair_expects_lanes_times_ncclss_per_lane_rate():
    gpus = [
        gpu(name="NVIDIA L4", capability=(8, 9), uuid=f"l4-{i}", bus=f"00000000:{0x30 + i:02X}:00.0", pcie=(4, 16))
        for i in range(2)
    ]
    dev = probe(gpus, nvml={"topology": {(0, 1): 20}})
    (pair,) = dev.pairs
    assert pair.link == "PCIe Gen4 x16 (PXB)" and pair.nvlinks == 0
    assert pair.expected_gbs == 24.0  # 16 lanes x 120 (16 GT/s) / 80


def test_a_pair_across_cpu_sockets_has_no_figure_and_says_why():
    gpus = [gpu(uuid=f"g{i}", bus=f"00000000:{0x30 + i:02X}:00.0", pcie=(5, 16)) for i in range(2)]
    dev = probe(gpus, nvml={"topology": {(0, 1): 50}})
    assert dev.pairs[0].expected_gbs is None and "CPU interconnect" in dev.pairs[0].source
    assert dev.expected_busbw() == (
        None,
        "GPU 0-1: the path crosses the CPU interconnect, whose bandwidth NVML does not give",
    )


def test_without_nvml_links_and_figures_are_unknown_and_mig_comes_from_the_name():
    gpus = [gpu(name="NVIDIA A100-SXM4-40GB MIG 3g.20gb", capability=(8, 0), uuid="m0"), gpu(uuid="m1")]
    dev = probe(gpus)
    assert dev.nvml_note.startswith("NVML not available")
    assert dev.pairs[0].link == "unknown (NVML not available)" and dev.pairs[0].expected_gbs is None
    assert [g.mig for g in dev.gpus] == [True, None]


def test_an_sm_without_an_nccl_nvlink_figure_is_unknown_not_guessed():
    gpus = [
        gpu(
            capability=(12, 0),
            uuid=f"b{i}",
            bus=f"00000000:{0x40 + i:02X}:00.0",
            nvlinks=[(0, f"00000000:{0x41 - i:02X}:00.0")] * 2,
        )
        for i in range(2)
    ]
    pair = probe(gpus, nvml={}).pairs[0]
    assert (
        pair.link == "NVLink x2" and pair.expected_gbs is None and pair.source == "no NCCL per-link figure for sm_120"
    )


def test_mixed_links_give_no_collective_figure():
    dev = probe(nvswitch_h100s(2), nvml={})
    dev.pairs.append(devices.Pair(0, 2, True, 0, "PCIe Gen5 x16 (PIX)", 48.0, "lanes"))
    dev.gpus.append(dev.gpus[0])
    value, why = dev.expected_busbw()
    assert value is None and why.startswith("mixed links (NVLink, PCIe)")


def test_a_cuda_build_that_cannot_start_cuda_keeps_the_drivers_reason(tmp_path):
    torch = fake_torch(FakeCuda([gpu()], available=False, init_error="CUDA error 802: system not yet initialized"))
    dev = devices.probe(nvml="unused", torch_module=torch, proc=tmp_path / "absent")
    assert not dev.cuda_available and dev.gpus == [] and "error 802" in dev.cuda_error


def test_the_drivers_gpu_list_is_read_apart_from_torch(tmp_path):
    (tmp_path / "0000:3b:00.0").mkdir()
    dev = devices.probe(torch_module=fake_torch(cuda_build=None), proc=tmp_path)
    assert dev.cuda_build is None and dev.driver_gpus == 1 and dev.gpus == []


def test_pynvml_is_loaded_and_initialised_when_none_is_given(tmp_path, monkeypatch):
    gpus = nvswitch_h100s(2)
    module = FakeNvml(gpus)
    calls = []
    module.nvmlInit = lambda: calls.append("init")
    monkeypatch.setitem(sys.modules, "pynvml", module)
    dev = devices.probe(cuda=FakeCuda(gpus), torch_module=fake_torch(), proc=tmp_path / "absent")
    assert calls == ["init"] and dev.nvml_note is None and dev.pairs[0].expected_gbs == 370.8
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    dev = devices.probe(cuda=FakeCuda(gpus), torch_module=fake_torch(), proc=tmp_path / "absent")
    assert dev.nvml_note == "NVML not available: pip install nvidia-ml-py for link types and figures"


def test_an_active_nvlink_whose_other_end_is_not_named_makes_the_pair_unknown_not_pcie():
    gpus = nvswitch_h100s(2)
    gpus[1]["nvlinks"][0] = (0xFF, "garbage")  # NVML_NVLINK_DEVICE_TYPE_UNKNOWN
    dev = probe(gpus, nvml={})
    assert dev.gpus[1].nvlinks == {"switch": 17, "unresolved": 1}
    assert dev.pairs[0].expected_gbs is None and dev.pairs[0].link.startswith("unknown (an active NVLink")


def test_bus_ids_of_any_domain_width_match():
    assert devices.bus_id("00000000:3B:00.0") == devices.bus_id(b"0000:3b:00.0") == (0, 0x3B, 0, 0)
    assert devices.bus_id("garbage") is None
