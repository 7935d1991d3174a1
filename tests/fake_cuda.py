"""The engine's CUDA code path, run on a CPU-only machine under torch's FakeTensorMode on device cuda:0 (test-only).

Fake tensors carry shapes, dtypes and devices but no data, so the CUDA path runs as written: `t.is_cuda` is true,
the planner reads the simulated GPU's numbers, and each Triton kernel passes through its operator's fake
implementation (kernels/_library.py). What a GPU would refuse, this refuses too:

- a CPU tensor mixed into a CUDA op raises FakeTensorDeviceMismatchError (on a GPU: an error, or a silent copy);
- an op whose output size depends on tensor data (`nonzero`, boolean-mask indexing, `unique`) raises
  DynamicOutputShapeException: on a GPU the host would wait for the stream to learn the size.

A read of a device value on the host (`.tolist()`, `.item()`, `bool(t)`, `int(t)`, `.cpu()`, a copy to the
host) cannot return data here; `HostSyncs` counts each one by kind and returns made-up values of the right shape
(zeros: token id 0, logprob 0.0) so the step goes on. A test asserts the counts, so a new sync fails CI.

Three things torch's CPU build lacks are supplied for the duration:
- a CUDA device guard. Python methods that take one (indexing, `copy_`, `.to`) ask c10's registry for CUDA's,
  and a CPU build registers none (`torch._C._ensureCUDADeviceGuardSet` fills the slot only on a CUDA build without
  a device), so CUDA's slot is pointed at the CPU's no-op guard (libc10's exported registry, through ctypes). A
  device named without an index would resolve to the CPU through it: the engine runs on "cuda:0";
- pinned host memory: `pin_memory=True` is dropped, and HostSyncs remembers what was pinned;
- torch.cuda's queries, answered from a SimulatedGPU; streams and events do nothing.

It cannot see what happens inside a kernel, the allocator, or a stream's ordering; CUDA graphs are not captured
(the stand-in graph of tests/graph_standin.py covers their rules)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import weakref
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

DEVICE = torch.device("cuda", 0)
_T = torch._C.TensorBase  # the methods a TorchFunctionMode sees are its descriptors
_CPU, _CUDA = 0, 1  # c10::DeviceType values: the registry's slots


@dataclass(frozen=True)
class SimulatedGPU:
    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)
    total: int = 80 * 2**30
    free: int = 79 * 2**30  # the CUDA context's share already gone
    sms: int = 132
    max_shared: int = 227 * 1024  # per block, opted in


def _install_cuda_guard() -> None:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    reg = ctypes.c_void_p.in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")  # std::array<atomic<ptr>, N>
    slots = (ctypes.c_void_p * 2).from_address(ctypes.addressof(reg))
    assert slots[_CPU], "c10's CPU device guard is not registered: this torch build is not what the harness knows"
    if not slots[_CUDA]:
        slots[_CUDA] = slots[_CPU]


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def wait(self, *args):
        pass

    def query(self) -> bool:
        return True


class _Stream(_Event):
    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass


def _cuda_patches(gpu: SimulatedGPU) -> dict:
    props = SimpleNamespace(
        name=gpu.name, major=gpu.capability[0], minor=gpu.capability[1], total_memory=gpu.total,
        multi_processor_count=gpu.sms, shared_memory_per_block_optin=gpu.max_shared,
    )  # fmt: skip
    return dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=lambda d: None,
        get_device_properties=lambda d=None: props,
        get_device_capability=lambda d=None: gpu.capability,
        mem_get_info=lambda d=None: (gpu.free, gpu.total),
        empty_cache=lambda: None,
        synchronize=lambda d=None: None,
        Event=_Event,
        Stream=_Stream,
        current_stream=lambda d=None: _Stream(),
        stream=lambda s: contextlib.nullcontext(),
    )


# a Python value read from a tensor: on CUDA each waits for the stream. By name: FakeTensor defines its own tolist
_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}


def _made_up(t: torch.Tensor):
    """Zeros of t's shape as Python values (what .tolist() / .item() would give)."""
    zero = False if t.dtype == torch.bool else (0.0 if t.dtype.is_floating_point else 0)
    out = zero
    for n in reversed(t.shape):
        out = [out] * n  # rows may share one inner list: nothing writes into made-up values
    return out


