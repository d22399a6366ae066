"""LayerDrop: a model that skips layers at random is profiled in the step in which every layer
runs, so a plan's prediction holds in every step; a skipped block autoremat cannot account for is
named in a warning (:mod:`autoremat.capture.layer_drop`)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import autoremat
from autoremat.capture.layer_drop import every_layer
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal


class _Drop(nn.Module):
    """Blocks skipped with probability ``p``, drawn in forward as ``transformers`` does;
    ``knob`` names the attribute holding it."""

    def __init__(self, knob: str, p: float = 0.5, depth: int = 6) -> None:
        super().__init__()
        self.knob = knob
        setattr(self, knob, p)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(depth))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < getattr(self, self.knob):
                continue
            x = x + layer(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[int, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    counter = LiveStorageCounter()
    with counter:
        _loss(model(x)).backward()
    return counter.peak, gradients(model)


def _skipping_seed(model: _Drop) -> int:
    """A seed whose first step skips a layer (so a capture of that step alone would miss it)."""
    for seed in range(100):
        torch.manual_seed(seed)
        if any(float(torch.rand([])) < 0.5 for _ in model.layers):
            return seed
    raise AssertionError("no seed skips a layer")


@pytest.mark.parametrize("knob", ["layerdrop", "layer_drop"])
def test_the_capture_holds_every_layer_and_plans_hold_in_steps_that_skip(knob: str) -> None:
    torch.manual_seed(0)
    model, x = _Drop(knob), torch.randn(128, 64)
    torch.manual_seed(_skipping_seed(model))
    graph = autoremat.capture(model, (x,), loss_fn=_loss, times="flops")
    assert getattr(model, knob) == 0.5  # restored
    assert graph.meta["mode"] == "module"
    ran = {graph.node(v)["name"].split(":")[0].rsplit(".", 1)[0] for v in graph.nodes}
    assert {f"layers.{i}" for i in range(6)} <= ran
    unpatched = simulate(graph, no_recompute_plan(graph)).peak_bytes
    plan = autoremat.solve(graph, "min")
    patched = copy.deepcopy(model)
    autoremat.apply(patched, plan)
    skipped_somewhere = False
    for seed in range(5):
        torch.manual_seed(seed)
        skipped_somewhere |= any(float(torch.rand([])) < 0.5 for _ in model.layers)
        peak, want = _step(model, x, seed)
        assert peak <= unpatched
        patched_peak, got = _step(patched, x, seed)
        assert patched_peak <= plan.predicted_peak_bytes
        assert gradients_equal(want, got)
    assert skipped_somewhere


def test_a_skip_under_another_name_is_a_warning_naming_the_blocks(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, x = _Drop("skip_p"), torch.randn(16, 64)
    torch.manual_seed(_skipping_seed(model))
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        autoremat.capture(model, (x,), loss_fn=_loss, times="flops")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "the profiled step did not run layers." in text and "of the 6 blocks of layers" in text
    assert "LayerDrop" in text


def test_every_layer_restores_the_settings_when_the_block_raises() -> None:
    pytest.importorskip("transformers")
    import transformers as T
    config = T.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          max_position_embeddings=32, encoder_layerdrop=0.2, decoder_layerdrop=0.3)
    model = T.BartForConditionalGeneration(config)
    with pytest.raises(RuntimeError, match="inside"):
        with every_layer(model) as said:
            assert model.model.encoder.layerdrop == 0.0 and model.model.decoder.layerdrop == 0.0
            assert model.config.encoder_layerdrop == 0.0 and model.config.decoder_layerdrop == 0.0
            assert len(said) == 4
            raise RuntimeError("inside")
    assert (model.model.encoder.layerdrop, model.model.decoder.layerdrop) == (0.2, 0.3)
    assert (model.config.encoder_layerdrop, model.config.decoder_layerdrop) == (0.2, 0.3)


def test_hubert_with_layerdrop_is_predicted_in_every_step() -> None:
    pytest.importorskip("transformers")
    import transformers as T
    torch.manual_seed(0)
    config = T.HubertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                            ctc_loss_reduction="mean", pad_token_id=0, layerdrop=0.5)
    model = T.HubertForCTC(config).train()
    kwargs = {"input_values": torch.randn(2, 2000), "labels": torch.randint(1, 32, (2, 12))}

    def loss(out):
        return out.loss

    torch.manual_seed(1)  # this step's draws skip layer 0 (and 2)
    graph = autoremat.capture(model, (), kwargs, loss_fn=loss, times="flops")
    assert model.config.layerdrop == 0.5
    names = " ".join(graph.node(v)["name"] for v in graph.nodes)
    assert all(f"encoder.layers.{i}" in names for i in range(3))
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    for seed in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        counter = LiveStorageCounter()
        with counter:
            loss(model(**kwargs)).backward()
        assert counter.peak <= predicted
