"""A CPU stand-in for engine.cuda_graphs.CudaGraph that checks some of what a real capture needs (test-only).

A real torch.cuda.graph records the kernels of one call and replays them without Python, so:
- an op that needs the host to wait for the device fails the capture ("operation not permitted when stream is
  capturing"): a Python value read from a tensor (`.item()`, `.tolist()`, `bool(t)`, `int(t)`), an output whose
  size depends on tensor data (`nonzero`, `unique`, `masked_select`, boolean-mask indexing, `bincount`,
  `repeat_interleave` without output_size), a comparison that returns a bool (`equal`, `allclose`), a copy to the
  host (`.cpu()`, `.numpy()`), or host data made into a tensor (`torch.tensor([...])`: a host-to-device copy);
- what a replay does is fixed at capture: the same kernels, shapes and scalar arguments, reading and writing the
  same buffers.

SyncCheckedGraph runs the function at capture and at every replay under NoHostSync (both in inference mode, so
composite ops decompose alike), which raises HostSyncError on those ops (all tensors are on the CPU here, so it
tells a sync by the op, not by the devices involved; 0-d host scalars pass: CUDA ops take them as arguments), and
records a trace of each run: every aten op and Triton launch with its shapes, dtypes and scalar arguments, and the
storage of every tensor it reads that the run did not make itself (the static buffers, weights, KV cache). A replay
whose trace differs from the capture's raises GraphReplayMismatch: a real graph would have replayed the captured one.
A replay copies its result into the captured output tensor and returns that tensor, as a real graph does.

What it cannot see: a device-to-host copy spelled `.to("cpu")` or `.to(device)` (on the CPU it cannot be told
from a copy to the model's own device), stream or event calls, allocator behaviour, anything inside a Triton
kernel (a launch is one recorded op). A kernel's operator (torch.ops.llmw.*, kernels/_library.py) is recorded,
then its implementation runs under the same checks, so the launcher's own ops and launches are seen too."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels._library import IMPLS, NAMESPACE

aten = torch.ops.aten

# data-dependent output sizes or a Python value: on CUDA each waits for the device. Both spellings of each: in
# inference mode the composite op is dispatched (aten.item), outside it its decomposition (_local_scalar_dense)
_VALUE = "reads a Python value from a tensor (.item(), int(t), float(t), bool(t), if t: ...)"
_SIZE = "its output size depends on the data"
_SYNC_OPS = {
    aten._local_scalar_dense.default: _VALUE,
    aten.item.default: _VALUE,
    aten.is_nonzero.default: _VALUE,
    aten.nonzero.default: "nonzero: " + _SIZE,
    aten.argwhere.default: "argwhere: " + _SIZE,
    aten.where.default: "where(cond): " + _SIZE,
    aten.masked_select.default: "masked_select: " + _SIZE,
    aten.equal.default: "torch.equal returns a Python bool",
    aten.allclose.default: "torch.allclose returns a Python bool",
    aten.bincount.default: "bincount sizes its output from the data's max",
}
_SYNC_PACKETS = {
    aten._unique2: "unique: " + _SIZE,
    aten._unique: "unique: " + _SIZE,
    aten.unique_dim: "unique: " + _SIZE,
    aten.unique_consecutive: "unique_consecutive: " + _SIZE,
}
# Tensor methods that read device memory on the host without dispatching an aten op on a CPU tensor
_HOST_READS = ("tolist", "cpu", "numpy", "__array__")


class HostSyncError(RuntimeError):
    """An op inside a captured function that would make the host wait for the device (fails a real capture)."""


class GraphReplayMismatch(AssertionError):
    """A replay ran other ops, shapes, scalars or buffers than the capture: a real graph would not have."""


_tls = threading.local()  # .checking: inside NoHostSync on this thread, outside a Triton launch


def _checking() -> bool:
    return getattr(_tls, "checking", False)


def _tensor_key(t: torch.Tensor, made: set[int]) -> tuple:
    ptr = t.untyped_storage().data_ptr()
    # a buffer from outside the run is named by its storage; one the run made is named by its shape only
    return ("T", tuple(t.shape), t.dtype, t.stride(), t.storage_offset(), None if ptr in made else ptr)


def _key(x, made: set[int]):
    if isinstance(x, torch.Tensor):
        return _tensor_key(x, made)
    if isinstance(x, (list, tuple)):
        return tuple(_key(y, made) for y in x)
    if isinstance(x, dict):
        return tuple((k, _key(v, made)) for k, v in x.items())
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else type(x).__name__


def _outputs(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _outputs(o)


class NoHostSync(TorchDispatchMode):
    """Raises HostSyncError on the ops listed in the module doc; records the run's trace in `.trace`."""

    def __init__(self):
        super().__init__()
        self.trace: list[tuple] = []
        self.made: set[int] = set()  # storages the run allocated (its intermediates)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _checking():
            self._check(func, args, kwargs)
            self.trace.append((str(func), _key(args, self.made), _key(kwargs, self.made)))
        if func.namespace == NAMESPACE:  # a kernel's operator: its implementation runs here, its own ops checked too
            TorchDispatchMode.__enter__(self)  # back on the mode stack, the trace and the made storages kept
            try:
                out = IMPLS[func._opname](*args, **kwargs)
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        else:
            out = func(*args, **kwargs)
        if _checking():
            for o in _outputs(out):
                if o.untyped_storage().data_ptr() not in {a.untyped_storage().data_ptr() for a in _outputs(args)}:
                    self.made.add(o.untyped_storage().data_ptr())
        return out

    @staticmethod
    def _check(func, args, kwargs) -> None:
        why = _SYNC_OPS.get(func) or _SYNC_PACKETS.get(func.overloadpacket)
        if func.overloadpacket is aten.repeat_interleave:
            bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            if isinstance(bound.get("repeats"), torch.Tensor) and bound.get("output_size") is None:
                why = "repeat_interleave with tensor repeats and no output_size: " + _SIZE
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx or ()):
                why = "indexing with a boolean mask: its size depends on the data (a nonzero inside)"
        if func is aten.lift_fresh.default and args[0].dim() > 0:
            why = "torch.tensor(host data): a host-to-device copy inside the graph, its value frozen at capture"
        if why:
            raise HostSyncError(f"{func}: {why}")

    def __enter__(self):
        self.trace.clear()
        self.made.clear()
        _install()
        self._prev = _checking()
        _tls.checking = True
        return super().__enter__()

    def __exit__(self, *exc):
        _tls.checking = self._prev
        _uninstall()
        return super().__exit__(*exc)

    def record_launch(self, fn, grid, args, kwargs) -> None:
        name = getattr(fn, "__name__", repr(fn))
        self.trace.append(("triton:" + name, _key(grid, self.made), _key(args, self.made), _key(kwargs, self.made)))


