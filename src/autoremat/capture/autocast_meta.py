"""Autocast on meta tensors as the real device applies it (issue 20: the meta capture of a step
that does not fit, under ``bf16-mixed`` / ``16-mixed`` / ``torch.autocast``).

Autocast's dispatch keys (``AutocastCPU``, ``AutocastCUDA``) are added to a tensor's keys by its
device, so they never fire on meta tensors: a meta capture under autocast would record every op in
full precision (wrong bytes, wrong saved tensors, missing casts). :func:`emulated_autocast` makes
the meta tensors of a capture see the autocast of ``device`` ("cpu" or "cuda"):

* **Where.** Python kernels registered at the ``AutocastPrivateUse1`` key for exactly the ops the
  real device's autocast key has kernels for (``torch._C._dispatch_get_registrations_for_dispatch_key``),
  with a fallthrough fallback for every other op; the key is made to fire on every tensor for the
  duration (included in the thread's dispatch keys, removed from its excluded ones). Autocast keys
  sit above autograd, so the casts are recorded by autograd (``ToCopyBackward``), the recorder
  sees the ``_to_copy`` ops and the cast tensors saved for backward, as under real autocast; and
  as real autocast, the kernels also see the ops a composite function calls (``cross_entropy`` ->
  ``log_softmax``, ``nll_loss``) unless the composite is itself listed. Decision: a
  ``TorchFunctionMode`` was considered and rejected for that reason (it sees only the Python-level
  call, not what a composite dispatches), and for the same reason casts are never applied by
  hand-copied op lists.
* **What.** Which arguments an op casts, to which dtype, is read from the build's own kernel for
  the real device: the op is run once (forward only, no grad) on *probe* tensors, wrapper
  subclasses that claim the real device and hold meta tensors, with that device's autocast on at
  the chosen dtype, and the ``_to_copy`` of an argument it dispatches are noted; casts the same op
  makes with autocast off are not autocast's and are left out. The answer is remembered per op,
  argument dtypes and non-size arguments (the 3-layer GPT-2 of ``autoremat.zoo.hf_breadth``: 9
  probes for 56 casts; ResNet-50: 6 probes). So the lower-precision,
  fp32 (CUDA's ``softmax``, ``log_softmax``, ``layer_norm``), promote and untouched policies, the
  ops autocast refuses (CUDA's ``binary_cross_entropy``: the real error is raised) and the dtype
  the user chose (bf16, fp16) are those of the build. Measured on the CPU (torch 2.13): the probe
  of ``mm`` on "cuda" wrappers dispatches two casts and a bf16 ``mm`` although the build has no CUDA.
  The casts are made in the order the kernel made them in the probe (GCC builds evaluate the
  arguments right to left: a convolution's weight is cast before its input). Autocast's "set
  dtype" policy (``sum``, ``cumsum``, ``softmax``: the op called with ``dtype=float32``) is seen as
  the op (or, for ``norm``, an overload of it) dispatched with a dtype, or, where the op is a
  composite (``softmax`` on fp16), as an output dtype that changed with no cast. On a build
  without CUDA a composite's ``toType`` on "cuda" probes raises (no CUDA device guard); for ops
  that take a dtype that is the set-dtype rule, applied as the C++ kernel does (first argument an
  eligible float, no dtype given); any other probe error is raised.
* **Cast cache.** As ``at::autocast::cached_cast``: an fp32 leaf tensor that requires grad and is
  not a view, cast to the lower-precision dtype with the cache enabled, is cast once and the copy
  is kept (alive, so its bytes count) until the outermost autocast region exits
  (``torch.clear_autocast_cache``, which is wrapped while the emulation runs) or the emulation ends.
* **Regions.** Each kernel reads the real device's autocast state when it runs
  (``torch.is_autocast_enabled(device)``, ``torch.get_autocast_dtype(device)``), so nested
  ``torch.autocast(..., enabled=False)`` blocks (Hugging Face's rotary embeddings, some losses) and
  a nested dtype behave as on the device. One limit: on a build without CUDA,
  ``torch.autocast("cuda", enabled=True)`` entered inside the model disables itself (a warning);
  the outer state set by the caller is unaffected.
* **Clean.** The kernels and fallback are removed, the dispatch-key and ``privateuseone`` autocast
  state put back and the cache emptied on exit, also on an exception.

Cost (x86_64, 2 cores, CPU only, shared; ``benchmarks/results/cpu/meta_autocast``): the meta
capture under emulated bf16 autocast takes 1.18x (zoo, median; 0.97-1.77x) and 1.46x (Hugging
Face, median; 1.15-1.92x) the time of the same meta capture without autocast, and 0.06-0.71x the
real capture's.

Tested against real CPU autocast op for op and capture for capture
(``tests/capture/test_autocast_meta.py``); CUDA's policy facts are tested on meta here and the
CUDA capture against a real one by a GPU-marked test.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["EMULATED", "emulated_autocast", "can_emulate", "AutocastEmulation", "active_emulation"]

logger = logging.getLogger(__name__)

EMULATED = ("cpu", "cuda")
"""Device types whose autocast :func:`emulated_autocast` reproduces on meta tensors."""

_K = torch._C.DispatchKey
_KEY = _K.AutocastPrivateUse1
_REAL = {"cpu": _K.AutocastCPU, "cuda": _K.AutocastCUDA}
_TO_COPY = torch.ops.aten._to_copy.default
_KEYED_TYPES = (torch.dtype, bool, str, type(None))
_EXCLUDED = torch._C.DispatchKeySet(_KEY) | torch._C.DispatchKeySet(_REAL["cpu"]) | torch._C.DispatchKeySet(_REAL["cuda"])
_ACTIVE: list["AutocastEmulation"] = []


def active_emulation() -> "AutocastEmulation | None":
    """The :class:`AutocastEmulation` of the innermost :func:`emulated_autocast` running, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def can_emulate(device_type: str) -> str | None:
    """``None`` where :func:`emulated_autocast` can run for ``device_type``, else the reason."""
    if device_type not in EMULATED:
        return f"autocast on {device_type!r} is not emulated on meta tensors (only {EMULATED})"
    if not torch._C._dispatch_get_registrations_for_dispatch_key(_REAL[device_type].name):
        return f"this torch build has no {_REAL[device_type].name} kernels to read the policy from"
    if torch.is_autocast_enabled("privateuseone"):
        return "autocast is on for the privateuseone device, whose dispatch key the emulation uses"
    return None


