"""Fake CUDA for a CPU-only torch: tensors on `cuda:0` that hold no data (torch._subclasses.fake_tensor).

Every op runs its shape/dtype/device rules, so a CPU tensor that meets a cuda one raises
FakeTensorDeviceMismatchError, and a host read (.item(), int(t), .tolist()) of a computed value raises
(DataDependentOutputException): the two defects a path can only show on a GPU.

Two gaps of torch 2.13's CPU build are bridged here, neither touches the math:
- Python indexing (`t[...]`, `t[...] = v`) opens a CUDA device guard in C++ before any dispatch and a CPU-only build
  has none ("not linked with support for cuda devices"). `IndexViaAten` (a TorchFunctionMode) rewrites the index
  into the same aten ops torch's own indexing code emits (select / slice / unsqueeze / index / index_put_), which
  fake tensors run.
  A few Tensor methods open the same guard in their Python binding (contiguous, copy_, to(cuda), cuda(), new_tensor,
  ~); they are routed to their aten op the same way. Host reads (item, tolist, int/float/bool/index of a tensor) go
  to aten._local_scalar_dense, which a fake tensor refuses (DataDependentOutputException): a host sync raises.
- `torch.Generator("cuda")` needs the CUDA library. `FakeCudaGenerators` (a context manager) makes the constructor
  return a CPU generator tagged with the device it was asked for, and the mode checks at every `generator=` use
  that the tag matches the device of the tensor made (what real CUDA checks: "Expected a 'cuda' device type for
  generator"). A generator made without device= is tagged cpu and fails there.
- torch.cuda.synchronize() (the timers' wait for the device) fails without a CUDA runtime: inside fake_cuda it is
  recorded like a host read (it is one: the host waits for the device). torch.distributed.broadcast asks
  torch.cuda.get_device_capability: answered (9, 0), an H100.
- autograd on fake cuda tensors aborts the process (its InputMetadata opens the guard): fake-cuda tests run under
  no_grad; the training step is traced on the `meta` device instead.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def _expand_index(t: torch.Tensor, index) -> tuple[torch.Tensor, list]:
    """Apply the basic part of `index` (ints, slices, None, Ellipsis) as views, exactly as torch's applySlicing
    does; return the view and the per-dimension list of tensor indices (None where a dim is kept whole)."""
    if not isinstance(index, tuple):
        index = (index,)
    n_used = sum(1 for i in index if i is not None and i is not Ellipsis and not isinstance(i, bool))
    n_used += sum(i.dim() - 1 for i in index if isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 1)
    out, dim, tensors = t, 0, []
    for i in index:
        if i is Ellipsis:
            skip = t.dim() - n_used
            dim += skip
            tensors += [None] * skip
        elif i is None:
            out = aten.unsqueeze.default(out, dim)
            dim += 1
            tensors.append(None)
        elif isinstance(i, bool):
            out = aten.unsqueeze.default(out, dim)
            if not i:
                out = aten.slice.Tensor(out, dim, 0, 0)
            dim += 1
            tensors.append(None)
        elif isinstance(i, int) or (isinstance(i, torch.SymInt)):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            start = 0 if i.start is None else i.start
            stop = (2 ** 63 - 1) if i.stop is None else i.stop
            out = aten.slice.Tensor(out, dim, start, stop, 1 if i.step is None else i.step)
            dim += 1
            tensors.append(None)
        else:
            idx = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=t.device, dtype=None if len(i) else torch.long)
            if idx.device != t.device and idx.dim() > 0:  # what torch raises for a cuda tensor indexed by a cpu one
                raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                                   f"({t.device}); got {idx.device}")
            if idx.dtype == torch.bool:
                tensors.append(idx)
                tensors += [None] * (idx.dim() - 1)  # placeholder so later dims line up
                dim += idx.dim()
            else:
                tensors.append(idx)
                dim += 1
    return out, tensors


class IndexViaAten(TorchFunctionMode):
    """Route Tensor.__getitem__ / __setitem__ and the guarded methods through aten ops (see the module docstring);
    everything else is untouched. `host_reads`: see fake_cuda."""

    def __init__(self, host_reads: list | None = None):
        super().__init__()
        self.host_reads = host_reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            t, index = args
            out, tensors = _expand_index(t, index)
            if any(x is not None for x in tensors):
                while tensors and tensors[-1] is None:
                    tensors.pop()
                out = aten.index.Tensor(out, tensors)
            elif out is t:
                out = aten.alias.default(t)
            return out
        if func is torch.Tensor.__setitem__:
            t, index, value = args
            view, tensors = _expand_index(t, index)
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=t.dtype, device=t.device)
            if any(x is not None for x in tensors):
                while tensors and tensors[-1] is None:
                    tensors.pop()
                aten.index_put_.default(view, tensors, value)
            else:
                aten.copy_.default(view, value.expand_as(view) if value.dim() else value)
            return None
        if func is torch.Tensor.contiguous:
            t = args[0]
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
            return t if t.is_contiguous(memory_format=fmt) else aten.clone.default(t, memory_format=fmt)
        if func is torch.Tensor.copy_:
            return aten.copy_.default(args[0], args[1], kwargs.get("non_blocking", False))
        if func is torch.Tensor.__invert__:
            return aten.bitwise_not.default(args[0])
        if func in (torch.Tensor.cuda, torch.Tensor.to):
            if func is torch.Tensor.cuda:
                device, dtype = torch.device("cuda"), None
            else:
                device, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
            if self.host_reads is not None and args[0].device.type == "cpu" and device is not None \
                    and torch.device(device).type == "cuda":  # a host tensor copied in: see torch.tensor below
                # a non-blocking copy (from pinned memory) does not wait for the stream: recorded apart
                self.host_reads.append((_caller(), "h2d:to-async" if func is torch.Tensor.to and non_blocking
                                        else "h2d:to"))
            return _to(args[0], device, dtype)
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cuda" and self.host_reads is not None \
                and not isinstance(args[0], torch.Tensor):
            # host data copied to the device: from pageable memory the copy waits for the stream, i.e. a sync
            # (recorded apart as "h2d:", not a read of a device value)
            self.host_reads.append((_caller(), "h2d:" + func.__name__))
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cuda" and torch.is_inference_mode_enabled():
            # a fake cuda constant cannot be made directly under inference_mode (the lift runs a CUDA empty_strided):
            # made on the CPU and copied, which is what the constructor does on a GPU
            cpu = func(*args, **{k: v for k, v in kwargs.items() if k != "device"})
            return aten._to_copy.default(cpu, device=torch.device("cuda", torch.device(kwargs["device"]).index or 0))
        if func is torch.Tensor.new_tensor:
            t, data = args[0], args[1]
            kw = {"dtype": t.dtype, "device": t.device, **kwargs}
            return torch.tensor(data, **kw)
        if func in HOST_READS:
            t = args[0]
            if t.device.type == "cuda":  # a device-to-host copy on a GPU: refused here (no data to read)
                if self.host_reads is None:
                    aten._local_scalar_dense.default(aten.sum.default(t))  # raises DataDependentOutputException
                self.host_reads.append((_caller(), func.__name__))
                return _answer(func, t)
            if self.host_reads is not None and isinstance(t, FakeTensor):  # host bookkeeping made inside the mode:
                return _answer(func, t)  # a CPU value, not a sync, but a fake one has no value either: 0 (not recorded)
            return func(*args, **kwargs)
        gen = kwargs.get("generator")
        if gen is not None:
            made = kwargs.get("device")
            made = torch.device(made) if made is not None else next(
                (a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            tag = _TAGS.get(id(gen), (None, gen.device))[1]
            if torch.device(tag).type != made.type:
                raise RuntimeError(f"Expected a '{made.type}' device type for generator but found '{torch.device(tag).type}'"
                                   f" ({func.__name__})")
        return func(*args, **kwargs)


HOST_READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__bool__, torch.Tensor.__index__)


def _answer(func, t: torch.Tensor):
    """What a recorded host read returns: 0 (True for bool, so loops go on; nested zero lists for tolist)."""
    if func is torch.Tensor.tolist:
        return 0 if t.dim() == 0 else _zeros_list(list(t.shape))
    return {"__bool__": True, "__float__": 0.0}.get(func.__name__, 0)


def _zeros_list(shape: list[int]):
    return [0] * shape[0] if len(shape) == 1 else [_zeros_list(shape[1:]) for _ in range(shape[0])]


def _caller() -> str:
    """path:function of the innermost snlp frame on the stack (the code that asked for the host read); for a read
    inside snlp/runtime (the timers' sync) the snlp frame that called it is added: "timing.py:sync <- loop"."""
    import sys

    f, found = sys._getframe(1), []
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/snlp/" in name and "/tests/" not in name:
            found.append("snlp/" + name.rsplit("/snlp/", 1)[1] + ":" + f.f_code.co_name)
            if "/snlp/runtime/" not in name:
                break
        f = f.f_back
    return (found[0] if len(found) == 1 else f"{found[0]} <- {found[-1]}") if found else "?"


def _to(t: torch.Tensor, device, dtype) -> torch.Tensor:
    device = t.device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype = t.dtype if dtype is None else dtype
    if device == t.device and dtype == t.dtype:
        return t
    return aten._to_copy.default(t, dtype=dtype, device=device)


_Generator = torch.Generator
_TAGS: dict[int, tuple] = {}  # id(generator) -> (generator, the device it was asked for)


class _TaggedGenerator:
    """Stands in for torch.Generator's constructor while FakeCudaGenerators is on."""

    def __new__(cls, device=None):
        dev = torch.device("cpu" if device is None else device)
        if dev.type == "meta" or dev.type == "cuda":
            g = _Generator()
            _TAGS[id(g)] = (g, dev)  # holds g, so its id stays unique while the tag lives
            return g
        return _Generator(dev)


@contextlib.contextmanager
def tagged_generators():
    """torch.Generator("cuda") / ("meta") -> a CPU generator tagged with that device (module docstring)."""
    saved = torch.Generator
    torch.Generator = _TaggedGenerator
    try:
        yield
    finally:
        torch.Generator = saved
        _TAGS.clear()


@contextlib.contextmanager
def fake_cuda(host_reads: list | None = None):
    """A FakeTensorMode with `cuda` tensors and the bridges above. Models: build on meta, then `to_cuda(model)`.
    A host read of a cuda value raises, unless `host_reads` is a list: then each read is recorded there as
    ("path/to/file.py:function", what) of the snlp frame that made it and answers 0 (False / True for a bool read:
    True, the answer that lets a loop go on; a stop test of a tolerance plan reads 0.0 and stops)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved = torch.cuda.synchronize

    def synchronize(device=None):  # a CPU-only build has no CUDA runtime to wait for: recorded as a host read
        if host_reads is None:
            raise RuntimeError("torch.cuda.synchronize() on a path that must not wait for the device")
        host_reads.append((_caller(), "torch.cuda.synchronize"))

    class Event:  # a CPU-only build's torch.cuda.Event cannot be made; recording waits for nothing
        """An event completes once the host has waited for the device after recording it (a recorded read or
        synchronize); elapsed_time refuses an event not completed, as CUDA does ("Both events must be completed")."""

        def __init__(self, enable_timing: bool = False):
            self.at = None

        def record(self, stream=None):
            self.at = len(host_reads) if host_reads is not None else None

        def done(self) -> bool:  # a wait came after the record (a non-blocking copy in does not wait)
            return self.at is not None and any(what != "h2d:to-async" for _, what in host_reads[self.at:])

        def synchronize(self):  # the host waits for the device up to the event: recorded as a host read
            if host_reads is None:
                raise RuntimeError("torch.cuda.Event.synchronize() on a path that must not wait for the device")
            host_reads.append((_caller(), "torch.cuda.Event.synchronize"))

        def elapsed_time(self, end) -> float:
            if not (self.done() and end.done()):
                raise RuntimeError("Both events must be completed before calculating elapsed time (no host wait "
                                   "on the device came after one of them)")
            return 0.0

    saved_event, saved_stream = torch.cuda.Event, torch.cuda.current_stream
    torch.cuda.Event = Event
    torch.cuda.current_stream = lambda device=None: None  # what Event.record is given (no streams without CUDA)
    saved_cap = torch.cuda.get_device_capability
    saved_tolist = FakeTensor.tolist
    FakeTensor.tolist = torch.Tensor.tolist  # FakeTensor's own reads element by element (one .item() each); a GPU
    # tensor's .tolist() is ONE device-to-host copy: the mode sees it as one read
    torch.cuda.synchronize = synchronize
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # dist.broadcast asks (FP8 handling): an H100
    try:
        with tagged_generators(), mode, IndexViaAten(host_reads):
            yield mode
    finally:
        torch.cuda.synchronize, torch.cuda.get_device_capability = saved, saved_cap
        torch.cuda.Event, torch.cuda.current_stream = saved_event, saved_stream
        FakeTensor.tolist = saved_tolist


def to_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """A meta-built module to data-less cuda parameters (call inside `fake_cuda()`, with grad mode on: to_empty
    swaps the parameters and no_grad breaks the swap)."""
    with torch.enable_grad():
        module = module.to_empty(device="cuda")
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def on_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"
