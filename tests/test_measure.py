"""Tests for autoremat.measure: the live-storage counter, measure(), default_loss, gradients."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from autoremat.measure import (
    LiveStorageCounter,
    Measurement,
    default_loss,
    gradients,
    gradients_equal,
    measure,
    run_step,
)


# ---------------------------------------------------------------------- LiveStorageCounter
class TestLiveStorageCounter:
    def test_counts_a_known_allocation_exactly(self):
        counter = LiveStorageCounter()
        with counter:
            t = torch.empty(1000, dtype=torch.float32)
            assert counter.live == 4000
            u = torch.zeros(10, dtype=torch.float64)
            assert counter.live == 4080
            del t
            gc.collect()
            assert counter.live == 80
            del u
            assert counter.live == 0
        assert counter.peak == 4080

    def test_views_and_inplace_add_nothing(self):
        counter = LiveStorageCounter()
        with counter:
            t = torch.ones(100, dtype=torch.float32)
            assert counter.live == 400
            views = [t.view(10, 10), t[10:], t.reshape(4, 25), t.view(10, 10).t(), t.unsqueeze(0)]
            t.add_(1)
            t.mul_(2.0)
            views[0].zero_()
            assert counter.live == 400
            assert counter.peak == 400
            del views
        assert counter.live == 400

    def test_storages_created_before_entering_are_not_counted(self):
        x = torch.randn(1000)
        counter = LiveStorageCounter()
        with counter:
            x.add_(1)
            w = x[3:]
            assert counter.live == 0
            y = x + 1  # a new storage
            assert counter.live == 4000
            del x, w  # freeing a storage that was never counted changes nothing
            gc.collect()
            assert counter.live == 4000
            del y
            assert counter.live == 0
        assert counter.peak == 4000

    def test_multiple_outputs(self):
        counter = LiveStorageCounter()
        with counter:
            values, indices = torch.sort(torch.randn(100))
            # randn's 400 bytes were freed once sort returned; sort: 400 (float32) + 800 (int64)
            assert counter.live == 1200
            del values
            assert counter.live == 800
            del indices
        assert counter.live == 0
        assert counter.peak == 1600  # randn's input and both outputs, at the moment sort returned

    def test_reset_peak(self):
        counter = LiveStorageCounter()
        with counter:
            a = torch.empty(250)
            b = torch.empty(250)
            del b
            assert counter.peak == 2000 and counter.live == 1000
            counter.reset_peak()
            assert counter.peak == 1000
            c = torch.empty(10)
            assert counter.peak == 1040
            del a, c

    def test_on_op_hook(self):
        counter = LiveStorageCounter()
        seen = []
        counter.on_op = lambda func, args, kwargs, out: seen.append((str(func), type(out).__name__))
        with counter:
            t = torch.empty(3)
            torch.sort(t)
        assert [name for name, _ in seen] == ["aten.empty.memory_format", "aten.sort.default"]
        assert seen[0][1] == "Tensor"

    def test_backward_is_counted(self):
        lin = nn.Linear(16, 8)
        x = torch.randn(4, 16)
        counter = LiveStorageCounter()
        with counter:
            lin(x).sum().backward()
        # weight and bias gradients outlive the step: (16 * 8 + 8) * 4 bytes
        assert counter.live == (16 * 8 + 8) * 4
        # the output (4 x 8 floats) was live in forward; the scalar loss and its seed gradient
        # are live while the parameter gradients are made
        assert counter.peak >= 4 * 8 * 4
        assert counter.peak >= counter.live + 8


# ---------------------------------------------------------------------- measure()
def test_measure_small_linear():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    m = measure(model, (x,), steps=3, warmup=1)
    assert isinstance(m, Measurement)
    assert m.device == "cpu"
    # parameter gradients alone are (8 * 4 + 4) * 4 = 144 bytes; the step cannot exceed a few
    # small tensors on top of them
    assert 144 <= m.peak_bytes <= 400
    assert m.step_time_s > 0 and len(m.step_times_s) == 3
    assert min(m.step_times_s) <= m.step_time_s <= max(m.step_times_s)
    assert all(p.grad is None for p in model.parameters())  # measure leaves no gradients behind


def test_measure_is_repeatable_and_scales_with_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    small = measure(model, (torch.randn(4, 32),), steps=1, warmup=0)
    again = measure(model, (torch.randn(4, 32),), steps=1, warmup=0)
    big = measure(model, (torch.randn(64, 32),), steps=1, warmup=0)
    assert small.peak_bytes == again.peak_bytes
    assert big.peak_bytes > small.peak_bytes


def test_measure_with_loss_fn_and_kwargs():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale=1.0):
            return {"y": self.lin(x) * scale, "n": torch.tensor(3)}

    calls = []

    def loss_fn(out):
        calls.append(1)
        return out["y"].pow(2).sum()

    m = measure(Two(), (torch.randn(2, 4),), {"scale": 2.0}, loss_fn=loss_fn, steps=2, warmup=1)
    assert len(calls) >= 3  # warmup + timed steps (+ a counted step on the CPU)
    assert m.peak_bytes >= (16 + 4) * 4


def test_measure_rejects_non_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        measure(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="str"):
        measure("model", (torch.randn(2),))


@pytest.mark.parametrize(("steps", "warmup"), [(0, 1), (-1, 0), (1, -1)])
def test_measure_rejects_bad_steps(steps, warmup):
    with pytest.raises(ValueError, match="steps"):
        measure(nn.Linear(2, 2), (torch.randn(1, 2),), steps=steps, warmup=warmup)


# ---------------------------------------------------------------------- default_loss, run_step
def test_default_loss_sums_means_of_nested_outputs():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(2, 2, requires_grad=True)
    c = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = {"a": a, "rest": [b, (c, torch.tensor([1, 2, 3])), "text"], "frozen": torch.ones(5)}
    loss = default_loss(out)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    expected = a.mean() + b.mean() + c.float().mean()
    assert torch.allclose(loss, expected)
    loss.backward()
    assert torch.allclose(a.grad, torch.full((3,), 1 / 3))
    assert torch.allclose(c.grad, torch.full((4,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize(
    "output",
    [torch.tensor([1, 2, 3]), torch.randn(3), (torch.randn(2), torch.arange(3)), {"x": 1.0}, None, []],
)
def test_default_loss_without_grad_tensors_errors_clearly(output):
    with pytest.raises(ValueError, match="loss_fn="):
        default_loss(output)


def test_run_step_sets_fresh_gradients():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    loss = run_step(model, (x,))
    assert not loss.requires_grad
    first = gradients(model)
    run_step(model, (x,))  # gradients are reset, not accumulated
    assert gradients_equal(first, gradients(model))
    expected = nn.functional.linear(x, model.weight, model.bias).mean()
    assert torch.equal(loss, expected.detach())


# ---------------------------------------------------------------------- gradients
def test_gradients_copies_and_equal():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[1].bias.requires_grad_(False)
    run_step(model, (torch.randn(4, 3),))
    g = gradients(model)
    assert set(g) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert g["1.bias"] is None
    assert gradients_equal(g, g)
    assert gradients_equal(g, gradients(model))
    model[0].weight.grad.add_(1.0)  # the copies are independent of the model
    assert not gradients_equal(g, gradients(model))


def test_gradients_equal_cases():
    t = torch.tensor([1.0, 2.0])
    assert gradients_equal({"a": t, "b": None}, {"a": t.clone(), "b": None})
    assert not gradients_equal({"a": t}, {"a": t + 1e-7})  # bit-for-bit, not approximately
    assert not gradients_equal({"a": t}, {"b": t})
    assert not gradients_equal({"a": t}, {"a": t, "b": t})
    assert not gradients_equal({"a": t}, {"a": None})
    assert not gradients_equal({"a": None}, {"a": t})
    assert not gradients_equal({"a": t}, {"a": t.double()})
    assert gradients_equal({}, {})


# ---------------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_measure_on_cuda():
    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    m = measure(model, (x,), steps=2, warmup=1)
    assert m.device.startswith("cuda")
    assert m.peak_bytes >= (256 * 256 + 256) * 4  # parameter gradients at least
    assert m.step_time_s > 0


def test_default_loss_walks_dataclasses():
    """Issue 29 item 11: the docstring promised dataclass-like objects; dataclasses were skipped."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict

    a = torch.ones(2, 3, requires_grad=True)
    b = torch.full((4,), 2.0, requires_grad=True)
    assert default_loss(Out(a, {"b": b})).item() == 3.0


