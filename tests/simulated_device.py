"""An accelerator simulated on the CPU: what the tests of the GPU / Apple-silicon path run under.

On a CPU-only machine every tensor is on the CPU, so a tensor the project creates on the wrong
device, float64 work done where the model lives, or a host sync on every step are invisible.
:class:`SimulatedAccelerator` (a torch function mode, active only while it is entered) follows every
tensor the project touches and says which side it would be on in a GPU run:

- **host**: created by a factory (``torch.zeros``, ``torch.tensor``, ...) with no ``device`` (the
  default device is the CPU), or with ``device="cpu"`` (the string: how the project marks a
  tensor it means to keep on the CPU), or by ``torch.from_numpy``, or moved there (``.cpu()``,
  ``.to("cpu")``); and whatever is computed from host tensors only;
- **device**: everything else: the model's weights and what they touch, tensors moved with
  ``.to(x.device)`` or made with ``device=x.device`` (a ``torch.device`` object stands for the
  accelerator: on this machine ``x.device`` is ``cpu``, in a GPU run it is ``cuda:0``).

In project code (this repository, tests aside) it fails, naming the file and line, where

- a factory is called without ``device=`` (:attr:`missing_device`): on a GPU run the tensor
  lands on the CPU, whatever the model's device;
- an operation mixes a host tensor of one or more dimensions with device tensors
  (:attr:`mixed`): CUDA and MPS raise "expected all tensors to be on the same device" there (a
  0-dimensional host tensor is allowed, as CUDA allows it; so are host indices);
- a float64 tensor comes out on the device (:attr:`float64_on_device`): MPS has no float64, and on
  CUDA it is slow;
- an operation MPS does not implement runs on the device (:attr:`not_on_mps`: ``NOT_ON_MPS``).

It counts the host syncs: ``.item()``, ``bool()``, ``float()``, ``int()``, ``.tolist()``,
``.numpy()``, ``.cpu()`` and ``.to("cpu")`` of a device tensor, from any code (Lightning's too).
Library code (torch, Lightning, devinterp) is followed but never failed: its devices are its own.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]
TORCH = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())
FACTORIES = _device_constructors()
SYNCS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
}
TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy}
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.copy_}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
QUERIES = {torch._has_compatible_shallow_copy_type}
"""Compare tensors without computing: ``Module.to`` asks it of a parameter and its moved copy."""
SET_DATA = torch.Tensor.data.__set__
"""``param.data = moved``: how ``Module.to`` moves a parameter (compare with ==, as :data:`DEVICE_OF`)."""
WIDE = {torch.float64, torch.complex128}
NOT_ON_MPS = {torch.linalg.eigvals, torch.linalg.eig}
"""Not implemented on Apple's MPS in torch 2.13 (and serial, with a host sync, on CUDA)."""
DEVICE_OF = torch.Tensor.device.__get__  # a new method-wrapper at each access: compare with ==


class DeviceMistake(AssertionError):
    """What would fail, or run in float64, on an accelerator; the message names the project's line."""


def project_frame():
    """The frame that called into torch, if it is the project's (not torch's, not a test's), else None."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == HERE):
        frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    inside = path.is_relative_to(REPO) and not path.is_relative_to(REPO / ".venv")
    return frame if inside and not path.is_relative_to(REPO / "tests") else None


def where(frame) -> str:
    return f"{Path(frame.f_code.co_filename).relative_to(REPO)}:{frame.f_lineno} ({frame.f_code.co_name})"


class HostDevice(str):
    """What ``x.device`` says of a host tensor: ``"cpu"`` as a string, so that ``device=x.device``
    and ``.to(x.device)`` keep the host side (a ``torch.device`` stands for the accelerator)."""

    type = "cpu"
    index = None


def names_host(device) -> bool:
    """``device="cpu"`` as a string: the project's mark of a tensor meant for the CPU."""
    return isinstance(device, str) and device.startswith("cpu")