class HostSyncs(TorchFunctionMode):
    """Counts in `counts` each point where the host would wait for the device (see the module doc):
    - "tolist", "item", "bool", "int", "float", "index", "numpy": a Python value read from a CUDA tensor;
    - "d2h": a copy of a CUDA tensor to the host (`.cpu()`, `.to("cpu")`, `host.copy_(dev)`);
    - "h2d": a host-to-device copy that waits (CUDA's rule: from pageable memory, or without non_blocking);
      `torch.tensor(data, device="cuda")` is one, and so is indexing a CUDA tensor with a Python list. From pinned
      memory with non_blocking=True it does not.
    A value read from a host tensor made from device data is made up and not counted again. Pinned memory is
    remembered here (this build cannot pin): tensors made with pin_memory=True, and views of them."""

    def __init__(self, fake: FakeTensorMode):
        super().__init__()
        self.fake = fake
        self.counts: Counter = Counter()
        self._pinned = weakref.WeakValueDictionary()  # id -> tensor (a WeakSet would compare tensors with ==)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS and args and isinstance(args[0], FakeTensor):
            return self.read(args[0], name)
        if func is _T.pin_memory:
            self._pinned[id(args[0])] = args[0]
            return args[0]
        pin = kwargs.pop("pin_memory", False)
        if func is torch.tensor:  # made outside the fake mode: a fake one would carry its data and try to copy it
            dev = kwargs.pop("device", None)
            with unset_fake_temporarily():
                out = self.fake.from_tensor(func(*args, **kwargs))
            if dev is not None and torch.device(dev).type == "cuda":
                self.counts["h2d"] += 1  # pageable memory
                out = out.to(dev)
        else:
            if func in (_T.__getitem__, _T.__setitem__) and args[0].is_cuda and _has_list(args[1]):
                args = (args[0], self._device_index(args[1], args[0].device), *args[2:])
            self._count_copy(func, args, kwargs)
            out = func(*args, **kwargs)
        if pin:
            self._pinned[id(out)] = out
        return out

    def read(self, t: FakeTensor, name: str):
        """`name` ("tolist", "item", "__bool__", ...) of fake tensor t: counted when t is on the device, and made up."""
        if t.is_cuda:
            self.counts[name.strip("_")] += 1
        value = _made_up(t)
        return value if name == "tolist" or t.dim() else _scalar(value, name)

    def _device_index(self, index, dev: torch.device):
        """A list index as the device tensor CUDA builds from it on the host, with a waiting copy (made here: a fake
        tensor built from a list would carry its data and try to copy it for real)."""
        if isinstance(index, tuple):
            return tuple(self._device_index(i, dev) if isinstance(i, list) else i for i in index)
        self.counts["h2d"] += 1
        with unset_fake_temporarily():
            host = self.fake.from_tensor(torch.tensor(index))
        return host.to(dev)

    def _count_copy(self, func, args, kwargs) -> None:
        if func is _T.copy_:
            dst, src = args[0], args[1]
            dst_dev, non_blocking = dst.device, kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        elif func in (_T.to, _T.cpu, _T.cuda):
            dst, src, dst_dev = None, args[0], _target(func, args, kwargs)  # a new tensor: never pinned memory
            non_blocking = kwargs.get("non_blocking", any(a is True for a in args[1:]))
        else:
            return
        if dst_dev is None or not isinstance(src, torch.Tensor) or src.device.type == dst_dev.type:
            return
        if dst_dev.type == "cuda":  # host to device
            if not (non_blocking and self._is_pinned(src)):
                self.counts["h2d"] += 1
        elif not (non_blocking and dst is not None and self._is_pinned(dst)):
            self.counts["d2h"] += 1

    def _is_pinned(self, t: torch.Tensor) -> bool:
        return any(x is not None and self._pinned.get(id(x)) is x for x in (t, t._base))


def _has_list(index) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def _target(func, args, kwargs) -> torch.device | None:
    if func is _T.cpu:
        return torch.device("cpu")
    if func is _T.cuda:
        return DEVICE
    dev = kwargs.get("device")
    if dev is None:
        dev = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
        if dev is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dev = args[1].device  # .to(other): other's device and dtype
    return None if dev is None else torch.device(dev)


def _scalar(value, name: str):
    cast = {"__bool__": bool, "__float__": float, "__int__": int, "__index__": int}.get(name)
    return cast(value) if cast else value


@contextlib.contextmanager
def fake_cuda(gpu: SimulatedGPU = SimulatedGPU()):
    """Within the block: CUDA tensors are fake, torch.cuda answers for `gpu`, and the yielded HostSyncs counts the
    host's reads of device data."""
    _install_cuda_guard()
    with (
        mock.patch.multiple(torch.cuda, **_cuda_patches(gpu)),
        FakeTensorMode(allow_non_fake_inputs=True) as fake,
        HostSyncs(fake) as syncs,
        # FakeTensor defines tolist in Python (element by element through .item()): a torch function mode never sees it
        mock.patch.object(FakeTensor, "tolist", lambda t: syncs.read(t, "tolist")),
    ):
        yield syncs
