"""The peak memory of one evaluation forward: on CUDA ``max_memory_allocated``; on CPU the peak RSS of a fresh
spawned process that runs it (so one encoding's allocations cannot hide another's)."""

from __future__ import annotations

import multiprocessing as mp

import torch

from ..models import BackboneConfig, build_backbone
from ..timing import synchronize
from .peer_models import build_peer
from .steps import eval_forward, peer_eval_forward


def out_of_memory(err: Exception) -> bool:
    return (isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
            or isinstance(err, MemoryError))


def _cpu_eval_peak(config_dict, t, threads, out, peer=None):
    """Runs in a fresh process: peak RSS of one evaluation forward (of the backbone, or of the peer named), in MiB."""
    torch.set_num_threads(threads)
    config = BackboneConfig.from_dict(config_dict)
    if peer is None:
        eval_forward(build_backbone(config).eval(), t, torch.device("cpu"), torch.float32)()
    else:
        peer_eval_forward(build_peer(peer, config).eval(), config.vocab_size, t, torch.device("cpu"), torch.float32)()
    out.put(peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss across
    fork+exec, so a spawned child would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (peak memory needs Linux)")


def eval_peak_mib(model, t, device, dtype, peer=None):
    """The peak memory of one evaluation forward at length t (``peer``: ``model`` is the peer of that name, whose
    ``config`` is the backbone config it was built at)."""
    if device.type == "cuda":
        forward = (eval_forward(model, t, device, dtype) if peer is None
                   else peer_eval_forward(model, model.config.vocab_size, t, device, dtype))
        torch.cuda.reset_peak_memory_stats()
        forward()
        synchronize(device)
        return torch.cuda.max_memory_allocated() / 2**20
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_cpu_eval_peak, args=(model.config.to_dict(), t, torch.get_num_threads(), queue, peer))
    proc.start()
    peak = queue.get()
    proc.join()
    return peak
