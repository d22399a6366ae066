"""A module call's own saved tensors offloaded as one unit (``Plan.offload_saved``,
:mod:`autoremat.runtime.offload_saved`) on a Hugging Face GPT-2 captured with one node per block.

On the CPU the runtime is exact bookkeeping: the bytes of each unit are the capture's
``extra_saved_bytes`` (parameters, inputs and outputs stay out of it), backward first uses and
prefetches the units in the plan's order, and gradients are ``torch.equal`` to the unpatched
model's. With the host tier the measured peak is the simulator's at an unbounded link. The GPU
check at the end (``-m gpu``) measures real copies.
"""

from __future__ import annotations

import pytest
from _offloaded import measured_with_host_tier, offloaded_step
import torch

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.errors import PlanMismatchError
from autoremat.plan import Plan, offloadable_nodes, saved_unit_nodes
from autoremat.runtime import offloader_of
from autoremat.solvers import finalize_plan

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402

_CASE: dict[str, autoremat.Graph] = {}


def gpt2_case(**size):
    """A GPT-2 small config (3 blocks, 32 wide), its batch and its module-level capture (one node
    per block; captured once per size)."""
    model = hf.gpt2(n_layer=3, n_embd=32, n_head=2, vocab_size=64, seq=32, **size)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    key = repr(sorted(size.items()))
    if key not in _CASE:
        _CASE[key] = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean, repeats=1, warmup=0, blocks="module")
    return model, (ids,), _CASE[key]


def units_plan(g: autoremat.Graph, *, outputs: bool = False, depth: int = 1) -> Plan:
    base = no_recompute_plan(g)
    offload = tuple(sorted(offloadable_nodes(g, base))) if outputs else ()
    return finalize_plan(g, Plan(list(base.segments), offload=offload, offload_prefetch_depth=depth,
                                 offload_saved=tuple(sorted(saved_unit_nodes(g, base)))), 10**15, "manual")


@pytest.mark.parametrize("outputs", [False, True])
def test_each_blocks_saved_tensors_go_as_one_unit_as_simulated(outputs: bool):
    """Every block's (and the dropout's, ln_f's) own saved tensors, alone and together with every
    node output the plan keeps: gradients equal; each unit moves exactly the capture's
    ``extra_saved_bytes`` (parameters and the block's input are left out: their bytes are
    counted apart); first uses, prefetches and forward waits in the plan's order."""
    model, args, g = gpt2_case()
    plan = units_plan(g, outputs=outputs)
    blocks = [v for v in plan.offload_saved if g.node(v)["kind"] == "gpt2block"]
    assert len(blocks) == 3 and (bool(plan.offload) == outputs)
    stats = offloaded_step(model, args, plan, loss_fn=hf.logits_mean)
    sim = simulate(g, plan)
    assert stats.unit_bytes == {v: g.node(v)["extra_saved_bytes"] for v in plan.offload_saved}
    assert all(stats.unit_left_bytes[v] > 0 for v in blocks)  # weights and the block's input: not copied
    params = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    block0 = sum(b for n, b in params.items() if n.startswith("transformer.h.0."))
    assert stats.unit_left_bytes[blocks[0]] >= block0 // 2  # save_on_cpu would copy these every step
    assert stats.packed_bytes == sim.offloaded_bytes
    assert sim.offload_order == list(plan.offload_order)
    # first uses: the plan's order, except that a storage a node saves and that node's own unit are
    # first used by the same backward, where autograd's order of unpacking decides: the simulator
    # takes the unit first (a block's first op saved its input and runs last in backward), ln_f
    # (one LayerNorm) unpacks its input first. Prefetches follow the plan's order, less a storage
    # first used out of that order (fetched at its use).
    assert sorted(stats.fetched_nodes) == sorted(sim.offload_order)
    assert [first_use(g, u) for u in stats.fetched_nodes] == [first_use(g, u) for u in sim.offload_order]
    assert stats.prefetched_nodes == [u for u in plan.offload_order if u in stats.prefetched_nodes]
    if not outputs:
        assert stats.fetched_nodes == stats.prefetched_nodes == list(plan.offload_order)
    order = {v: i for i, v in enumerate(v for seg in plan.segments for v in seg.nodes)}
    assert stats.waits == sorted(plan.offload_waits.items(), key=lambda kv: order[kv[0]])
    assert "forward" not in model.__dict__ and all("forward" not in m.__dict__ for m in model.modules())


def first_use(g: autoremat.Graph, u: int) -> int:
    """The node whose backward first uses unit ``u`` (nothing recomputed): its own node for a
    node's saved tensors, else the last node in forward that saves the storage."""
    return -1 - u if u < 0 else max(w for w in g.nodes if u in {g.root(x) for x in g.node(w)["saves"]})


@pytest.mark.parametrize("depth", [1, 2])
def test_measured_peak_with_the_host_tier_is_the_simulators(depth: int):
    """Copies that complete at once (the CPU's host tier): the units leave the counted memory when
    their block returns, come back into one buffer per storage when prefetched, and each buffer is
    freed when autograd releases its last saved tensor (as without the offload). The measured peak
    is the prediction at an unbounded link (within 1 %), and well below the step without offload.
    (A first version kept every tensor of a unit alive until the block's backward ended, through
    the pack hook autograd keeps with each saved tensor: 872,712 B measured against 733,440 B.)"""
    model, args, g = gpt2_case()
    plan = units_plan(g, depth=depth)
    predicted = simulate(g, plan, bandwidth_bytes_per_s=1e18).peak_bytes
    without = simulate(g, no_recompute_plan(g)).peak_bytes
    measured = measured_with_host_tier(model, args, plan, loss_fn=hf.logits_mean)
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted, without)
    assert measured < (0.8 if depth == 1 else 1.0) * without  # depth 2 reserves two blocks ahead of three


