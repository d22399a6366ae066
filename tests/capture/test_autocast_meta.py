"""Autocast emulated on meta tensors (``autoremat.capture.autocast_meta``): on the CPU the emulation
is compared with real CPU autocast op for op and capture for capture; CUDA's policy facts are
checked on meta (this machine has no GPU: the CUDA capture is compared with a real one by a
GPU-marked test); the process is left as it was."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autoremat
from autoremat.capture.autocast_meta import active_emulation, can_emulate, emulated_autocast
from autoremat.capture.device_parity import as_device
from autoremat.cost import unoptimised_peak_bytes

LOWER = (torch.bfloat16, torch.float16)


class _Ops(TorchDispatchMode):
    """Each op with its output's dtype and shape."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.ops.append((str(func), getattr(first, "dtype", None), tuple(getattr(first, "shape", ()))))
        return out

    def count(self, name: str) -> int:
        return sum(1 for op, _, _ in self.ops if op == name)


def _inputs(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    made = {"x": torch.randn(4, 8, generator=g), "w": torch.randn(16, 8, generator=g),
            "img": torch.randn(2, 3, 8, 8, generator=g), "k": torch.randn(4, 3, 3, 3, generator=g),
            "q": torch.randn(2, 2, 6, 8, generator=g)}
    out = {n: t.to(device).requires_grad_(n in ("x", "w", "k")) for n, t in made.items()}
    out["target"] = torch.tensor([1, 0, 3, 2]).to(device)
    return out


def _step(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Lower-precision, fp32 and promoting ops, a composite (cross entropy), attention, a cached
    weight used twice, an autocast-disabled region; forward and backward."""
    y = F.linear(t["x"], t["w"]) + F.linear(t["x"] * 2, t["w"])
    z = F.layer_norm(torch.softmax(y, -1), (16,))
    c = F.conv2d(t["img"], t["k"], padding=1).flatten(1)[:, :16]
    z = torch.cat([z, c.float()], 0)[:4] + torch.addcmul(z, z, y)
    a = F.scaled_dot_product_attention(t["q"], t["q"], t["q"]).sum() * 0
    with torch.autocast(z.device.type if z.device.type != "meta" else "cpu", enabled=False):
        z = z.float() @ t["w"]
    return F.cross_entropy(z @ t["w"].t(), t["target"]) + a


def _ops_of(device: str, emulate: bool) -> list[tuple[str, Any, Any]]:
    t = _inputs(device)
    rec = _Ops()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if emulate:
            with as_device(torch.device("cpu")), emulated_autocast("cpu"), rec:
                _step(t).backward()
        else:
            with rec:
                _step(t).backward()
    return rec.ops


def test_emulated_cpu_autocast_dispatches_the_ops_real_cpu_autocast_does() -> None:
    cpu = _ops_of("cpu", emulate=False)
    meta = _ops_of("meta", emulate=True)
    assert meta == cpu
    assert ("aten.mm.default", torch.bfloat16, (4, 16)) in cpu  # autocast did something to compare
    plain = _ops_of("meta", emulate=False)  # what the emulation is for: autocast never fires on meta
    assert plain != cpu and ("aten.mm.default", torch.bfloat16, (4, 16)) not in plain


NODE_FIELDS = ("name", "kind", "out_bytes", "alloc_bytes", "alias_of", "saves", "extra_saved_bytes",
               "fwd_temp_bytes", "bwd_temp_bytes", "param_grad_bytes", "requires_grad", "is_output",
               "held_by_output", "grad_passthrough", "recomputable", "scope", "op_index")


def _build(name: str) -> tuple[nn.Module, tuple, dict, Any]:
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
        from autoremat.zoo.hf_breadth import build

        return build(name[3:])
    model, args = autoremat.zoo.build(name, size="small", batch_size=4)
    return model, tuple(args), {}, None


@contextlib.contextmanager
def _logged() -> Iterator[list[str]]:
    """The INFO records of ``autoremat.capture`` inside the block."""
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("autoremat.capture")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield said
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _same_graph_under_autocast(name: str, device: str, dtype: torch.dtype) -> None:
    """The meta capture under emulated autocast is the real capture under real autocast."""
    from autoremat.capture.scaled import capture_within

    model, args, kwargs, loss = _build(name)
    model = model.to(device)
    args = tuple(a.to(device) for a in args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.autocast(device, dtype=dtype):
        full = autoremat.capture(model, args, kwargs, loss_fn=loss, times="flops")
        with _logged() as said:
            meta = capture_within(model, args, kwargs, limit_bytes=1, loss_fn=loss, times="flops")
    # where the meta capture fell back, the log says why (an H200 run met a fallback here)
    assert meta.meta.get("autocast_emulated") == {"device": device, "dtype": str(dtype)}, "\n".join(said)
    assert meta.meta.get("scaled") is None  # the meta capture itself
    assert [meta.node(v)["name"] for v in meta.nodes] == [full.node(v)["name"] for v in full.nodes]
    for v in full.nodes:
        assert {f: meta.node(v)[f] for f in NODE_FIELDS} == {f: full.node(v)[f] for f in NODE_FIELDS}, v
    assert set(meta.nx.edges) == set(full.nx.edges)
    assert unoptimised_peak_bytes(meta) == unoptimised_peak_bytes(full)


@pytest.mark.parametrize("name", ["resnet50", "transformer", "hf:gpt2_labels"])
def test_meta_capture_under_cpu_autocast_is_the_real_capture_node_for_node(name: str) -> None:
    _same_graph_under_autocast(name, "cpu", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", LOWER)
@pytest.mark.parametrize("name", ["resnet50", "transformer", "hf:gpt2_labels", "hf:qwen2"])
def test_meta_capture_under_cuda_autocast_is_the_real_capture_node_for_node(name: str, dtype: torch.dtype) -> None:
    """CUDA's policy (softmax, layer norm in fp32) read from the CUDA kernels: the emulated meta
    capture against a real CUDA capture under real CUDA autocast (not run without a GPU)."""
    _same_graph_under_autocast(name, "cuda", dtype)


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype, cache: bool = True) -> Any:
    """CUDA's autocast state set directly (``torch.autocast("cuda")`` disables itself on a build
    without CUDA) with the emulation; put back afterwards."""
    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled())
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_cache_enabled(cache)
    try:
        with emulated_autocast("cuda") as emu:
            yield emu
    finally:
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])
        torch.set_autocast_cache_enabled(before[2])


def _meta(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("dtype", LOWER)
def test_cuda_policy_on_meta(dtype: torch.dtype) -> None:
    """CUDA's lists as the CUDA kernels apply them: matrix products and convolutions in the chosen
    lower precision; softmax, log-softmax, layer norm, sum in fp32 (CPU autocast leaves those alone);
    concatenation promotes; and the casts are recorded by autograd."""
    x, w = _meta(4, 8, grad=True), _meta(16, 8, grad=True)
    h = _meta(4, 16, dtype=dtype)
    img, k = _meta(2, 3, 8, 8), _meta(4, 3, 3, 3, grad=True)
    with _cuda_autocast(dtype):
        y = F.linear(x, w)
        got = {"linear": y.dtype, "matmul": (x @ w.t()).dtype, "conv": F.conv2d(img, k).dtype,
               "softmax": torch.softmax(h, -1).dtype, "log_softmax": F.log_softmax(h, -1).dtype,
               "layer_norm": F.layer_norm(h, (16,)).dtype, "sum": h.sum().dtype,
               "cat": torch.cat([h, _meta(4, 16)]).dtype, "gelu": F.gelu(h).dtype}
        assert y.grad_fn.next_functions[0][0].name() == "ToCopyBackward0"  # autograd saw the cast
    assert got == {"linear": dtype, "matmul": dtype, "conv": dtype, "softmax": torch.float32,
                   "log_softmax": torch.float32, "layer_norm": torch.float32, "sum": torch.float32,
                   "cat": torch.float32, "gelu": dtype}
    with _cuda_autocast(dtype), torch.autocast("cuda", enabled=False):  # a region that turns it off
        warnings.simplefilter("ignore")
        assert F.linear(x, w).dtype == torch.float32
    assert F.linear(x, w).dtype == torch.float32  # and nothing is left after the emulation


def test_without_the_emulation_meta_tensors_see_no_cuda_autocast() -> None:
    """What the emulation is for: with CUDA autocast on, plain meta tensors stay in fp32 and CPU
    autocast's lists differ from CUDA's (softmax stays in bf16 there)."""
    x, w, h = _meta(4, 8), _meta(16, 8), _meta(4, 16, dtype=torch.bfloat16)
    torch.set_autocast_enabled("cuda", True)
    try:
        assert F.linear(x, w).dtype == torch.float32
    finally:
        torch.set_autocast_enabled("cuda", False)
    with torch.autocast("cpu", dtype=torch.bfloat16), emulated_autocast("cpu"):
        assert torch.softmax(h, -1).dtype == torch.bfloat16 and F.linear(x, w).dtype == torch.bfloat16


def test_a_banned_op_raises_the_devices_error() -> None:
    p = torch.empty(4, device="meta")
    with _cuda_autocast(torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)


def test_cast_cache_one_copy_per_parameter_per_region() -> None:
    """An fp32 leaf that requires grad is cast once per outermost autocast region, and the copy
    stays alive until the region ends; an input is cast every time, everything with the cache off."""
    layer = nn.Linear(8, 8, device="meta")
    x = _meta(4, 8)
    rec = _Ops()
    with _cuda_autocast(torch.bfloat16) as emu, rec:
        for _ in range(3):
            layer(layer(x))
        cached = weakref.ref(emu.cache[id(layer.weight)][1])
        assert cached() is not None and cached().dtype == torch.bfloat16
        casts = rec.count("aten._to_copy.default")
        torch.clear_autocast_cache()  # what the outermost ``torch.autocast`` does when it exits
        assert cached() is None
        layer(x)
    # the two parameters once, the input (not a leaf that requires grad) each time
    assert casts == 2 + 3
    assert rec.count("aten._to_copy.default") == casts + 3
    rec = _Ops()
    with _cuda_autocast(torch.bfloat16, cache=False), rec:
        layer(layer(x))
    assert rec.count("aten._to_copy.default") == 3 + 2  # the parameters twice


def test_cast_cache_as_real_cpu_autocast_across_nested_regions() -> None:
    """Nested regions keep the cache (the outermost one clears it), as real CPU autocast does."""
    def casts(device: str, emulate: bool) -> list[int]:
        layer = nn.Linear(8, 8).to(device)
        x = torch.randn(4, 8).to(device)
        counts = []
        with contextlib.ExitStack() as stack:
            rec = _Ops()
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    if emulate and not counts:
                        stack.enter_context(emulated_autocast("cpu"))
                    stack.enter_context(rec) if not counts else None
                    layer(x)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        layer(x)
                    counts.append(rec.count("aten._to_copy.default"))
        return counts
    real = casts("cpu", False)
    assert real == [4, 8]  # weight, bias and input, the input again inside; all again in the next region
    assert casts("meta", True) == real


def test_the_process_is_left_as_it_was_even_on_an_error() -> None:
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastPrivateUse1"))
    clear = torch.clear_autocast_cache
    with pytest.raises(ZeroDivisionError), _cuda_autocast(torch.bfloat16):
        assert active_emulation() is not None
        F.linear(_meta(2, 4), _meta(3, 4))
        raise ZeroDivisionError
    assert set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastPrivateUse1")) == registered
    assert torch.clear_autocast_cache is clear and active_emulation() is None
    assert not torch.is_autocast_enabled("privateuseone") and not torch.is_autocast_enabled("cuda")
    assert torch.mm(_meta(2, 4), _meta(4, 3)).dtype == torch.float32
    a = torch.randn(2, 4)
    assert torch.equal(torch.mm(a, a.t()), a @ a.t()) and torch.mm(a, a.t()).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # real CPU autocast still works
        assert torch.mm(a, a.t()).dtype == torch.bfloat16


def test_devices_it_cannot_emulate_are_named() -> None:
    assert can_emulate("cpu") is None and can_emulate("cuda") is None
    assert "not emulated" in str(can_emulate("xpu"))
    with pytest.raises(ValueError, match="device_type='mps'"):
        with emulated_autocast("mps"):
            pass


def test_meta_capture_logs_the_emulation(caplog: pytest.LogCaptureFixture) -> None:
    from autoremat.capture.scaled import capture_within

    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level(logging.INFO, "autoremat.capture.scaled"):
        g = capture_within(model, (torch.randn(8, 8),), limit_bytes=1, times="flops")
    assert "emulated on meta tensors" in caplog.text
    assert g.meta["autocast_emulated"] == {"device": "cpu", "dtype": "torch.bfloat16"}


def test_captures_in_one_autocast_region_start_from_an_empty_cast_cache() -> None:
    """A second capture in the same autocast region (the sizes of a scaled capture) profiles a
    step's first forward too: the parameter casts are in its graph, as in the first's."""
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = autoremat.capture(model, (x,), times="flops")
        second = autoremat.capture(model, (x,), times="flops")
    for v in first.nodes:
        assert {f: second.node(v)[f] for f in NODE_FIELDS} == {f: first.node(v)[f] for f in NODE_FIELDS}, v
    assert unoptimised_peak_bytes(second) == unoptimised_peak_bytes(first)