class _Probe(torch.Tensor):
    """A tensor that claims a device and holds a meta tensor; notes the casts of the arguments in
    :attr:`watched` (``{id: flat index}``) and the first call of an overload of :attr:`packet`
    given a dtype (``sum(x, dtype=float32)``: autocast's "set dtype" policies)."""

    casts: list[tuple[int, torch.dtype]] = []
    watched: dict[int, int] = {}
    packet: Any = None
    redirect: list[tuple[Any, torch.dtype]] = []

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device) -> "_Probe":
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=device)

    def __init__(self, inner: torch.Tensor, device: torch.device) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        if func is _TO_COPY and isinstance(args[0], _Probe) and id(args[0]) in cls.watched \
                and kwargs.get("dtype") not in (None, args[0].dtype):
            cls.casts.append((cls.watched[id(args[0])], kwargs["dtype"]))
        elif func.overloadpacket is cls.packet and not cls.redirect:
            dtype = _dtype_argument(func, args, kwargs)
            if dtype is not None:
                cls.redirect.append((func, dtype))
        flat, spec = tree_flatten((args, kwargs))
        device = next(t.device for t in flat if isinstance(t, _Probe))
        a, k = tree_unflatten([t.inner if isinstance(t, _Probe) else _meta(t) for t in flat], spec)
        out = func(*a, **k)
        flat, spec = tree_flatten(out)
        return tree_unflatten([_Probe(t, device) if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _meta(x: Any) -> Any:
    """A tensor a composite made on the probes' device during a probe, as a meta tensor."""
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _dtype_argument(func: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The value of ``func``'s ``dtype`` argument in this call (``None``: none or not given)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dtype":
            return kwargs.get("dtype", args[i] if i < len(args) and not a.kwarg_only else None)
    return None


class AutocastEmulation:
    """The emulation's state for one device type: the policies read so far and the cast cache."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.policies: dict[tuple, dict[int, torch.dtype]] = {}
        self.probes = 0
        self.cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.casts = 0

    def kernel(self, op: Any) -> Any:
        """The kernel registered for ``op``: :meth:`below` calling the op."""
        def autocast_kernel(*args: Any, **kwargs: Any) -> Any:
            return self.below(op, None, args, kwargs)
        return autocast_kernel

    def below(self, op: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``fn`` (``None``: the op autocast chose) on ``op``'s arguments as the device's autocast
        casts them, with the autocast keys excluded, as the real kernels run the op. Also used by
        :class:`autoremat.capture.device_parity.AsDevice`, which runs attention's composite itself."""
        on = torch.is_autocast_enabled(self.device_type)  # before the guard: it excludes the real key
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            target = op
            if on:
                target, args, kwargs = self.cast(op, args, kwargs)
            return (fn or target)(*args, **kwargs)

    def cast(self, op: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        """``(op to call, args, kwargs)`` as the real device's autocast makes them: arguments cast
        (through the cast cache), or a dtype set on the op or an overload of it."""
        lower = torch.get_autocast_dtype(self.device_type)
        flat, spec = tree_flatten((args, kwargs))
        key = (op, lower, tuple(_signature(x) for x in flat))
        policy = self.policies.get(key)
        if policy is None:
            policy = self.policies[key] = self.probe(op, flat, spec, lower)
        casts, redirect = policy
        if casts:
            flat = list(flat)
            for i, dtype in casts:  # in the kernel's order (GCC builds evaluate the arguments right to left)
                flat[i] = self.cached_cast(flat[i], dtype, lower)
            args, kwargs = tree_unflatten(flat, spec)
        if redirect is not None:
            op, args, kwargs = redirect[0], *_with_dtype(redirect[0], args, kwargs, redirect[1])
        return op, args, kwargs

    def cached_cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        """``t.to(dtype)``, through the cast cache where real autocast would use it."""
        cacheable = (dtype == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled())
        if cacheable:
            hit = self.cache.get(id(t))
            if hit is not None and hit[0]() is t and hit[1].dtype == dtype:
                return hit[1]
        out = _TO_COPY(t, dtype=dtype)
        self.casts += 1
        if cacheable:
            self.cache[id(t)] = (weakref.ref(t), out)
        return out

    def probe(self, op: Any, flat: list, spec: Any, lower: torch.dtype) -> tuple[list, Any]:
        """What the device's autocast does to this call (module docstring): ``([(flat index, dtype)]
        of the casts in the order the kernel makes them, (overload, dtype) or None)``, less what the
        op does with autocast off."""
        self.probes += 1
        try:  # a call valid only under autocast (a bf16 input, fp32 weights) fails without it
            off_casts, off_redirect, off_out = self._observe(op, flat, spec, lower, False)
        except RuntimeError:
            off_casts, off_redirect, off_out = [], None, None
        try:
            casts, redirect, out = self._observe(op, flat, spec, lower, True)
        except RuntimeError as exc:
            # a CPU build asked about CUDA: a composite's ``toType`` wants a CUDA device guard. Only
            # ops that take a dtype get there (``softmax``, ``log_softmax``): autocast's "set dtype"
            # rule, ``dtype=float32`` where none is given and the first argument is an eligible float
            if "not linked with support for cuda" not in str(exc) \
                    or not any(a.name == "dtype" for a in op._schema.arguments):
                raise
            return [], _set_dtype(op, flat, spec)
        casts = [(i, d) for i, d in casts if (i, d) not in off_casts]
        if redirect == off_redirect:
            redirect = None
            if not casts and out != off_out:  # a composite given ``dtype=float32`` (``softmax.int`` on
                redirect = _set_dtype(op, flat, spec)  # fp16: ``_softmax(x, dim, half_to_float=True)``)
        return casts, redirect

    def _observe(self, op: Any, flat: list, spec: Any, lower: torch.dtype,
                 enabled: bool) -> tuple[list[tuple[int, torch.dtype]], Any, tuple]:
        """``(casts, redirect, output dtypes)`` of one probe run with the autocast on or off."""
        from torch.utils._python_dispatch import _disable_current_modes

        device = torch.device(self.device_type)
        saved = _state()
        try:
            with _disable_current_modes(), torch.no_grad(), \
                    torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
                probes, watched = [], {}
                for i, x in enumerate(flat):  # made here: no recorder sees them
                    if isinstance(x, torch.Tensor):
                        inner = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                        x = _Probe(inner, device if x.device.type == "meta" else x.device)
                        watched[id(x)] = i
                    probes.append(x)
                a, k = tree_unflatten(probes, spec)
                _Probe.casts, _Probe.watched, _Probe.packet, _Probe.redirect = [], watched, op.overloadpacket, []
                for dev in EMULATED:
                    torch.set_autocast_enabled(dev, enabled and dev == self.device_type)
                torch.set_autocast_dtype(self.device_type, lower)
                torch.set_autocast_cache_enabled(False)
                result = op(*a, **k)
            casts, redirect = list(_Probe.casts), (_Probe.redirect[0] if _Probe.redirect else None)
            out = tuple(t.dtype for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))
        finally:
            _restore(saved)
            _Probe.casts, _Probe.watched, _Probe.packet, _Probe.redirect = [], {}, None, []
        return casts, redirect, out

    def clear(self) -> None:
        self.cache.clear()


def _with_dtype(func: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """``func``'s arguments with its ``dtype`` argument set (by position where given so)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dtype" and i < len(args) and not a.kwarg_only:
            return (*args[:i], dtype, *args[i + 1:]), kwargs
    return args, {**kwargs, "dtype": dtype}


def _set_dtype(op: Any, flat: list, spec: Any) -> tuple[Any, torch.dtype] | None:
    """``(op, float32)`` where ``op`` takes a dtype, none is given and its first argument is a
    float (not double) tensor on the device: autocast's ``fp32_set_opt_dtype`` rule; else None."""
    args, kwargs = tree_unflatten(flat, spec)
    first = args[0] if args else None
    eligible = (isinstance(first, torch.Tensor) and first.device.type == "meta" and first.is_floating_point()
                and first.dtype != torch.float64)
    return (op, torch.float32) if eligible and _dtype_argument(op, args, kwargs) is None else None


def _signature(x: Any) -> Any:
    """What of one argument enters the policy: a tensor's dtype and whether it is on the device
    (meta) or beside it (a CPU scalar); dtypes, flags and strings; other values by type."""
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, x.device.type == "meta")
    return x if isinstance(x, _KEYED_TYPES) else type(x)


def _state() -> tuple:
    return (tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in EMULATED),
            torch.is_autocast_cache_enabled())


def _restore(saved: tuple) -> None:
    for dev, enabled, dtype in saved[0]:
        torch.set_autocast_enabled(dev, enabled)
        torch.set_autocast_dtype(dev, dtype)
    torch.set_autocast_cache_enabled(saved[1])


@contextlib.contextmanager
def emulated_autocast(device_type: str) -> Iterator[AutocastEmulation]:
    """Meta tensors see ``device_type``'s autocast while the block runs (module docstring);
    yields the :class:`AutocastEmulation` (its policies, probes, casts and cache).

    Raises:
        ValueError: :func:`can_emulate` says it cannot run (the reason).
    """
    reason = can_emulate(device_type)
    if reason is not None:
        raise ValueError(f"device_type={device_type!r}: {reason}")
    emu = AutocastEmulation(device_type)
    ops = torch._C._dispatch_get_registrations_for_dispatch_key(_REAL[device_type].name)
    libs: list[torch.library.Library] = []
    clear = torch.clear_autocast_cache

    def clear_both() -> None:
        clear()
        emu.clear()
    was_on = torch.is_autocast_enabled("privateuseone")
    try:
        fallback = torch.library.Library("_", "IMPL", _KEY.name)
        libs.append(fallback)
        fallback.fallback(torch.library.fallthrough_kernel)
        lib = torch.library.Library("aten", "IMPL", _KEY.name)
        libs.append(lib)
        for qualified in ops:
            name = qualified.split("::", 1)[1]
            base, _, overload = name.partition(".")
            lib.impl(name, emu.kernel(getattr(getattr(torch.ops.aten, base), overload or "default")))
        torch.clear_autocast_cache = clear_both
        torch.set_autocast_enabled("privateuseone", True)
        _ACTIVE.append(emu)
        with torch._C._IncludeDispatchKeyGuard(_KEY):
            yield emu
    finally:
        if emu in _ACTIVE:
            _ACTIVE.remove(emu)
        torch.set_autocast_enabled("privateuseone", was_on)
        torch.clear_autocast_cache = clear
        for lib in reversed(libs):
            lib._destroy()
        emu.clear()