def test_live_storage_counter_counts_storage_resizes() -> None:
    """FSDP frees and re-allocates unsharded parameters by resizing their storage, outside the
    dispatcher: with ``track_resizes`` the counter sees it (also for a storage older than the
    mode), and ``UntypedStorage.resize_`` is put back on exit."""
    before = torch.empty(1000)  # 4000 bytes, existing before the mode
    original = torch.UntypedStorage.__dict__.get("resize_")
    with LiveStorageCounter(track_resizes=True) as counter:
        before.untyped_storage().resize_(0)
        assert counter.live == -4000
        before.untyped_storage().resize_(4000)
        assert counter.live == 0
        grown = torch.empty(10)
        grown.untyped_storage().resize_(400)
        assert counter.live == 400 and counter.peak == 400
        del grown
        gc.collect()
        assert counter.live == 0
    assert torch.UntypedStorage.__dict__.get("resize_") is original
    with LiveStorageCounter() as plain:  # the default does not patch anything
        before.untyped_storage().resize_(0)
        assert plain.live == 0
    before.untyped_storage().resize_(4000)


def test_deterministic_kernels_hold_inside_the_block_and_are_restored() -> None:
    from autoremat.measure import deterministic_kernels

    was = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
           torch.backends.cudnn.benchmark)
    with deterministic_kernels():
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark) == was


