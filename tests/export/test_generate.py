"""Sampling from an exported model: the same text for the same seed, and options that mean
what they say."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmpipe.config import RunConfig, load_config
from swarmpipe.model import build_full_model, load_exported
from swarmpipe.model.exported import write_exported
from swarmpipe.model.sampling import sample_tokens

SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.context=16"]


def _model_file(path: Path, config: RunConfig) -> Path:
    """A model whose logits are far from uniform, so greedy, top-k and seeds differ visibly."""
    tensors = build_full_model(config).state_dict()
    gen = torch.Generator().manual_seed(1)
    for t in tensors.values():
        t.add_(torch.randn(t.shape, generator=gen) * 0.5)
    return write_exported(tensors, path, config=config, step=0)[0]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Token-by-token forwards of a tiny model: on a busy shared machine torch's thread pool
    # made them 30x slower than one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_file(tmp_path_factory.mktemp("gen") / "m.safetensors", load_config(None, SMALL))


def _sample(model_file: Path, **options: float) -> list[int]:
    model = load_exported(model_file)
    return sample_tokens(model, list(b"def "), context=16, tokens=40, **options)  # type: ignore[arg-type]


def test_the_same_seed_gives_the_same_text_and_leaves_the_global_rng_alone(
    model_file: Path,
) -> None:
    before = torch.get_rng_state()
    first = _sample(model_file, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)  # the global generator's state does not matter either
    assert _sample(model_file, seed=3) == first
    assert _sample(model_file, seed=4) != first
    assert len(first) == 40 and all(0 <= t < 256 for t in first)


def test_temperature_zero_and_top_one_are_greedy(model_file: Path) -> None:
    model = load_exported(model_file)
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(40):  # longer than the context: the window slides
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    greedy = ids[4:]
    assert _sample(model_file, temperature=0, seed=1) == greedy
    assert _sample(model_file, temperature=0, seed=2) == greedy
    assert _sample(model_file, top_k=1, seed=5) == greedy


def test_top_k_samples_only_among_the_k_likeliest(model_file: Path) -> None:
    model = load_exported(model_file)
    ids = list(b"def ")
    new = sample_tokens(model, ids, context=16, tokens=40, top_k=3, temperature=2.0, seed=0)
    with torch.no_grad():
        for token in new:
            logits = model(torch.tensor([ids[-16:]]))[0, -1]
            assert token in set(torch.topk(logits, 3).indices.tolist())
            ids.append(token)
    assert len(set(new)) > 3, "temperature 2 over 3 choices should not look greedy"


def test_bad_arguments_are_refused() -> None:
    model = torch.nn.Identity()
    with pytest.raises(ValueError, match="prompt is empty"):
        sample_tokens(model, [], context=4, tokens=1)
    with pytest.raises(ValueError, match=">= 0"):
        sample_tokens(model, [1], context=4, tokens=1, top_k=-1)


def _generate(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", "generate", "--model", str(model), "--threads", "1"]
    cmd += args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_the_command_prints_the_prompt_and_its_continuation(model_file: Path) -> None:
    options = ["--prompt", "déf ", "--tokens", "30", "--top-k", "5", "--seed", "7"]
    done = _generate(model_file, *options)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("déf ") and done.stdout.endswith("\n")
    model = load_exported(model_file)
    prompt = list("déf ".encode())
    want = sample_tokens(model, prompt, context=16, tokens=30, top_k=5, seed=7)
    assert done.stdout == bytes(prompt + want).decode("utf-8", errors="replace") + "\n"
    done = _generate(model_file, "--prompt", "")
    assert done.returncode == 2
    assert done.stderr == (
        "swarmpipe generate: configuration error: --prompt is empty; give the model at least "
        "one character to continue\n"
    )
    done = _generate(model_file, "--prompt", "x", "--temperature", "-1")
    assert done.returncode == 2 and "argument --temperature: must be >= 0, not -1" in done.stderr
