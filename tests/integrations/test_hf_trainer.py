"""The Hugging Face ``Trainer`` on a model patched by hand (``capture``, ``solve``, ``apply`` before the
``Trainer`` is built, as its users would): it trains exactly as the unpatched model, also when
``TrainingArguments(gradient_checkpointing=True)`` turns the model's own checkpointing on, which is
said once (:mod:`autoremat.runtime.own_checkpointing`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import autoremat
from autoremat.runtime.own_checkpointing import OwnCheckpointingWarning

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg).train()


def _train(model: torch.nn.Module, tmp_path: Path, checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                          report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True,
                                          gradient_checkpointing=checkpointing)
    out = transformers.Trainer(model=model, args=args, train_dataset=_Tokens()).train()
    return out.training_loss, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_trainer_trains_a_patched_model_exactly(tmp_path: Path) -> None:
    """With ``gradient_checkpointing=True`` (the unpatched reference without: the same step), the path
    with the most in it; without the flag nothing is said (``tests/runtime/test_own_checkpointing.py``)."""
    loss, state = _train(_model(), tmp_path / "plain", False)
    model = _model()
    ids = _Tokens().ids[:4]
    graph = autoremat.capture(model, (), {"input_ids": ids, "labels": ids}, loss_fn=lambda o: o.loss)
    plan = autoremat.solve(graph, "min")
    assert plan.recomputed_nodes or plan.module_calls
    autoremat.apply(model, plan)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        patched_loss, patched_state = _train(model, tmp_path / "patched", True)
    said = [w for w in got if issubclass(w.category, OwnCheckpointingWarning)]
    assert len(said) == 1
    assert patched_loss == loss
    assert set(patched_state) == set(state) and all(torch.equal(state[k], patched_state[k]) for k in state)
    assert autoremat.is_patched(model)
