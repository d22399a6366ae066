"""Steps whose structure is drawn at random: LayerDrop, profiled with every layer.

The speech models of ``transformers`` (wav2vec2, HuBERT, WavLM, SEW, Data2VecAudio, UniSpeech:
``config.layerdrop``, 0.1 by default), its encoder-decoders (``encoder_layerdrop`` /
``decoder_layerdrop``, kept on the encoder and decoder as ``layerdrop``) and torchaudio's wav2vec2
(``layer_drop``) skip each layer of a training step with a probability, drawn in ``forward``
(``torch.rand([]) < layerdrop``). fx cannot trace that branch, so these models are captured at
module level, which records one step: the layers that step's draws skipped were missing from the
graph, and a later step that ran them peaked far above the plan's prediction (measured on the CPU:
HF HuBERT with 2 layers, layer 0 skipped in the recorded step: unpatched step predicted 7.43 MB,
measured 12.87 MB, 0.58x).

:func:`every_layer` profiles the step in which every layer runs, the largest of the steps the
model can take: it sets the LayerDrop settings it knows (:data:`KNOBS` above 0, as attributes of
modules and of the ``config`` objects they hold) to 0 for the module-level capture and restores
them after, whether the capture succeeds or raises. Decision: not for the fx trace, which would
bake "no layer skipped" into the graph module that runs after :func:`~autoremat.apply` (the trace
of such a model fails on the draw anyway and falls back to module level). The draws still happen
(the models draw before comparing), so the generator advances as in the user's steps. A plan for
that step holds in the steps that skip layers: a skipped layer's calls, recomputed or not, do not
run and hold nothing (measured: HuBERT with 4 layers at ``layerdrop=0.5``, six seeds, the 50 % and
the least plans: every step's peak at or under the prediction, gradients equal to the model's).

:func:`warn_skipped`: a member of a ``ModuleList`` of blocks the recorded step did not run while
a sibling ran is logged as a warning, with the reason the prediction may not hold: a LayerDrop
under a name autoremat does not know, or a mixture of experts whose router sent no token to an
expert (a later step that does holds that expert's activations too).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

from torch import nn

__all__ = ["KNOBS", "every_layer", "warn_skipped"]

logger = logging.getLogger("autoremat")

KNOBS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "layer_drop")
"""The attribute names of the LayerDrop probabilities :func:`every_layer` sets to 0."""


def _holders(model: nn.Module) -> list[object]:
    """The model's modules and the distinct ``config`` objects they hold, each once."""
    seen: dict[int, object] = {}
    for mod in model.modules():
        seen.setdefault(id(mod), mod)
        config = mod.__dict__.get("config")
        if config is not None and not isinstance(config, (dict, str, int, float)):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def every_layer(model: nn.Module) -> Iterator[list[str]]:
    """Every LayerDrop probability of ``model`` (:data:`KNOBS`) at 0 inside the block, restored
    after it; yields what was set, as ``"<owner>.<name>=<value>"`` (logged at info level)."""
    changed: list[tuple[object, str, float]] = []
    for owner in _holders(model):
        for name in KNOBS:
            value = getattr(owner, "__dict__", {}).get(name)
            if isinstance(value, float) and value > 0.0:
                changed.append((owner, name, value))
    said = [f"{type(owner).__name__}.{name}={value}" for owner, name, value in changed]
    try:
        for owner, name, _value in changed:
            setattr(owner, name, 0.0)
        if said:
            logger.info("autoremat: profiling the step in which every layer runs: LayerDrop set to 0 while "
                        "capturing (%s), restored after; a plan for that step holds when layers are skipped",
                        ", ".join(said))
        yield said
    finally:
        for owner, name, value in changed:
            setattr(owner, name, value)


def warn_skipped(model: nn.Module, node_paths: Sequence[str], calls: Mapping[str, int]) -> list[str]:
    """Log and return the members of a ``ModuleList`` (of the node modules ``node_paths``) the
    recorded step did not call while a sibling was called (``calls``: path -> calls)."""
    lists = {name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    groups: dict[str, list[str]] = {}
    for path in node_paths:
        parent = path.rpartition(".")[0]
        if parent in lists:
            groups.setdefault(parent, []).append(path)
    skipped = []
    for parent, members in groups.items():
        ran = [p for p in members if calls.get(p, 0)]
        if ran and len(ran) < len(members):
            missed = [p for p in members if not calls.get(p, 0)]
            skipped += missed
            logger.warning(
                "autoremat: the profiled step did not run %s (%d of the %d blocks of %s): if the model skips "
                "layers at random (LayerDrop under a name autoremat does not set to 0 while profiling: %s) or "
                "routes by its input (an expert no token reached), a step that runs them holds more than the "
                "plan predicts; set the skipping probability to 0 for the capture, or give the budget room",
                ", ".join(missed[:3]) + (" and more" if len(missed) > 3 else ""), len(missed), len(members),
                parent, "/".join(KNOBS))
    return skipped
