"""A meta capture dispatches the ops the real device would (``autoremat.capture.device_parity``):
attention takes the device's fused backend, fresh constants and list indices are lifted, a move
to meta of a tensor already on the device dispatches nothing, and convolutions have the device
backend's layout. Each is compared op for op with the same code on the CPU; then whole captures
of Hugging Face models on meta against their CPU captures, node for node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autoremat.capture.device_parity import CUDNN, EFFICIENT, FLASH, as_device
from autoremat.cost import unoptimised_peak_bytes


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.outs: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor):
            self.outs.append((tuple(first.shape), first.stride()))
        return out


def _ops(fn: Callable[[str], Any], device: str, parity: bool) -> _Ops:
    """Ops ``fn(device)`` dispatches (forward, then backward of the sum of its output); on meta
    under :func:`as_device` ("cpu") when ``parity``."""
    rec = _Ops()
    if parity:
        with as_device(torch.device("cpu")), rec:
            out = fn(device)
            if out.requires_grad:
                out.sum().backward()
    else:
        with rec:
            out = fn(device)
            if out.requires_grad:
                out.sum().backward()
    return rec


def _qkv(device: str, kv_heads: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, 8, generator=g)
    k = torch.randn(2, 16, kv_heads, 8, generator=g).transpose(1, 2)  # a layout transformers makes
    v = torch.randn(2, kv_heads, 16, 8, generator=g)
    return tuple(t.to(device).requires_grad_() for t in (q, k, v))


def _mask(device: str, dtype: torch.dtype) -> torch.Tensor:
    m = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    m[..., 0] = True
    return m.to(device) if dtype == torch.bool else m.to(device=device, dtype=dtype)


ATTENTION: dict[str, Callable[[str], torch.Tensor]] = {
    "causal": lambda d: F.scaled_dot_product_attention(*_qkv(d), is_causal=True),
    "bool mask": lambda d: F.scaled_dot_product_attention(*_qkv(d), attn_mask=_mask(d, torch.bool)),
    "additive mask": lambda d: F.scaled_dot_product_attention(*_qkv(d), attn_mask=_mask(d, torch.float32)),
    "grouped-query": lambda d: F.scaled_dot_product_attention(*_qkv(d, kv_heads=2), is_causal=True, scale=0.3,
                                                              enable_gqa=True),
    "dropout (math on the cpu)": lambda d: F.scaled_dot_product_attention(*_qkv(d), dropout_p=0.1),
    "no grad": lambda d: F.scaled_dot_product_attention(*(t.detach() for t in _qkv(d)), is_causal=True),
}


def _same_on_meta(fn: Callable[[str], torch.Tensor]) -> None:
    """``fn`` on meta under the parity dispatches the CPU's ops, with the CPU's output layouts."""
    cpu = _ops(fn, "cpu", parity=False)
    meta = _ops(fn, "meta", parity=True)
    assert meta.ops == cpu.ops
    assert meta.outs == cpu.outs


@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_attention_on_meta_dispatches_the_cpu_ops(case: str) -> None:
    _same_on_meta(ATTENTION[case])


def test_without_parity_meta_attention_takes_the_math_path() -> None:
    """What the parity is for: the same call on plain meta tensors materialises the weights."""
    cpu = _ops(ATTENTION["causal"], "cpu", parity=False)
    plain = _ops(ATTENTION["causal"], "meta", parity=False)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in cpu.ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in plain.ops
    assert "aten.bmm.default" in plain.ops


def _constants(device: str) -> torch.Tensor:
    x = torch.randn(3, 4).to(device).requires_grad_()
    empty = torch.tensor([], device=x.device)               # transformers' DynamicCache
    picked = x[..., [0, 2]]                                  # Falcon's fused qkv split
    two = torch.tensor(2.0).to(x.device)                     # a CPU constant moved to the device
    return torch.cat([empty, picked.flatten()]) * two


def test_constants_list_indices_and_moves_dispatch_as_on_the_cpu() -> None:
    cpu = _ops(_constants, "cpu", parity=False)
    meta = _ops(_constants, "meta", parity=True)
    assert "aten.lift_fresh.default" in cpu.ops
    assert meta.ops == cpu.ops
    plain = _ops(_constants, "meta", parity=False)
    assert plain.ops != cpu.ops


CONV: dict[str, Callable[[str], torch.Tensor]] = {
    # SegFormer's depthwise convolution reads a transposed sequence: a channels-last input
    "depthwise, channels-last input": lambda d: F.conv2d(
        torch.randn(2, 64, 8, device=d).transpose(1, 2).reshape(2, 8, 8, 8).requires_grad_(),
        torch.randn(8, 1, 3, 3, device=d, requires_grad=True), None, 1, 1, 1, 8),
    "dense, channels-last weight": lambda d: F.conv2d(
        torch.randn(2, 4, 8, 8, device=d, requires_grad=True),
        torch.randn(6, 4, 3, 3, device=d).to(memory_format=torch.channels_last).requires_grad_(), None, 1, 1),
    # Swin: layer norm's backward gets a transposed output gradient; the kernels answer contiguous
    "layer norm, transposed gradient": lambda d: F.layer_norm(
        torch.randn(2, 8, 16, device=d, requires_grad=True), (16,)).transpose(1, 2).mean(-1),
    "1-d": lambda d: F.conv1d(torch.randn(2, 4, 16, device=d, requires_grad=True),
                              torch.randn(6, 4, 3, device=d, requires_grad=True), padding=1),
}


@pytest.mark.parametrize("case", sorted(CONV))
def test_convolution_on_meta_has_the_cpu_layout(case: str) -> None:
    _same_on_meta(CONV[case])


def test_the_cuda_glue_runs_on_meta_with_backward() -> None:
    """The CUDA branches (not comparable here: no GPU) at least run forward and backward on meta
    with the composite's output shape."""
    from autoremat.capture.device_parity import _run_backend

    for choice in (FLASH, EFFICIENT, CUDNN):
        q, k, v = (torch.empty(2, 4, 16, 12, device="meta", requires_grad=True) for _ in range(3))
        mask = torch.empty(2, 1, 16, 16, device="meta", dtype=torch.bool) if choice != FLASH else None
        out = _run_backend(choice, "cuda", q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=mask is None,
                           scale=None, enable_gqa=False)
        assert out.shape == q.shape
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["causal", "bool mask", "additive mask", "grouped-query", "no grad"])
def test_attention_on_meta_dispatches_the_cuda_ops(case: str) -> None:
    rec_cuda = _Ops()
    with rec_cuda:
        out = ATTENTION[case]("cuda")
        if out.requires_grad:
            out.sum().backward()
    rec_meta = _Ops()
    with as_device(torch.device("cuda")), rec_meta:
        out = ATTENTION[case]("meta")
        if out.requires_grad:
            out.sum().backward()
    assert rec_meta.ops == rec_cuda.ops


