"""What a piece of code asks of an accelerator, counted on any device, the CPU included: operators that launch work,
reads back to the host, and passes through a model (docs/diagnostics.md#cost).

On a GPU each operator is at least one kernel launch (microseconds, however small its tensor), and each read back
(``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``) waits for every
queued kernel to finish, as does a tensor made from Python data on the device (``torch.tensor(x, device=...)``: a
blocking copy from pageable host memory): code that is quick on a CPU can be launch- or sync-bound there. Both are
counted at the operator level, where the package's own code asks the same of every device (inside an operator a
device's kernels may differ), so CPU tests can bound them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

# Operators that allocate or describe memory without computing anything (views are told by their schema).
NO_KERNEL = {"empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "_unsafe_view", "promote_types"}
# Operators that return a Python number.
SCALAR_READS = {"_local_scalar_dense", "equal"}
# Tensor methods that read a whole tensor back. (``.to("cpu")`` is not told apart from a move to the model's device
# when the model runs on the CPU, so it is not counted: the package reads back with these.)
READS = {"tolist", "numpy", "cpu"}


class DeviceWork:
    """Counts, while inside ``with work:`` (re-entered as often as needed; counts add up): ``kernels``, the
    operators that compute (not views or allocations); ``transfers``, the reads back to the host; ``uploads``, tensors
    made from Python data with a device named (``torch.tensor(x, device=...)``, whatever the device: a sync on a GPU);
    ``forwards``, the passes through ``backbone``'s blocks (its first block's calls); ``deferred``, copies to the
    host that do not wait (:func:`copy_to_host`: read later, after an event, not a read here). A tensor read back
    once (``.cpu()``) and what is computed from such tensors alone is host memory: neither a kernel nor a transfer
    afterwards."""

    def __init__(self, backbone=None):
        self.backbone = backbone
        self.kernels = self.transfers = self.forwards = self.uploads = self.deferred = 0
        self.host = WeakIdKeyDictionary()
        self._entered: list = []

    def on_host(self, tensors) -> bool:
        tensors = [t for t in tensors if isinstance(t, Tensor)]
        return bool(tensors) and all(t in self.host for t in tensors)

    def __enter__(self) -> DeviceWork:
        handle = None
        if self.backbone is not None:
            handle = self.backbone.blocks[0].register_forward_pre_hook(lambda *_: self._count_forward())
        modes = (_Reads(self), _Kernels(self))
        for mode in modes:
            mode.__enter__()
        self._entered.append((handle, modes))
        return self

    def __exit__(self, *exc) -> None:
        handle, modes = self._entered.pop()
        for mode in reversed(modes):
            mode.__exit__(*exc)
        if handle is not None:
            handle.remove()

    def _count_forward(self) -> None:
        self.forwards += 1

    def counts(self) -> dict[str, int]:
        return {"forwards": self.forwards, "kernels": self.kernels, "transfers": self.transfers}


class _Kernels(TorchDispatchMode):
    def __init__(self, work: DeviceWork):
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:  # an operator made of others (as ``one_hot`` reaches here under inference mode): count those
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        out = func(*args, **kwargs)
        inputs = tree_leaves((args, kwargs))
        if self.work.on_host(inputs):  # host memory in, host memory out
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.work.host[t] = True
        elif func.__name__.split(".")[0] in SCALAR_READS:
            self.work.transfers += 1
        elif not func.is_view and func.__name__.split(".")[0] not in NO_KERNEL:
            self.work.kernels += 1
        return out


class _Reads(TorchFunctionMode):
    def __init__(self, work: DeviceWork):
        super().__init__()
        self.work = work

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and kwargs.get("device") is not None:
            self.work.uploads += 1
        name = getattr(func, "__name__", "")
        tensor = args[0] if args and isinstance(args[0], Tensor) else None
        if func is copy_to_host:
            self.work.deferred += 1
            out = func(*args, **kwargs)
            out = out.clone() if out is tensor else out  # a copy, as from a GPU
            self.work.host[out] = True
            return out
        if name not in READS or tensor is None or tensor in self.work.host:
            return func(*args, **kwargs)
        self.work.transfers += 1
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            out = out.clone() if out is tensor else out  # a copy, as from a GPU: the device tensor stays one
            self.work.host[out] = True
        return out


def copy_to_host(tensor: Tensor) -> Tensor:
    """``tensor`` copied to host memory without waiting for it (from a GPU: pinned memory, ordered on the current
    stream): read it after an event recorded behind the copy. ``DeviceWork`` counts it as ``deferred``, not as a
    read (a move to the CPU by ``.to`` is not told apart from the batch's move to a CPU model)."""
    if torch.overrides.has_torch_function((tensor,)) or torch._C._is_torch_function_mode_enabled():
        return torch.overrides.handle_torch_function(copy_to_host, (tensor,), tensor)
    return tensor.to("cpu", non_blocking=True)


class ReadLater:
    """A device tensor read back one step later: copied to the host without waiting (:func:`copy_to_host`) as one
    step ends, read as the next one ends, when the copy is long done. Reading it at once would wait for every kernel
    queued before it, leaving the device idle while the host works between steps (its cost: docs/speed.md, host
    syncs)."""

    def __init__(self):
        self._pending: tuple | None = None

    def put(self, tensor: Tensor, *payload) -> None:
        done = torch.cuda.Event() if tensor.is_cuda else None
        host = copy_to_host(tensor)
        if done is not None:
            done.record()
        self._pending = (host, done, payload)

    def take(self) -> tuple[Tensor, tuple] | None:
        """(the tensor in host memory, what was put with it), or None if nothing was put since the last take."""
        if self._pending is None:
            return None
        host, done, payload = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        return host, payload