def test_outside_a_training_step_the_block_runs_as_it_is():
    """Under no_grad, eval, and after restore the wrapped blocks run their own forward (no unit)."""
    model, args, g = gpt2_case()
    plan = units_plan(g)
    torch.manual_seed(0)  # dropout
    reference = model(*args).logits
    autoremat.apply(model, plan)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            out = model(*args).logits
        assert torch.equal(out, reference.detach()) and not offloader_of(model).stats.unit_bytes
    finally:
        autoremat.restore(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_plan_offloading_saved_tensors_of_an_fx_capture_is_refused():
    model, args = autoremat.zoo.build("mlp", batch_size=2)
    g = autoremat.capture(model, args, repeats=1, warmup=0)
    plan = finalize_plan(g, Plan(list(no_recompute_plan(g).segments)), 10**15, "manual")
    plan.offload_saved = (1,)
    with pytest.raises(PlanMismatchError, match="offload_saved"):
        autoremat.apply(model, plan)
    assert "forward" not in model.__dict__


class _Block(torch.nn.Module):
    """Saves tensors of its own (tanh's output, a dropout mask) and its own output (ReLU)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(self.drop(torch.tanh(self.a(x)))))


def test_a_call_whose_output_is_offloaded_too_and_saved_by_itself():
    """A plain module captured at module level: each block saves its own output (ReLU) and
    tensors of its own. Both offloaded: the output's own save waits in the offloader's window for
    the output's mark and joins the output's host copy (not the unit); the unit holds the rest.
    Gradients equal (dropout reproduced), bytes and order as simulated, host-tier peak as predicted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(32) for _ in range(4)], torch.nn.Linear(32, 4))
    x = torch.randn(16, 32)
    g = autoremat.capture(model, (x,), mode="module", repeats=1, warmup=0, blocks="module")
    blocks = [v for v in g.nodes if g.node(v)["module_path"] in {"0", "1", "2", "3"}]
    assert all(v in g.node(v)["saves"] and g.node(v)["extra_saved_bytes"] > 0 for v in blocks)
    plan = units_plan(g, outputs=True)
    assert set(blocks) <= set(plan.offload) & set(plan.offload_saved)
    stats = offloaded_step(model, (x,), plan)
    sim = simulate(g, plan)
    assert stats.unit_bytes == {v: g.node(v)["extra_saved_bytes"] for v in plan.offload_saved}
    assert stats.packed_bytes == sim.offloaded_bytes
    assert sorted(stats.fetched_nodes) == sorted(sim.offload_order)
    base = no_recompute_plan(g)
    predicted = simulate(g, plan, bandwidth_bytes_per_s=1e18).peak_bytes
    measured = measured_with_host_tier(model, (x,), plan)
    # within 10 % (the bound of the other CPU prediction tests), and never above: the simulator
    # counts every storage a node's backward reads as first used when that backward starts, so the
    # next prefetch is reserved during all of it; autograd unpacks a block's input (saved by its
    # first op) at the end of the block's backward, and the prefetch it starts comes later
    # (measured 77,592 B against 83,984 B predicted)
    assert 0.9 * predicted <= measured <= predicted, (measured, predicted)
    assert measured < simulate(g, base).peak_bytes


class _SeedOnAnotherDevice(torch.autograd.Function):
    """Saves, beside its input, a scalar on another device than the call's, as memory-efficient
    attention saves its CPU random seed in a CUDA call (here a meta tensor in a CPU call)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, torch.empty((), dtype=torch.int64, device="meta"))
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        x, seed = ctx.saved_tensors
        assert seed.device.type == "meta", seed.device  # given back as it was saved
        return 2 * x * grad


class _SeededBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_SeedOnAnotherDevice.apply(self.a(x)))


def test_a_saved_tensor_on_another_device_stays_out_of_the_unit():
    """A unit is copied to the host and fetched back to the call's device: a saved tensor on
    another device (the CPU seed of CUDA attention) stays as it is. Before, it went into the unit
    and came back on the call's device (here: the host copy failed on the meta tensor). On an H200
    a GPT-2 plan with units crashed its process (segmentation fault); a CPU seed fetched back as a
    CUDA tensor is the suspected cause, not yet confirmed on a GPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_SeededBlock(16) for _ in range(3)], torch.nn.Linear(16, 2))
    x = torch.randn(8, 16)
    g = autoremat.capture(model, (x,), mode="module", repeats=1, warmup=0, blocks="module")
    plan = units_plan(g)
    assert plan.offload_saved
    stats = offloaded_step(model, (x,), plan)
    # the capture counts the seed's 8 bytes among the block's saved bytes; the unit leaves it out
    assert stats.unit_bytes == {v: g.node(v)["extra_saved_bytes"] - 8 for v in plan.offload_saved}
    measured_with_host_tier(model, (x,), plan)  # the host copy: no meta tensor in it


def test_a_plan_naming_a_glue_op_is_refused_and_nothing_is_patched():
    """``offload_saved`` naming a node that is not a module call (a glue op here; validate_plan
    refuses it too): apply raises before the model is patched, and a failure part-way is rolled
    back."""
    model, args, g = gpt2_case()
    plan = units_plan(g)
    glue = max(v for v in g.nodes if g.node(v)["kind"] == "glue")  # after the blocks: wrapped first
    plan.offload_saved = (*plan.offload_saved, glue)
    plan.offload_order = ()
    with pytest.raises(PlanMismatchError, match="not a module call"):
        autoremat.apply(model, plan)
    assert all("forward" not in m.__dict__ for m in model.modules()) and offloader_of(model) is None