pytest.importorskip("transformers")

NODE_FIELDS = ("name", "out_bytes", "alloc_bytes", "alias_of", "saves", "extra_saved_bytes", "fwd_temp_bytes",
               "bwd_temp_bytes", "param_grad_bytes", "requires_grad", "is_output", "held_by_output",
               "grad_passthrough", "recomputable", "scope", "op_index")


def _same_graph_on_meta(name: str, use_cache: bool | None = None, device: str = "cpu") -> None:
    from autoremat.capture import capture
    from autoremat.capture.scaled import capture_within
    from autoremat.zoo.hf_breadth import build

    model, args, kwargs, loss = build(name)
    if use_cache is not None:
        model.config.use_cache = use_cache
    model = model.to(device)
    args = tuple(a.to(device) for a in args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    full = capture(model, args, kwargs, loss_fn=loss, times="flops")
    meta = capture_within(model, args, kwargs, limit_bytes=1, loss_fn=loss, times="flops")
    assert meta.meta.get("scaled") is None and meta.meta["time_source"] == "flops"  # the meta capture itself
    assert [meta.node(v)["name"] for v in meta.nodes] == [full.node(v)["name"] for v in full.nodes]
    for v in full.nodes:
        assert {f: meta.node(v)[f] for f in NODE_FIELDS} == {f: full.node(v)[f] for f in NODE_FIELDS}, v
    assert set(meta.nx.edges) == set(full.nx.edges)
    assert unoptimised_peak_bytes(meta) == unoptimised_peak_bytes(full)


@pytest.mark.parametrize("name, use_cache", [("qwen2", None), ("qwen2", False), ("segformer", None)])
def test_meta_capture_is_the_cpu_capture_node_for_node(name: str, use_cache: bool | None) -> None:
    """Qwen2 with its default key/value cache: flash attention on the CPU (was 317 nodes on meta
    against 230, peak 1.245x); without the cache (as trained with checkpointing) its mask code
    reads position ids (``autoremat.capture.shadow_values``; it could not run on meta before);
    SegFormer: a depthwise convolution's channels-last output (was 152 against 148 nodes: its
    next linear layer took another path)."""
    _same_graph_on_meta(name, use_cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "falcon", "bloom", "gemma", "gpt_neox", "gptj", "whisper", "clip",
                                  "deberta_v2", "bart", "phi3", "swin"])
def test_meta_capture_is_the_cpu_capture_node_for_node_slow(name: str) -> None:
    _same_graph_on_meta(name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, use_cache", [("qwen2", None), ("qwen2", False), ("segformer", None),
                                             ("whisper", None), ("gpt_neox", None)])
def test_meta_capture_is_the_cuda_capture_node_for_node(name: str, use_cache: bool | None) -> None:
    """On CUDA the attention backends are flash, memory-efficient or cuDNN attention, each with its
    own glue in the composite; the meta capture must match the CUDA capture as it matches the CPU's."""
    _same_graph_on_meta(name, use_cache, device="cuda")
