"""AutoRemat under Lightning's sharded strategies and Accelerate's FSDP plugin; DeepSpeed refused
(issue 21; :mod:`autoremat.integrations._lightning_sharded`, :mod:`autoremat.integrations._strategies`).

Fast: the strategy decisions on stand-in trainers and accelerators, the capture view over a
one-process FSDP2 group (the graph a sharded module is captured to is the unsharded module's),
wrap-policy predictions, the per-rank solve loop. Slow (two processes, gloo): full fits under
``ModelParallelStrategy`` and ``FSDPStrategy`` with and without AutoRemat (losses and final weights
equal, a checkpoint resumed), and Accelerate's plugin with ``fsdp_version`` 1 and 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autoremat
from autoremat.errors import InfeasibleBudgetError
from autoremat.integrations._lightning_sharded import capture_view, strategy_kind
from autoremat.integrations._strategies import (UnsupportedStrategyError, accelerate_units, predicted_units,
                                                solve_per_rank)
from autoremat.per_rank import ShardingSpec, per_rank_graph
from autoremat.cost import simulate

from _fsdp import batch, blocks, build, process_group, shard

HERE = Path(__file__).resolve().parent


def _trainer(strategy_class_name: str) -> SimpleNamespace:
    strategy = type(strategy_class_name, (), {})()
    return SimpleNamespace(strategy=strategy)


@pytest.mark.parametrize("name,kind", [("SingleDeviceStrategy", "plain"), ("DDPStrategy", "plain"),
                                       ("FSDPStrategy", "fsdp1"), ("ModelParallelStrategy", "fsdp2")])
def test_strategy_kinds(name: str, kind: str) -> None:
    assert strategy_kind(_trainer(name)) == kind


def test_deepspeed_is_refused_early_and_clearly() -> None:
    with pytest.raises(UnsupportedStrategyError, match="does not support DeepSpeed.*Use FSDP"):
        strategy_kind(_trainer("DeepSpeedStrategy"))
    accelerator = SimpleNamespace(distributed_type="DistributedType.DEEPSPEED", state=SimpleNamespace())
    with pytest.raises(UnsupportedStrategyError, match="Accelerate's DeepSpeed plugin"):
        accelerate_units(accelerator, build("cnn")[0])
    with pytest.raises(UnsupportedStrategyError, match="supports single-device, DDP, FSDPStrategy"):
        strategy_kind(_trainer("XLAStrategy"))


def test_callback_setup_refuses_deepspeed_before_any_work() -> None:
    cb = autoremat.AutoRemat(budget="50%")
    trainer = _trainer("DeepSpeedStrategy")
    with pytest.raises(UnsupportedStrategyError, match="DeepSpeed"):
        cb.setup(trainer, nn.Linear(2, 2), "fit")


def test_deepspeed_refused_for_the_real_classes_before_any_work() -> None:
    """Lightning's own ``DeepSpeedStrategy`` and Accelerate's own ``DistributedType.DEEPSPEED``
    (the objects cannot be made here: both need the ``deepspeed`` package, which is not installed
    on this CPU-only machine; the strategy is made without its ``__init__``): ``setup`` and
    ``prepare`` raise before capturing, the model left unpatched."""
    from accelerate.utils import DistributedType
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from autoremat.integrations import accelerate as ar

    trainer = SimpleNamespace(strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy))
    with pytest.raises(UnsupportedStrategyError, match="Lightning's DeepSpeedStrategy.*Use FSDP"):
        autoremat.AutoRemat(budget="50%").setup(trainer, nn.Linear(2, 2), "fit")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_main_process=True, num_processes=1,
                                  device=torch.device("cpu"), state=SimpleNamespace(deepspeed_plugin=object()))
    with pytest.raises(UnsupportedStrategyError, match="Accelerate's DeepSpeed plugin.*Use FSDP"):
        ar.prepare(accelerator, model, (torch.randn(2, 4),), budget="50%")
    assert not autoremat.is_patched(model) and not [n for n, m in model.named_modules() if "forward" in m.__dict__]


def test_callback_refuses_offload_and_batch_raising_under_fsdp() -> None:
    trainer = _trainer("ModelParallelStrategy")
    for kwargs in ({"offload": True}, {"raise_batch_size": True}):
        with pytest.raises(ValueError, match="under a sharded strategy"):
            autoremat.AutoRemat(budget="50%", **kwargs).setup(trainer, nn.Linear(2, 2), "fit")


def test_accelerate_refuses_a_model_sharded_already() -> None:
    accelerator = SimpleNamespace(distributed_type="DistributedType.FSDP", state=SimpleNamespace())
    with process_group():
        model = shard(build("cnn")[0], "fsdp2")
        with pytest.raises(ValueError, match="call it before accelerator.prepare"):
            accelerate_units(accelerator, model)


def test_predicted_units_follow_the_wrap_policies() -> None:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
    import functools

    model = build("cnn")[0]
    kind = type(blocks(model)[0])
    want = {n for n, m in model.named_modules() if isinstance(m, kind)}
    assert set(predicted_units(model, ModuleWrapPolicy({kind}), fsdp_version=1)) == want
    fn = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={kind})
    assert set(predicted_units(model, fn, fsdp_version=1)) == want
    assert set(predicted_units(model, lambda m: isinstance(m, kind), fsdp_version=2)) == want
    assert predicted_units(model, None, fsdp_version=2) == {}


def test_capture_view_gives_the_unsharded_graph() -> None:
    """The module captured inside the capture view (full parameters in place, FSDP hooks
    silenced; one-process FSDP2) is the unsharded module's graph: same fingerprint, nodes and
    bytes; after it the module is sharded again."""
    name = "cnn"
    x, loss_fn = batch(name, small=True), build(name)[1]
    plain = autoremat.capture(build(name)[0], (x,), loss_fn=loss_fn, mode="fx", repeats=1, warmup=0)
    with process_group():
        model = shard(build(name)[0], "fsdp2")
        pl_module = nn.Module()
        pl_module.model = model
        with capture_view(SimpleNamespace(strategy=None), pl_module, "fsdp2"):
            graph = autoremat.capture(model, (x,), loss_fn=loss_fn, mode="fx", repeats=1, warmup=0)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    assert graph.fingerprint == plain.fingerprint
    assert [graph.node(v)["alloc_bytes"] for v in graph.nodes] == [plain.node(v)["alloc_bytes"] for v in plain.nodes]


def test_per_rank_solve_lowers_the_budget_until_the_cut_plan_fits() -> None:
    """``solve_per_rank``: the plan cut at the units is what must fit; the loop asks again lower
    and gives up with InfeasibleBudgetError naming the closest."""
    g = autoremat.Graph.chain([100] * 12)
    spec = ShardingSpec(world_size=2, units=(), unit_bytes={"": 0}, node_units=((),) * len(g), root_sharded=False)
    budgets: list[int] = []

    def solve(graph: autoremat.Graph, budget: int) -> autoremat.Plan:
        budgets.append(budget)
        return autoremat.solve(graph, budget, solver="dp-approx")

    def cut(plan: autoremat.Plan) -> autoremat.Plan:  # a stand-in cut that costs a segment boundary
        segs = [autoremat.plan.Segment(s.nodes, False) if i == 0 else s for i, s in enumerate(plan.segments)]
        return autoremat.Plan(segs, solver=plan.solver, graph_fingerprint=plan.graph_fingerprint)

    vanilla = simulate(per_rank_graph(g, spec), autoremat.simulate.__globals__["no_recompute_plan"](g)).peak_bytes
    budget = int(vanilla * 0.9)
    ranked = solve_per_rank(g, spec, budget, solve, cut)
    assert ranked.predicted_peak_bytes <= budget and ranked.tries > 1
    assert budgets[0] == budget and all(b < budgets[0] for b in budgets[1:])
    assert simulate(per_rank_graph(g, spec, ranked.cut), ranked.cut).peak_bytes == ranked.predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError):
        solve_per_rank(g, spec, 1, solve, cut)


def _run(tmp_path: Path, script: str, *args: str) -> list[dict]:
    env = {**os.environ, "AUTOREMAT_TEST_OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(HERE / script), *args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,model", [("fsdp2", "cnn"), ("fsdp2", "gpt2"), ("fsdp1", "cnn"), ("fsdp1", "gpt2"),
                                            ("fsdp2", "gpt2+blocks")])
def test_lightning_sharded_fit_equals_the_fit_without_autoremat(tmp_path: Path, strategy: str, model: str) -> None:
    """``gpt2+blocks``: the ``blocks`` solver on the default capture (layers op by op); the others
    ``dp-approx`` (one node per layer)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _run(tmp_path / "a", "fsdp_lightning_script.py", strategy, model, "0")
    ar = _run(tmp_path / "b", "fsdp_lightning_script.py", strategy, model, "1")
    if model.endswith("+blocks"):  # layers op by op: sub-module regions
        assert ar[0]["plan"]["solver"] == "blocks" and ar[0]["plan"]["module_calls"]
    for rank in (0, 1):
        assert ar[rank]["patched_during_fit"] and ar[rank]["plan"] == ar[0]["plan"]  # one plan, every rank
        assert ar[rank]["summary"]["per_rank"]["world_size"] == 2
        assert ar[rank]["losses"] == plain[rank]["losses"]
        assert list(ar[rank]["state"]) == list(plain[rank]["state"])
        assert all(torch.equal(ar[rank]["state"][k], plain[rank]["state"][k]) for k in plain[rank]["state"])
    if strategy == "fsdp2":  # resumed from the checkpoint: the plan comes back from the callback's state
        ckpt = {n: torch.load(tmp_path / d / f"{n}.ckpt", weights_only=False) for n, d in (("plain", "a"), ("ar", "b"))}
        assert list(ckpt["ar"]["state_dict"]) == list(ckpt["plain"]["state_dict"])
        (tmp_path / "c").mkdir()
        (tmp_path / "d").mkdir()
        plain2 = _run(tmp_path / "c", "fsdp_lightning_script.py", strategy, model, "0", str(tmp_path / "a" / "plain.ckpt"))
        ar2 = _run(tmp_path / "d", "fsdp_lightning_script.py", strategy, model, "1", str(tmp_path / "b" / "ar.ckpt"))
        for rank in (0, 1):
            assert ar2[rank]["plan"] == ar[0]["plan"] and ar2[rank]["losses"] == plain2[rank]["losses"]
            assert all(torch.equal(ar2[rank]["state"][k], plain2[rank]["state"][k]) for k in plain2[rank]["state"])


@pytest.mark.slow
@pytest.mark.parametrize("version,model", [(1, "cnn"), (2, "cnn"), (1, "gpt2"), (2, "gpt2"), (1, "gpt2+blocks")])
def test_accelerate_fsdp_plugin(tmp_path: Path, version: int, model: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _run(tmp_path / "a", "fsdp_accelerate_script.py", str(version), model, "0")
    ar = _run(tmp_path / "b", "fsdp_accelerate_script.py", str(version), model, "1")
    for rank in (0, 1):
        for want, got in zip(plain[rank]["grads"], ar[rank]["grads"]):
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        if model == "cnn":
            assert ar[rank]["mapped"]  # the plan found the units accelerator.prepare made
    assert "before accelerator.prepare" in ar[0]["refused"]