# ---- process-wide patches, active only while some thread is inside NoHostSync ----------------------------------
_lock = threading.Lock()
_users = 0
_saved: dict = {}


def _host_read(name, orig):
    def method(self, *a, **kw):
        if _checking():
            raise HostSyncError(f"Tensor.{name}(): reads device memory on the host")
        return orig(self, *a, **kw)

    return method


def _launch(orig):
    """A Triton launch under the interpreter is one device op: record it, and do not check the host-side copies
    the interpreter makes to run it."""

    def call(self, *args, **kwargs):
        mode = getattr(_tls, "mode", None)
        if not _checking() or mode is None:
            return orig(self, *args, **kwargs)
        mode.record_launch(self.fn, self.grid, args, kwargs)
        _tls.checking = False
        try:
            return orig(self, *args, **kwargs)
        finally:
            _tls.checking = True

    return call


def _install() -> None:
    global _users
    from triton.runtime import interpreter

    with _lock:
        _users += 1
        if _users > 1:
            return
        for name in _HOST_READS:
            _saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _host_read(name, getattr(torch.Tensor, name)))
        _saved[(interpreter.GridExecutor, "__call__")] = interpreter.GridExecutor.__call__
        interpreter.GridExecutor.__call__ = _launch(interpreter.GridExecutor.__call__)


def _uninstall() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for (owner, name), orig in _saved.items():
                setattr(owner, name, orig)
            _saved.clear()


@contextlib.contextmanager
def no_host_sync():
    """Run a block as a captured graph would need it: no host syncs (raises HostSyncError); yields the mode, whose
    .trace is the block's ops."""
    mode = NoHostSync()
    prev = getattr(_tls, "mode", None)
    _tls.mode = mode
    try:
        with mode:
            yield mode
    finally:
        _tls.mode = prev


class SyncCheckedGraph:
    """engine.cuda_graphs.CudaGraph's interface on CPU: capture(fn) runs fn under no_host_sync and keeps its trace
    and output; replay() runs fn again under it, checks the trace equals the capture's, copies the result into the
    captured output and returns that."""

    errors: list[Exception] = []  # every capture that raised; the engine logs them and stays eager

    def capture(self, fn) -> torch.Tensor:
        self.fn = fn
        try:  # both runs in inference mode: outside it, composite ops decompose otherwise (linear -> t + mm)
            with torch.inference_mode(), no_host_sync() as mode:
                self.out = fn()
        except Exception as e:
            SyncCheckedGraph.errors.append(e)
            raise
        self.trace = list(mode.trace)
        return self.out

    def replay(self) -> torch.Tensor:
        with torch.inference_mode(), no_host_sync() as mode:
            out = self.fn()
        if mode.trace != self.trace:
            i = next((i for i, (a, b) in enumerate(zip(mode.trace, self.trace)) if a != b), len(self.trace))
            got = mode.trace[i] if i < len(mode.trace) else "<end>"
            want = self.trace[i] if i < len(self.trace) else "<end>"
            raise GraphReplayMismatch(f"replay differs from the capture at op {i}: {got} != {want}")
        with torch.inference_mode():
            return self.out.copy_(out)
