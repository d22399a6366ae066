"""Options priced in their window (autoremat.cost.block_window) against whole simulated steps:
the chain model's terms are the same, on seeded random block chains (storages every block reads,
saved or not, several classes, fx and module level) and on a Hugging Face capture."""

from __future__ import annotations

import random

import pytest

from _graphs import block_chain, with_held_outputs
from autoremat.cost.block_chain import profile_chain
from autoremat.cost.block_window import ReferenceWindows
from autoremat.solvers.blocks import chain_of

_FIELDS = ("held", "held_min", "fwd_peak", "bwd_peak", "gap_peak", "time_s", "sims")


def _same_terms(g, chain) -> list[bool]:
    """Asserts the windowed profile equals the whole-step one; returns whether each priced option
    skipped its middle (so tests can check both paths ran)."""
    windowed = profile_chain(g, chain)
    whole = profile_chain(g, chain, windows=False)
    for name in _FIELDS:
        assert getattr(windowed, name) == getattr(whole, name), name
    assert windowed.reference.fwd_touch == whole.reference.fwd_touch
    assert windowed.reference.bwd_touch == whole.reference.bwd_touch
    return windowed_flags(g, chain)


def windowed_flags(g, chain) -> list[bool]:
    """Per option of each context's middle block (profile_chain's representatives): windowed."""
    from autoremat.cost.block_chain import chain_plan, contexts

    members: dict = {}
    for j, key in enumerate(contexts(chain)):
        members.setdefault(key, []).append(j)
    reps = {key: js[len(js) // 2] for key, js in members.items()}
    win = ReferenceWindows(g, chain_plan(g, chain, [0] * len(chain.blocks)), chain.blocks, reps.values())
    flags = []
    for key, k in reps.items():
        for o in range(1, len(chain.options[key[1]])):
            choice = [0] * len(chain.blocks)
            choice[k] = o
            flags.append(win.price(chain_plan(g, chain, choice), k).windowed)
    return flags


@pytest.mark.parametrize("shared_saved", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_windowed_terms_equal_whole_steps_on_random_block_chains(seed: int, shared_saved: bool) -> None:
    rng = random.Random(seed)
    g = with_held_outputs(block_chain(rng, rng.randint(2, 7), width=rng.randint(4, 9), classes=rng.randint(1, 2),
                                      mode="module" if seed % 3 else "fx", shared_saved=shared_saved), seed)
    chain, _ = chain_of(g)
    _same_terms(g, chain)


def test_both_paths_run_on_the_random_chains() -> None:
    """Some options skip their middle (step 2), and some cannot (a storage of the difference is
    read later, or the last block): both are compared above."""
    flags = []
    for seed in range(10):
        for shared_saved in (True, False):
            rng = random.Random(seed)
            g = block_chain(rng, rng.randint(2, 7), width=rng.randint(4, 9), classes=rng.randint(1, 2),
                            mode="module" if seed % 3 else "fx", shared_saved=shared_saved)
            flags.extend(windowed_flags(g, chain_of(g)[0]))
    assert any(flags) and not all(flags)


def test_windowed_terms_equal_whole_steps_on_a_gpt2_capture() -> None:
    pytest.importorskip("transformers")
    import torch

    import autoremat
    from autoremat.zoo.hf import gpt2

    model = gpt2(n_layer=5)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    g = autoremat.capture(model, (ids,), times="flops", repeats=1)
    chain, _ = chain_of(g)
    assert len(chain.blocks) == 5
    assert any(_same_terms(g, chain))


def test_plans_that_offload_are_refused() -> None:
    from autoremat.cost.block_chain import chain_plan

    g = block_chain(random.Random(0), 3)
    chain, _ = chain_of(g)
    win = ReferenceWindows(g, chain_plan(g, chain, [0, 0, 0]), chain.blocks, [1])
    plan = chain_plan(g, chain, [0, 1, 0])
    plan.offload = (1,)
    with pytest.raises(ValueError, match="without offload"):
        win.price(plan, 1)


def test_a_mask_every_block_reads_keeps_the_windows() -> None:
    """GPT-2 handed an attention mask: every block reads the mask its first layer makes, and a
    recomputed block keeps it as an input where the stored one holds nothing of it. The mask stays
    alive through the window in both steps (the glue that made it saves it), so the middle blocks'
    options still skip their middle (before: none did, and pricing a 64-layer GPT-2 took twice as
    long), with the same terms as whole steps."""
    pytest.importorskip("transformers")
    import torch

    import autoremat
    from autoremat.zoo.hf import gpt2

    model = gpt2(n_layer=5)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 64, dtype=torch.long)
    g = autoremat.capture(model, (ids,), kwargs={"attention_mask": mask}, times="flops", repeats=1)
    chain, _ = chain_of(g)
    flags = _same_terms(g, chain)
    assert sum(flags) >= len(flags) // 2, flags
