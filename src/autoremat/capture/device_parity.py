"""Make a capture on the meta device dispatch the ops the real device would (issue 20: the
scaled capture must be the graph the full-size capture would produce).

A meta capture (:mod:`autoremat.capture.scaled.meta`) runs the model on meta tensors. Some
functions decide what to dispatch from the tensors' device, so on meta they take another path
than on the device the model trains on:

* ``F.scaled_dot_product_attention`` asks the device for a fused backend (flash, memory-efficient,
  cuDNN attention); meta has none and always takes the math path, which materialises the
  ``L x S`` attention weights and saves them for backward. Measured on a transformers Qwen2 with
  its default key/value cache (CPU, batch 4, sequence 64): 317 nodes on meta against 230 in the
  real capture, step peak predicted 1.245x the real capture's, and a plan made on it names ops the
  real model does not run.
* ``torch.tensor(data, device=...)`` dispatches ``aten.lift_fresh`` on a real device, not on meta
  (transformers' ``DynamicCache`` makes its empty key and value tensors this way).

:class:`AsDevice` is a ``TorchFunctionMode`` for the meta capture that closes both gaps:

* **Attention.** The backend is the one the real device picks (``torch._fused_sdp_choice`` on
  that device) for stand-ins of the call's tensors: the same sizes, strides, dtypes and
  ``requires_grad``, except the leading (batch) dimension cut to 1 where query, key, value and
  mask share it, so a stand-in holds one sample (``empty_strided``: allocated, never written).
  Decision: the batch size does not enter the backend checks of the torch we pin (shape checks
  compare the batch sizes with each other, which the cut keeps equal); sequence lengths, head
  sizes, strides and dtypes do, and are kept. Choices are remembered per metadata, so a 32-layer
  model asks once. The chosen backend's op is then called on the meta tensors with the glue the
  composite adds around it (boolean masks made additive; on CUDA, flash's head size padded to a
  multiple of 8 and sliced back, the memory-efficient kernel's mask padded to an aligned stride
  and expanded), so the recorder sees the real device's op sequence and bytes. Where the device
  picks math, or the choice fails, the call runs as it is (the math path, as before).
* **Fresh constants and list indices.** ``torch.tensor`` creating a meta tensor is followed by
  the ``aten.lift_fresh`` the real device dispatches (an alias of its input: no bytes); a list of
  ints in an index (``x[..., [0, 1]]``, Falcon) is made a tensor the same way first.
* **Moves that are no moves.** ``t.to(meta)`` and ``t.type_as(meta_tensor)`` of a tensor already
  on the real device (a CPU constant, when the model trains on the CPU) dispatch there only what
  a dtype change needs; the move to meta is not recorded. A 0-d tensor is not moved at all (it
  mixes with meta tensors as a scalar, and the recorder sees its consumers read it: DeBERTa-v2's
  relative positions); a larger one reaches meta unseen, so its consumers' edge to it is lost.
* **Layouts.** :class:`DeviceLayouts` gives meta convolutions (forward and backward) the memory
  format of the backend the real device would pick (SegFormer's depthwise convolution reads a
  channels-last view; the meta kernel answers contiguous), and layer norm's input gradient the
  contiguous layout the CPU and CUDA kernels give it (the meta kernel follows the output
  gradient's: Swin's is transposed, and a view's backward then copied).

Measured on the CPU (x86_64): 19 of the 20 architectures of :mod:`autoremat.zoo.hf_breadth`
run on meta (Mixtral's experts take a path for non-CPU devices that needs bf16) and, with the
cache on and off, give the CPU capture's graph node for node (bytes, edges, predicted peak). Cost:
the meta capture of ResNet-50 0.18 -> 0.21 s CPU (median of 5). Tested on the CPU against the
real composite op for op (``tests/capture/test_device_parity.py``: no mask, boolean and additive
masks, causal, grouped-query, dropout, no grad); the CUDA glue is checked the same way by
GPU-marked tests there (not run without a GPU).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["AsDevice", "DeviceLayouts", "as_device", "MATH", "FLASH", "EFFICIENT", "CUDNN"]

logger = logging.getLogger(__name__)

# ``torch.nn.attention.SDPBackend`` values as ``torch._fused_sdp_choice`` returns them
MATH = 0
FLASH = 1
EFFICIENT = 2
CUDNN = 3

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, 0.0, False, None, False)


@contextlib.contextmanager
def as_device(device: torch.device, shadows: Any = None) -> Iterator[AsDevice]:
    """Both modes for a meta capture of a model that trains on ``device``; yields the function
    mode (its ``choices`` count the attention backends). Enter it outside the capture, so the
    layouts mode sits below the recorder's modes. ``shadows``: a
    :class:`~autoremat.capture.shadow_values.ShadowValues` given the value of each
    ``torch.tensor`` made on meta."""
    with DeviceLayouts(device), AsDevice(device, shadows) as mode:
        yield mode


class AsDevice(TorchFunctionMode):
    """Run meta-device calls of composite functions the way ``device`` would (module
    docstring). ``choices`` counts the attention calls per backend chosen."""

    def __init__(self, device: torch.device, shadows: Any = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.shadows = shadows
        self._memo: dict[tuple, int] = {}
        self.choices: dict[int, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if func is torch.Tensor.type_as and len(args) == 2 and _on_meta(args[1]) and self._here(args[0]):
            return self._to_meta(args[0].to(dtype=args[1].dtype))  # on the device: ``to(other.options())``
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _on_meta(args[0]):
            args = (args[0], self._lifted_index(args[1]), *args[2:])
        out = func(*args, **kwargs)
        if func is torch.tensor and _on_meta(out):
            if self.shadows is not None:
                with _disable_current_modes():  # not part of the step
                    self.shadows.seed(out, func(*args, **{**kwargs, "device": "cpu"}))
            out = torch.ops.aten.lift_fresh.default(out)
        return out

    def _lifted_index(self, index: Any) -> Any:
        """An index with its lists of ints or bools made tensors as the real device makes them
        (``torch.tensor`` and ``aten.lift_fresh``; on meta the indexing code makes them without it)."""
        def lift(x: Any) -> Any:
            if not _int_list(x):
                return x
            t = torch.tensor(x, device="meta")
            if self.shadows is not None:
                with _disable_current_modes():
                    self.shadows.seed(t, torch.tensor(x))
            return torch.ops.aten.lift_fresh.default(t)
        if isinstance(index, tuple):
            return tuple(lift(x) for x in index)
        return lift(index)

    def _to(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``t.to(meta)`` of a tensor already on the real device: there it is ``t.to(device)``,
        which dispatches nothing unless it also changes the dtype; the move to meta is not
        recorded."""
        t = args[0]
        if not self._here(t):
            return func(*args, **kwargs)
        target = [i for i, a in enumerate(args) if _is_meta_device(a)]
        if not target and not _is_meta_device(kwargs.get("device")):
            return func(*args, **kwargs)
        args = tuple(self.device if i in target else a for i, a in enumerate(args))
        if "device" in kwargs:
            kwargs = {**kwargs, "device": self.device}
        return self._to_meta(func(*args, **kwargs))

    def _here(self, t: Any) -> bool:
        """Whether ``t`` is a tensor on the real device (not meta)."""
        return isinstance(t, torch.Tensor) and self.device.type != "meta" and t.device == self.device

    def _to_meta(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on meta, with its value as a shadow; nothing recorded. A 0-d tensor stays where it
        is, as on the device (0-d tensors of another device mix with meta ones as scalars do), so
        the recorder sees its consumers read it."""
        if t.dim() == 0:
            return t
        with _disable_current_modes():
            out = t.to("meta")
            if self.shadows is not None:
                self.shadows.seed(out, t)
        return out

    def _attention(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        from .autocast_meta import active_emulation

        emulation = active_emulation()  # autocast emulated on meta: cast as it casts, then run below it
        if emulation is not None:
            return emulation.below(torch.ops.aten.scaled_dot_product_attention.default,
                                   lambda *a, **k: self._attention_below(func, a, k), args, kwargs)
        return self._attention_below(func, args, kwargs)

    def _attention_below(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        q, k, v = args[:3]
        rest = dict(zip(_SDPA_ARGS, _SDPA_DEFAULTS))
        rest.update(zip(_SDPA_ARGS, args[3:]))
        rest.update(kwargs)
        if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in (q, k, v)):
            return func(*args, **kwargs)
        choice = self.choice(q, k, v, rest)
        self.choices[choice] = self.choices.get(choice, 0) + 1
        if choice == MATH:
            return func(*args, **kwargs)
        return _run_backend(choice, self.device.type, q, k, v, **rest)

    def choice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rest: dict[str, Any]) -> int:
        """The backend ``self.device`` picks for these arguments (:data:`MATH` where it cannot
        say: a device without fused kernels, or the check raised, logged at DEBUG)."""
        mask = rest["attn_mask"]
        tensors = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
        grad = torch.is_grad_enabled()
        key = (tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in tensors), grad,
               mask is not None, float(rest["dropout_p"]) > 0, bool(rest["is_causal"]), rest["scale"] is None,
               bool(rest["enable_gqa"]))
        if key not in self._memo:
            self._memo[key] = self._ask(q, k, v, rest)
        return self._memo[key]

    def _ask(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rest: dict[str, Any]) -> int:
        if self.device.type not in ("cpu", "cuda"):
            return MATH
        mask = rest["attn_mask"]
        cut = len({t.shape[0] for t in (q, k, v)} | ({mask.shape[0]} if _batched_mask(mask, q) else set())) == 1
        try:
            with _disable_current_modes():  # the stand-ins are not part of the step: no recorder sees them
                stand = [_stand_in(t, self.device, cut and (t is not mask or _batched_mask(mask, q)))
                         if isinstance(t, torch.Tensor) else t for t in (q, k, v, mask)]
                return int(torch._fused_sdp_choice(*stand[:3], attn_mask=stand[3],
                                                   dropout_p=float(rest["dropout_p"]),
                                                   is_causal=bool(rest["is_causal"]), scale=rest["scale"],
                                                   enable_gqa=bool(rest["enable_gqa"])))
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.debug("autoremat: the %s attention backend check failed on stand-ins (%s); the meta capture "
                         "takes the math path there", self.device.type, exc)
            return MATH


class DeviceLayouts(TorchDispatchMode):
    """Give meta convolutions the memory format the real device's backend would (module
    docstring): the backend ``torch._C._select_conv_backend`` picks for fake tensors of the
    arguments on ``device`` (full size, nothing allocated), then that backend's format
    (``torch._C._conv_determine_backend_memory_format``), as ``FakeTensorMode`` does; the output is
    a meta tensor of the kernel's shape in that format. Entered below the recorder, so the
    recorder sees the corrected output."""

    _OPS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._memo: dict[tuple, torch.memory_format | None] = {}
        self._fake: Any = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        out = func(*args, **(kwargs or {}))
        if func is _LN_BACKWARD and self.device.type != "meta" and _on_meta(out[0]) \
                and not out[0].is_contiguous():
            # the CPU and CUDA kernels make the input's gradient contiguous; the meta kernel follows
            # the output gradient's layout (Swin: a transposed one, and the next view's backward copied)
            return (_in_format(out[0], torch.contiguous_format), *out[1:])
        if func not in self._OPS or self.device.type == "meta":
            return out
        bound = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
        inp, w = bound["input"], bound["weight"]
        if not _on_meta(inp) or (inp.is_contiguous() and w.is_contiguous()):
            return out  # every CPU and CUDA backend keeps the default format then, as the meta kernel does
        fmt = self._format(bound)
        if fmt is None:
            return out
        if func is self._OPS[0]:
            return _in_format(out, fmt)
        return (_in_format(out[0], fmt), _in_format(out[1], fmt), out[2])

    def _format(self, b: dict[str, Any]) -> torch.memory_format | None:
        inp, w = b["input"], b["weight"]
        key = (tuple(inp.shape), inp.stride(), tuple(w.shape), w.stride(), inp.dtype, str(b["stride"]),
               str(b["padding"]), str(b["dilation"]), b["transposed"], str(b["output_padding"]), b["groups"],
               b.get("bias") is None)
        if key not in self._memo:
            self._memo[key] = self._ask(b)
        return self._memo[key]

    def _ask(self, b: dict[str, Any]) -> torch.memory_format | None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        def fake(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
        if self._fake is None:
            self._fake = FakeTensorMode()
        try:
            with self._fake:
                inp, w = fake(b["input"]), fake(b["weight"])
                bias = b.get("bias")
                extra: dict[str, Any] = {"bias": fake(bias) if isinstance(bias, torch.Tensor) else None}
                if "bias_sizes" in b:  # convolution_backward names the bias by its sizes
                    extra["bias_sizes"] = b["bias_sizes"]
                backend = torch._C._select_conv_backend(
                    inp, w, stride=b["stride"], padding=b["padding"], dilation=b["dilation"],
                    transposed=b["transposed"], output_padding=b["output_padding"], groups=b["groups"], **extra)
                if w.dim() == 3:  # the backends see 1-d convolutions as 2-d
                    inp, w = inp.contiguous().unsqueeze(2), w.unsqueeze(2)
                return torch._C._conv_determine_backend_memory_format(inp, w, backend)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.debug("autoremat: the %s convolution backend check failed (%s); the meta kernel's layout is "
                         "kept", self.device.type, exc)
            return None


_LN_BACKWARD = torch.ops.aten.native_layer_norm_backward.default


def _in_format(t: torch.Tensor | None, fmt: torch.memory_format) -> torch.Tensor | None:
    """A meta tensor of ``t``'s shape and dtype in ``fmt`` (a 3-d tensor in ``channels_last`` as
    its 4-d view with a unit third dimension, as the backends lay it out)."""
    if t is None or fmt in (torch.preserve_format,):
        return t
    if t.dim() == 3 and fmt == torch.channels_last:
        return torch.empty((t.shape[0], t.shape[1], 1, t.shape[2]), dtype=t.dtype, device=t.device,
                           memory_format=fmt).squeeze(2)
    if (t.dim() == 4 and fmt == torch.channels_last_3d) or (t.dim() == 5 and fmt == torch.channels_last):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt)


def _on_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _is_meta_device(a: Any) -> bool:
    return (isinstance(a, torch.device) and a.type == "meta") or (isinstance(a, str) and a == "meta")


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(
        _int_list(e) or (isinstance(e, (int, bool)) and not isinstance(e, torch.Tensor)) for e in x)


def _batched_mask(mask: Any, q: torch.Tensor) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == q.dim() and mask.shape[0] > 1


def _stand_in(t: torch.Tensor, device: torch.device, cut: bool) -> torch.Tensor:
    size = (1, *t.shape[1:]) if cut and t.dim() > 0 else tuple(t.shape)
    with torch.no_grad():
        s = torch.empty_strided(size, t.stride(), dtype=t.dtype, device=device)
    return s.requires_grad_(t.requires_grad)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The composite's ``convert_boolean_attn_mask``: a boolean mask as 0 where attended and
    ``-inf`` elsewhere (the same ops: ``scalar_tensor``, then ``where`` with a Python scalar)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _run_backend(choice: int, device_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
                 enable_gqa: bool) -> torch.Tensor:
    """The composite ``scaled_dot_product_attention``'s branch for ``choice`` on ``device_type``,
    run on meta tensors (what the composite adds around the kernel, then the kernel)."""
    aten = torch.ops.aten
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if choice == CUDNN:  # convert_boolean_attn_mask_cudnn: -65504 where masked out, a CPU scalar of 0
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.where(mask.logical_not(), -65504.0, torch.scalar_tensor(0.0, dtype=q.dtype))
        return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, lse, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    mask = _additive(attn_mask, q.dtype)
    if choice == FLASH and device_type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=mask,
                                                                scale=scale)[0]
    if choice == FLASH:
        head = q.shape[-1]
        padded = [_pad_last(t, 8) for t in (q, k, v)]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head)
        out = aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=og_scale)[0]
        return aten.slice.Tensor(out, -1, 0, head) if out.shape[-1] != head else out
    if choice == EFFICIENT:
        if mask is not None:
            mask = _aligned_mask(mask, q, k, 8)
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    raise ValueError(f"attention backend {choice} is not one AsDevice runs (math {MATH}, flash {FLASH}, "
                     f"efficient {EFFICIENT}, cudnn {CUDNN})")


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = t.shape[-1] % multiple
    return t if extra == 0 else F.pad(t, (0, multiple - extra))


def _aligned_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, alignment: int) -> torch.Tensor:
    """The composite's ``preprocess_mask``: a mask whose strides are not multiples of
    ``alignment`` (or whose last stride is not 1) is padded on its last dimension to a multiple of
    ``alignment`` and sliced back; then expanded to ``(B, H, L, S)``."""
    aligned = all(s % alignment == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        last = mask.shape[-1]
        mask = torch.ops.aten.slice.Tensor(F.pad(mask, (0, alignment - last % alignment)), -1, 0, last)
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
