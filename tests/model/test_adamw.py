"""Our AdamW steps as torch.optim.AdamW does, and a node's training never imports the
compiler torch.optim would (model/adamw.py says why that matters)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from swarmpipe.model.adamw import AdamW
from tests.conftest import REPO


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _groups(m: torch.nn.Sequential) -> list[dict[str, object]]:
    """Two groups, the second at its own learning rate, as build_optimizer makes them."""
    return [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 0.01}]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_steps_match_torch_bit_for_bit(foreach: bool, weight_decay: float) -> None:
    ours_model, torch_model = _model(), _model()
    settings = {"lr": 0.003, "betas": (0.9, 0.95), "weight_decay": weight_decay}
    ours = AdamW(_groups(ours_model), **settings)  # type: ignore[arg-type]
    theirs = torch.optim.AdamW(_groups(torch_model), foreach=foreach, **settings)  # type: ignore[arg-type]
    for i in range(25):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        for model, optimizer in ((ours_model, ours), (torch_model, theirs)):
            model(x).pow(2).sum().backward()
            if i == 3:  # a parameter without a gradient this step keeps its state
                model[2].bias.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for p, q in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][key], theirs.state[q][key]), key
        assert ours.state[p]["step"].dtype == torch.float32
        assert ours.state[p]["step"].device.type == "cpu"


def test_zero_grad_in_place_and_bad_settings() -> None:
    model = _model()
    optimizer = AdamW([{"params": model.parameters()}], lr=0.01)
    model(torch.ones(1, 8)).sum().backward()
    grad = model[0].weight.grad
    optimizer.zero_grad(set_to_none=False)
    assert model[0].weight.grad is grad and not grad.any()
    optimizer.zero_grad()
    assert model[0].weight.grad is None
    with pytest.raises(ValueError, match="learning rate"):
        AdamW([{"params": model.parameters()}], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamW([{"params": model.parameters()}], lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="more than one"):
        AdamW([{"params": model.parameters()}, {"params": model[0].parameters()}], lr=0.1)


@pytest.mark.slow
def test_a_node_trains_and_exports_state_without_importing_the_compiler() -> None:
    """What a node does with its stage (a step, then its state exported), in a fresh
    process: torch._dynamo stays out of it, so a node starts without its import."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from swarmpipe.config import load_config
        from swarmpipe.node.daemon import NodeDaemon
        from swarmpipe.node.stage_runtime import StageRuntime
        cfg = load_config(None, ["model.n_layers=2", "model.d_model=16", "model.n_heads=2",
                                 "model.context=8", "pipeline.stages=1"])
        runtime = StageRuntime(cfg, 0)
        x = torch.randint(0, 256, (2, 8))
        runtime.forward_last("mb", x, x)
        runtime.apply_step(0)
        b"".join(runtime.export_state(node_id="n0").seal().chunks())
        assert runtime.optimizer.state, "the step made no AdamW state"
        print("dynamo" if "torch._dynamo" in sys.modules else "clean")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO.parent,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean", out.stdout + out.stderr
