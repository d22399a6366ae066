"""Nodes no gradient reaches (:mod:`autoremat.capture.dead_nodes`): an encoder whose output only
picks integer codes, as in the Hugging Face ``EncodecModel``.

Autograd records the encoder (its parameters require gradients) and frees it, saved tensors and
all, when the model drops it: its backward never runs. Modelled as ordinary nodes, its saves stayed
to that backward: the unpatched step of the network below was predicted well above its measured
peak (Encodec: 1.78x). Now its nodes take no part in backward, what they save counts while it lives
(lingering bytes), and a plan that recomputes the encoder's blocks frees it (a checkpointed block
saves nothing).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _codec import Codec
from _stacked import measured_under, predicted_and_measured
from torch import nn
from torch.nn import functional as F

import autoremat
from autoremat.capture.dead_nodes import dead_nodes
from autoremat.capture._recorder import NodeRecord
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter
from autoremat.plan import Plan, Segment
from autoremat.solvers import finalize_plan


@pytest.fixture
def codec() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Codec(), torch.randn(2, 1, 512)


def test_the_encoder_takes_no_part_in_backward_and_the_step_is_predicted(codec):
    model, x = codec
    graph, predicted, measured = predicted_and_measured(model, x, None)
    encoder = [v for v in graph.nodes if graph.node(v)["module_path"].startswith(("inp", "encoder"))]
    assert encoder and not any(graph.node(v)["requires_grad"] for v in encoder)
    assert any(graph.node(v)["unreached_saves"] for v in encoder)
    assert not any(graph.node(v)["saves"] for v in encoder)
    decoder = [v for v in graph.nodes if graph.node(v)["module_path"].startswith("decoder")]
    assert any(graph.node(v)["saves"] for v in decoder)
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


class _Dropping(Codec):
    """The codes are taken in ``forward`` itself, which drops the encoder's output before decoding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        z = h.transpose(1, 2)
        codes = (z.pow(2).sum(-1, keepdim=True) - 2 * z @ self.codebook.t()).argmin(-1)
        del h, z
        q = F.embedding(codes, self.codebook).transpose(1, 2)
        for block in self.decoder:
            q = block(q)
        return self.out(q)


@pytest.mark.parametrize("dropping", [False, True])
def test_capture_records_where_the_encoders_graph_is_freed(codec, dropping):
    """``decode`` holds the encoder's output in its frame to the end of the forward, so the graph dies
    after the last node; taken apart in ``forward``, after the codes (``argmin``)."""
    _, x = codec
    torch.manual_seed(0)
    graph = autoremat.capture(_Dropping() if dropping else Codec(), (x,), loss_fn=torch.sum, mode="module",
                              times="flops")
    encoder = {v for v in graph.nodes if graph.node(v)["module_path"].startswith(("inp", "encoder"))}
    released = dict(graph.meta["dead_released_after"])
    assert encoder <= set(released) and len(set(released.values())) == 1
    at = released.popitem()[1]
    if dropping:
        assert graph.node(at)["name"].endswith("argmin.default"), graph.node(at)["name"]
    else:
        assert at == len(graph) - 1


def test_recomputing_the_encoder_blocks_frees_what_they_hold(codec):
    model, x = codec
    graph, unpatched, _ = predicted_and_measured(model, x, None)
    regions = graph.call_regions()
    blocks = [regions[f"encoder.{i}"] for i in range(3)]
    segs, at = [], 0
    for nodes in blocks:
        if nodes[0] > at:
            segs.append(Segment(tuple(range(at, nodes[0])), False))
        segs.append(Segment(tuple(nodes), True))
        at = nodes[-1] + 1
    segs.append(Segment(tuple(range(at, len(graph))), False))
    plan = finalize_plan(graph, Plan(segs, graph_fingerprint=graph.fingerprint), 10**15, "manual")
    predicted, measured = simulate(graph, plan).peak_bytes, measured_under(model, x, plan)
    assert predicted < unpatched
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


def test_the_least_plan_holds_its_prediction(codec):
    model, x = codec
    _, unpatched, _ = predicted_and_measured(model, x, None)
    _, predicted, measured = predicted_and_measured(model, x, "min")
    assert predicted < unpatched
    assert measured <= predicted * 1.01, (predicted, measured)


def test_a_view_with_no_reader_follows_its_root():
    """Readers link to a storage's owner, so a view without readers is no evidence: a live node's
    view is not dead; a dead node's is."""
    def rec(**kw):
        r = NodeRecord(name="", kind="op", target="", requires_grad=True)
        for k, val in kw.items():
            setattr(r, k, val)
        return r
    # 0 -> view 1 (no reader); 0 -> 2 (output); 3 -> view 4 (no reader), 3 read by nobody else
    nodes = [rec(), rec(alias_of=0), rec(is_output=True), rec(), rec(alias_of=3)]
    succs = {0: [1, 2], 3: [4]}
    root = lambda v: nodes[v].alias_of if nodes[v].alias_of is not None else v  # noqa: E731
    assert dead_nodes(nodes, succs, root) == {3, 4}


def test_under_bf16_the_encoders_weight_casts_count_to_the_end_of_the_forward(codec):
    """Autocast's cache holds the bf16 casts of the encoder's weights to the end of the forward; no
    save models that for a node no gradient reaches (0.990x with them counted to the end of their call)."""
    model, x = codec
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture(model, (x,), loss_fn=torch.sum, mode="module", times="flops")
    patched = copy.deepcopy(model)
    counter = LiveStorageCounter()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = patched(x).sum()
        loss.backward()
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert abs(predicted / counter.peak - 1) < 0.005, (predicted, counter.peak)


class _Returning(Codec):
    """Returns the encoder's output beside the decoded signal, as a model output the loss does not
    read (CLIP's vision tower under a text-only loss): the object holds the encoder's graph, saved
    tensors and all, until the loop drops it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encode(x)
        return self.decode(h), h


def test_what_a_returned_graph_holds_goes_where_the_plan_recomputes_its_holders():
    torch.manual_seed(0)
    model, x = _Returning(), torch.randn(2, 1, 512)
    loss = lambda out: out[0].sum()  # noqa: E731
    graph = autoremat.capture(model, (x,), loss_fn=loss, mode="module", times="flops")
    held = [v for v in graph.nodes if graph.node(v)["held_by_output"] and not graph.node(v)["requires_grad"]]
    assert held  # the encoder's saved storages, freed when the returned object is dropped
    for plan in (no_recompute_plan(graph), autoremat.solve(graph, "min")):
        patched = copy.deepcopy(model)
        if plan.recompute_segments:
            autoremat.apply(patched, plan)
        counter = LiveStorageCounter()
        with counter:
            loss(patched(x)).backward()
        predicted = simulate(graph, plan).peak_bytes
        assert abs(predicted / counter.peak - 1) < 0.01, (plan.describe(), predicted, counter.peak)
