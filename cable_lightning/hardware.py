"""The peak FLOP/s that MFU divides by, for the bench and the fit's TensorBoard MFU.

On CUDA: the GPU's datasheet dense bf16 tensor-core peak from this project's table (Lightning's has no "NVIDIA H200"
entry and lists the 2:4-sparse figure for H200 and H100 NVL); a GPU the table lacks gets a bf16 matmul measured in
this process, and the source string says so. On CPU: always measured (no datasheet figure a CPU's threads reach).
"""

from __future__ import annotations

import platform
import re

import torch

from .timing import interleaved, synced_time

# (GPU, pattern its lower-cased torch.cuda.get_device_name() matches, dense bf16 FLOP/s, source). The first row that
# matches wins, so a variant precedes its family ("nvidia h100 nvl" before "nvidia h100 80gb hbm3"). NVIDIA's
# datasheets print most tensor-core figures with 2:4 sparsity (marked "*"); the dense figure is half of it.
DENSE_BF16_PEAKS = (
    ("A100", r"\ba100\b", 312e12, "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense (SXM and PCIe)"),
    ("H100 NVL", r"\bh100\b.*\bnvl\b", 1671e12 / 2, "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,671 TFLOPS*"),
    ("H100 PCIe", r"\bh100\b.*\b(pcie|hbm2e)\b", 1513e12 / 2,
     "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,513 TFLOPS*"),
    ("H100 SXM", r"\bh100\b", 1979e12 / 2, "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS*"),
    ("H200 NVL", r"\bh200\b.*\bnvl\b", 1671e12 / 2, "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,671 TFLOPS*"),
    ("H200 SXM", r"\bh200\b", 1979e12 / 2, "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS*"),
    ("L40S", r"\bl40s\b", 362.05e12, "NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733* with sparsity)"),
    ("L4", r"\bl4\b", 242e12 / 2, "NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS*"),
    ("B200", r"\bb200\b", 4.5e15 / 2, "NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 4.5 PFLOPS*"),
)


def measured_matmul_peak(dtype, device: torch.device = torch.device("cpu"), repeats: int = 20) -> float:
    """FLOP/s of the fastest of ``repeats`` square matmuls in ``dtype`` on ``device`` (1024 wide on CPU, 8192 on a
    GPU, where smaller ones do not fill the tensor cores)."""
    size = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = synced_time(device)
        a @ b
        best = min(best, synced_time(device) - start)
    return 2 * size**3 / best


# The dtypes a CPU's matmul peak is measured in, by the names bench's --dtype takes.
CPU_PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_matmul_peaks(repeats: int = 20) -> dict[str, float]:
    """This CPU's 1024 x 1024 matmul FLOP/s with this process's threads, in fp32 and in bf16 (keys of
    :data:`CPU_PEAK_DTYPES`): what each precision can reach here (a CPU with AVX512-BF16 or AMX runs bf16 about twice
    as fast as fp32; one without runs it slower)."""
    return {name: measured_matmul_peak(dtype, torch.device("cpu"), repeats) for name, dtype in CPU_PEAK_DTYPES.items()}


# A bf16 run on a CPU whose bf16 matmul takes this many times its fp32 one is told so before it starts.
SLOW_CPU_BF16 = 1.5


def cpu_bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """How many times an fp32 matmul's time a bf16 one takes on one thread of this CPU (below 1: bf16 pays), timed in
    turns. One thread, since on a shared machine a thread pool's stragglers move a sub-millisecond matmul by tens of
    times. Well under a second even where bf16 falls to a slow kernel."""
    pairs = [[torch.randn(size, size, dtype=dtype) for _ in range(2)] for dtype in (torch.float32, torch.bfloat16)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32_s, bf16_s = interleaved([lambda a=a, b=b: a @ b for a, b in pairs], torch.device("cpu"), repeats)
    finally:
        torch.set_num_threads(threads)
    return bf16_s / fp32_s


def slow_cpu_bf16(precision, device: torch.device) -> str | None:
    """The one line a bf16 run on a CPU without bf16 matmul instructions (AVX512-BF16, AMX) is told before it starts,
    or None: there a bf16 matmul falls to a kernel tens of times slower than fp32's, and an hour's fit takes a day."""
    if device.type != "cpu" or not str(precision).startswith("bf16"):
        return None
    slowdown = cpu_bf16_slowdown()
    if slowdown < SLOW_CPU_BF16:
        return None
    return (f"precision {precision} on this CPU (torch's capability: {torch.backends.cpu.get_cpu_capability()}): a "
            f"bf16 matmul takes {slowdown:.0f}x an fp32 one here (bf16 pays only with bf16 matmul instructions, such "
            f"as AVX512-BF16 or AMX), so this run takes many times its fp32 time; --trainer.precision 32-true is fast "
            f"here, but it is another recipe, whose records do not join bf16 ones")


def peak_flops(device: torch.device, dtype=torch.bfloat16) -> tuple[float, str]:
    """(FLOP/s, where it comes from) that MFU divides by: on CUDA the dense bf16 peak whatever ``dtype`` (one scale
    for every precision), on CPU a matmul in ``dtype``."""
    if device.type != "cuda":
        return measured_matmul_peak(dtype, device), f"{dtype} 1024x1024 matmul measured in this process"
    name = torch.cuda.get_device_name(device)
    for gpu, pattern, flops, source in DENSE_BF16_PEAKS:
        if re.search(pattern, name.lower()):
            return flops, f"datasheet dense bf16 peak of {name} as {gpu} ({source})"
    return (measured_matmul_peak(torch.bfloat16, device),
            f"torch.bfloat16 8192x8192 matmul measured in this process ({name} is not in cable_lightning/hardware.py)")


def device_name(device: torch.device) -> str:
    """The machine a record was measured on: a GPU's name (``NVIDIA H100 80GB HBM3``), or the CPU's model as the
    system names it and the vector instructions torch's kernels use there (``cpu: AMD EPYC 7B13 (AVX512)``): a VM
    may name two CPUs alike whose bf16 steps differ by tens of times."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:  # not Linux
        pass
    model = model or platform.processor() or platform.machine() or "unknown"
    return f"{device.type}: {model} ({torch.backends.cpu.get_cpu_capability()})"