def test_op_tensors_finds_what_tree_flatten_finds_in_op_arguments() -> None:
    """The dispatch modes' fast flatten: the tensors of ATen-op arguments and results, in order."""
    from torch.utils._pytree import tree_flatten

    from autoremat.measure import op_tensors

    a, b, c = torch.ones(2), torch.zeros(3), torch.ones(1)
    cases = [a, (a, 2, None), ([a, b], 1.5, torch.float32), ((a, [b, (c,)]), {"out": c, "alpha": 2}), (), 3, None,
             ((a,), {"dim": [0, 1], "x": [None, b]})]
    for obj in cases:
        want = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
        got = op_tensors(obj)
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), obj


def test_default_loss_is_the_outputs_own_loss_where_it_carries_one():
    """A Hugging Face model given ``labels`` returns its loss beside the logits; its users
    backpropagate ``outputs.loss``, so the default does too (before: ``loss + logits.mean()``,
    which seeded a second, dense gradient into the logits)."""
    import dataclasses

    logits = torch.randn(2, 3, requires_grad=True)
    loss = (logits * 2).sum()
    for out in ({"loss": loss, "logits": logits}, dataclasses.make_dataclass("Out", ["loss", "logits"])(loss, logits)):
        assert default_loss(out) is loss
    no_grad = {"loss": torch.tensor(1.0), "logits": logits}  # a loss that requires no grad is not the step's
    assert torch.equal(default_loss(no_grad), logits.mean())
    per_row = {"loss": logits.sum(1), "logits": logits}  # not one element: the sum of means, as before
    assert torch.allclose(default_loss(per_row), logits.sum(1).mean() + logits.mean())


def test_default_loss_predicts_a_transformers_step_that_backpropagates_outputs_loss():
    """The capture's default loss is the step users run (``model(ids, labels=ids).loss``): GPT-2's
    unpatched step was predicted 12 % above the measured one when the default added
    ``logits.mean()`` (x86_64 CPU; Llama 21 %, BERT 15 %), now exactly."""
    transformers = pytest.importorskip("transformers")
    import autoremat
    from autoremat.cost import unoptimised_peak_bytes

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 512, (2, 32))
    real = measure(model, (ids,), {"labels": ids}, loss_fn=lambda o: o.loss, steps=1, warmup=0)
    graph = autoremat.capture(model, (ids,), {"labels": ids}, mode="module", repeats=1, warmup=0)
    assert unoptimised_peak_bytes(graph) == pytest.approx(real.peak_bytes, rel=0.01)