class SimulatedAccelerator(TorchFunctionMode):
    """Follows host and device tensors while entered (see the module's docstring); ``strict``: raise
    :class:`DeviceMistake` at the first mistake in project code, else only list it. ``syncs``: host
    syncs counted so far (reset it between steps)."""

    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.host: dict[int, weakref.ref] = {}  # data_ptr -> a host storage; id -> an empty host tensor
        self.syncs = 0
        self.sync_sites: list[str] = []
        self.missing_device: list[str] = []
        self.mixed: list[str] = []
        self.float64_on_device: list[str] = []
        self.not_on_mps: list[str] = []

    def __enter__(self):
        """Also follows ``torch.from_numpy``, which torch function modes do not see: always the host."""
        original = self.original_from_numpy = torch.from_numpy

        def from_numpy(array):
            tensor = original(array)
            self.mark_host(tensor)
            return tensor

        torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self.original_from_numpy
        return super().__exit__(*exc)

    def keep_on_host(self, *tensors: torch.Tensor) -> None:
        """Mark tensors made before entering as the host's, as a GPU run holds them (a probe's tokens):
        moving one to the device then copies it, under whatever inference mode is on, as CUDA does."""
        for tensor in tensors:
            self.mark_host(tensor)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is the host's: so is every tensor on it (a view; an ``nn.Parameter`` made of
        it, which torch function modes do not see made, as a model built with ``device="cpu"`` has), until
        ``param.data`` is set to another's. A move between devices copies (see ``__torch_function__``)."""
        key, held = self.key(tensor)
        self.host[key] = weakref.ref(held)

    def on_host(self, tensor) -> bool:
        key, held = self.key(tensor)
        known = self.host.get(key)
        return known is not None and known() is held

    @staticmethod
    def key(tensor: torch.Tensor):
        """(key, object) that stand for where ``tensor`` lives: its storage (torch keeps a storage's Python
        object while the storage lives), or, for an empty one (no address), the tensor itself."""
        storage = tensor.untyped_storage()
        return (storage.data_ptr(), storage) if storage.nbytes() else (id(tensor), tensor)

    def mistake(self, kind: list[str], message: str) -> None:
        kind.append(message)
        if self.strict:
            raise DeviceMistake(message)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == DEVICE_OF:
            return HostDevice("cpu") if self.on_host(args[0]) else func(*args, **kwargs)
        frame = project_frame()
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device_inputs = [t for t in inputs if not self.on_host(t)]
        is_factory = func in FACTORIES and not (args and isinstance(args[0], torch.Tensor))
        if is_factory and frame is not None and kwargs.get("device") is None:
            self.mistake(
                self.missing_device,
                f"{where(frame)}: torch.{func.__name__} without device=: on an accelerator this tensor is on"
                ' the CPU (say device=x.device, or device="cpu" for a tensor meant for the CPU)',
            )
        syncs = func in SYNCS or func in TO_HOST or (func is torch.Tensor.to and self.moves_host(args, kwargs))
        if syncs and device_inputs:
            self.syncs += 1
            self.sync_sites.append(where(frame) if frame is not None else f"library: {func.__name__}")
        moves = func in MOVES or func == SET_DATA
        if frame is not None and not moves and func not in INDEXING | QUERIES and device_inputs:
            host = [t for t in inputs if self.on_host(t) and t.dim() > 0]
            if host:
                self.mistake(
                    self.mixed,
                    f"{where(frame)}: {getattr(func, '__name__', func)} mixes a CPU tensor {tuple(host[0].shape)} with"
                    " tensors on the model's device",
                )
        if func in NOT_ON_MPS and frame is not None and device_inputs:
            self.mistake(
                self.not_on_mps, f"{where(frame)}: torch.linalg.{func.__name__} on the model's device: MPS has none"
            )
        result = func(*args, **kwargs)
        if is_factory:
            host = kwargs.get("device") is None or names_host(kwargs.get("device"))
        elif func in TO_HOST:
            host = True
        elif func is torch.Tensor.to:  # library code passes our device on as a string: only ours marks the host
            moves_host = self.moves_host(args, kwargs) if frame is not None else self.follows_host(args, kwargs)
            host = moves_host or (not self.moves_device(args, kwargs) and not device_inputs)
        else:
            host = bool(inputs) and not device_inputs
        if func in (torch.Tensor.cpu, torch.Tensor.to) and result is args[0] and host != self.on_host(args[0]):
            result = result.clone()  # a move between devices copies: the original stays where it was
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        for output in outputs:
            if host:
                self.mark_host(output)
            elif output.dtype in WIDE and frame is not None:
                self.mistake(
                    self.float64_on_device,
                    f"{where(frame)}: {getattr(func, '__name__', func)} makes a {output.dtype} tensor"
                    f" {tuple(output.shape)} on the model's device (MPS has none; on CUDA it is slow)",
                )
        return result

    @staticmethod
    def target(args, kwargs):
        """The device a ``Tensor.to`` call names (a str, a torch.device, a tensor's), or None."""
        candidates = [*args[1:], kwargs.get("device"), kwargs.get("other")]
        for c in candidates:
            if isinstance(c, (str, torch.device)):
                return c
            if isinstance(c, torch.Tensor):
                return c
        return None

    def follows_host(self, args, kwargs) -> bool:
        """A library's ``.to(tensor)``: the host when that tensor is."""
        target = self.target(args, kwargs)
        return isinstance(target, torch.Tensor) and self.on_host(target)

    def moves_device(self, args, kwargs) -> bool:
        target = self.target(args, kwargs)
        return target is not None and not (isinstance(target, torch.Tensor) and self.on_host(target))

    def moves_host(self, args, kwargs) -> bool:
        target = self.target(args, kwargs)
        return names_host(target) or (isinstance(target, torch.Tensor) and self.on_host(target))
