"""The peak FLOP/s that MFU divides by (cable_lightning/hardware.py): the datasheet table matched on each GPU's name,
the measured fallback for a GPU it lacks, and the fit's throughput callback on an H200 (no GPU needed: the device name
is monkeypatched)."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from cable_lightning import hardware, timing
from cable_lightning.callbacks.throughput import TokenThroughput

CUDA = torch.device("cuda")  # a device object needs no GPU

# torch.cuda.get_device_name() of each listed GPU -> its dense bf16 peak (half the datasheets' 2:4-sparse figure
# where they print only that one).
NAMES = {
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989.5e12, "NVIDIA H100 PCIe": 756.5e12, "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.5e12, "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA L4": 121e12, "NVIDIA L40S": 362.05e12, "NVIDIA B200": 2.25e15,
}


@pytest.fixture
def gpu_named(monkeypatch):
    def name(value):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: value)

    return name


@pytest.fixture
def measured(monkeypatch):
    """Records the measured fallback's calls instead of running a matmul on a GPU."""
    calls = []

    def fake(dtype, device=torch.device("cpu"), repeats=20):
        calls.append((dtype, device))
        return 123e12

    monkeypatch.setattr(hardware, "measured_matmul_peak", fake)
    return calls


@pytest.mark.parametrize("name", NAMES)
def test_each_listed_gpu_gets_its_datasheet_peak(name, gpu_named, measured):
    gpu_named(name)
    peak, source = hardware.peak_flops(CUDA)
    assert peak == pytest.approx(NAMES[name], rel=1e-9)
    assert source.startswith(f"datasheet dense bf16 peak of {name} as ") and "datasheet" in source.split(" (")[1]
    assert measured == []


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090",
                                  "Tesla V100-SXM2-16GB"])
def test_a_gpu_the_table_lacks_gets_a_measured_bf16_matmul_and_says_so(name, gpu_named, measured):
    """Names that contain a listed one ("L40" holds "L4", "GH200" holds "H200") are not taken for it."""
    gpu_named(name)
    peak, source = hardware.peak_flops(CUDA, torch.float32)
    assert peak == 123e12 and measured == [(torch.bfloat16, CUDA)]
    assert "measured in this process" in source and name in source and "datasheet" not in source


def test_every_table_row_is_reachable_and_names_its_source():
    for gpu, _, flops, source in hardware.DENSE_BF16_PEAKS:
        assert source.startswith("NVIDIA ") and "datasheet" in source and 1e14 < flops < 1e16, gpu
    assert {row[0] for row in hardware.DENSE_BF16_PEAKS} == {
        "A100", "H100 NVL", "H100 PCIe", "H100 SXM", "H200 NVL", "H200 SXM", "L40S", "L4", "B200"}


def test_the_fits_mfu_on_an_h200_divides_by_the_tables_peak(gpu_named, measured, capsys):
    """Lightning's own table has no "NVIDIA H200" entry (the fit logged no MFU there); the callback's setup puts the
    project's peak on its Throughput, so device/mfu is the FLOP rate over 989.5 TFLOP/s."""
    gpu_named("NVIDIA H200")
    trainer = SimpleNamespace(precision_plugin=MixedPrecision("bf16-mixed", "cuda"), world_size=1,
                              strategy=SimpleNamespace(root_device=CUDA), is_global_zero=True)
    monitor = TokenThroughput(window_size=2)
    monitor.setup(trainer, None, "fit")
    assert monitor.available_flops == 989.5e12 and measured == []
    throughput = monitor.throughput
    for step in (1, 2):
        throughput.update(time=float(step), batches=step, samples=step, flops=100e12)  # 100 TFLOP in each 1 s step
    assert throughput.compute()["device/mfu"] == pytest.approx(100e12 / 989.5e12)
    assert "MFU against datasheet dense bf16 peak of NVIDIA H200 as H200 SXM" in capsys.readouterr().out


def test_the_cpu_peaks_are_measured_in_fp32_and_bf16(measured):
    """bench prints both and divides MFU by the run's dtype's (tests/test_bench.py)."""
    assert hardware.cpu_matmul_peaks() == {"fp32": 123e12, "bf16": 123e12}
    assert measured == [(torch.float32, torch.device("cpu")), (torch.bfloat16, torch.device("cpu"))]


def test_the_cpu_bf16_slowdown_is_bf16s_matmul_time_over_fp32s_on_one_thread(monkeypatch):
    """A fake clock advanced by each matmul: 1 s in fp32, 40 s in bf16; the process's threads come back after."""
    now = [0.0]

    def matmul(a, b):
        assert torch.get_num_threads() == 1
        now[0] += 40.0 if a.dtype == torch.bfloat16 else 1.0

    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert hardware.cpu_bf16_slowdown() == 40.0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_bf16_run_on_a_cpu_whose_bf16_matmul_is_slow_is_told_so_in_one_line(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "cpu_bf16_slowdown", lambda: 40.0)
    line = hardware.slow_cpu_bf16("bf16-mixed", cpu)
    assert "\n" not in line and "precision bf16-mixed" in line and "takes 40x an fp32 one" in line
    assert "--trainer.precision 32-true" in line
    monkeypatch.setattr(hardware, "cpu_bf16_slowdown", lambda: 0.5)  # AVX512-BF16 or AMX: bf16 pays
    assert hardware.slow_cpu_bf16("bf16-mixed", cpu) is None

    def unmeasured():
        raise AssertionError("measured for a run that is not bf16 on a CPU")

    monkeypatch.setattr(hardware, "cpu_bf16_slowdown", unmeasured)
    assert hardware.slow_cpu_bf16("32-true", cpu) is None and hardware.slow_cpu_bf16("bf16-mixed", CUDA) is None


def test_a_cpu_record_names_the_vector_instructions_torch_uses(monkeypatch):
    """Two CPUs a VM names alike ("AMD EPYC"), one with AVX512-BF16 and one without, train bf16 at rates tens of
    times apart: their throughput records name different machines."""
    names = set()
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda value=capability: value)
        name = hardware.device_name(torch.device("cpu"))
        assert name.startswith("cpu: ") and name.endswith(f" ({capability})")
        names.add(name)
    assert len(names) == 2
