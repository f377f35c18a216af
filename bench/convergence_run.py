"""Training the rows of `swarmpipe bench convergence`: a whole pipeline in one process.

`SimulatedPipeline` runs every stage as the node's own `StageRuntime` and sends every hop
through the wire codecs; `train_setting` trains one row with one seed and returns its run
record; `train_all` trains a plan of (row, seed) in this process or in a pool of worker
processes, and yields each run as it finishes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import multiprocessing
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from swarmpipe.bench.convergence_settings import BoundarySetting

if TYPE_CHECKING:  # torch is imported where it is used: `swarmpipe --help` stays fast
    import torch

    from swarmpipe.compression import EncoderState
    from swarmpipe.data import Corpus

logger = logging.getLogger(__name__)

WIRE = 2
"""Which MicrobatchHeader a run's byte figures were measured with: 1 sent int32 labels and
every token id, 2 sends labels in the id width and each sample's first id (node/token_ids.py).
Training is the same under both; only the header bytes differ."""

PROGRESS_EVERY = 100
"""Steps between progress lines in the log."""

EVAL_BATCH = 64
"""Held-out samples per forward pass of an evaluation; bounds its memory."""


class SimulatedPipeline:
    """Every stage of a run in this process, each hop between them through the wire codecs.

    Microbatches and steps follow the pipeline's arithmetic (node/stage_runtime.py):
    summed token losses, gradients accumulated per stage and divided by the step's
    token count before each stage's own AdamW step.
    """

    def __init__(
        self, overrides: Sequence[str], setting: BoundarySetting, device: str = "cpu"
    ) -> None:
        from swarmpipe.config import load_config
        from swarmpipe.node.stage_runtime import StageRuntime
        from swarmpipe.node.transport import EncodeOptions

        self.config = load_config(
            None,
            [
                *overrides,
                f"model.bottleneck={setting.bottleneck}",
                f"model.bottleneck_recent={setting.recent}",
            ],
        )
        self.setting = setting
        # The node's own codec parameters and, per hop and direction, its encoder memory
        # (error feedback, warm starts), so each hop encodes exactly as a node would.
        self.options = EncodeOptions.from_pipeline(self.config.pipeline)
        self._states: dict[tuple[int, str], EncoderState] = {}
        # A stage builds on the CPU, so every device starts from the same weights.
        self.device = device
        self.runtimes = [
            StageRuntime(self.config, s, device) for s in range(self.config.pipeline.stages)
        ]
        self.hops = len(self.runtimes) - 1
        # Bytes over every hop, and the tokens that crossed each hop, since the start.
        self.wire = {"activation": 0, "gradient": 0, "token_ids": 0, "microbatch_header": 0}
        self.hop_tokens = 0

    def _cross(
        self, tensor: torch.Tensor, codec: str, hop: int, direction: str, *, count: bool = True
    ) -> torch.Tensor:
        """`tensor` as the other side of `hop` receives it; counts its bytes when `count`."""
        from swarmpipe.compression import EncoderState, decode_tensor

        key = (hop, direction)
        if key not in self._states:
            self._states[key] = EncoderState(error_feedback=direction != "activation")
        header, payload = self.options.encode_now(tensor, codec, direction, self._states[key])
        if count:
            self.wire[direction] += header.ByteSize() + len(payload)
        return decode_tensor(header, payload, device=self.device)

    def _count_headers(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Count the MicrobatchHeader bytes of every hop: labels, and the first token ids if
        they travel. The header is the same on each hop, so it is built once."""
        from swarmpipe.node.token_ids import encode_token_ids, first_tokens_of
        from swarmpipe.protos import stage_pb2

        vocab = self.config.model.vocab
        firsts = (
            encode_token_ids(first_tokens_of(tokens, labels), vocab)
            if self.setting.bottleneck
            else b""
        )
        # What node/head.py sends, without the ids and names whose size does not grow.
        header = stage_pb2.MicrobatchHeader(
            labels=encode_token_ids(labels, vocab), first_tokens=firsts
        )
        self.wire["microbatch_header"] += self.hops * header.ByteSize()
        if firsts:
            ids = stage_pb2.MicrobatchHeader(first_tokens=firsts).ByteSize()
            self.wire["token_ids"] += self.hops * ids
        self.hop_tokens += self.hops * labels.numel()

    def microbatch(
        self, microbatch_id: str, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, int]:
        """One microbatch down the stages and its gradient back up: (loss sum, tokens)."""
        s = self.setting
        ids, targets = tokens.to(self.device), labels.to(self.device)
        x = ids
        for index, runtime in enumerate(self.runtimes[:-1]):
            out = runtime.forward(f"{microbatch_id}/{index}", microbatch_id, x, ids)
            x = self._cross(out, s.activation_codec, index, "activation")
        self._count_headers(tokens, labels)
        last = self.runtimes[-1].forward_last(microbatch_id, x, targets, ids)
        grad = last.grad_input
        for index in range(len(self.runtimes) - 2, -1, -1):
            assert grad is not None  # only stage 0 returns no input gradient
            grad = self._cross(grad, s.gradient_codec, index, "gradient")
            grad = self.runtimes[index].backward(f"{microbatch_id}/{index}", grad)
        return last.loss_sum, last.tokens

    def train_step(self, step: int, corpus: Corpus) -> float:
        """Step `step`: samples [step*G, (step+1)*G) in microbatches, then AdamW on every
        stage; the step's mean token loss."""
        t = self.config.train
        loss_sum, tokens = 0.0, 0
        for offset in range(0, t.global_batch, t.microbatch):
            count = min(t.microbatch, t.global_batch - offset)
            start = step * t.global_batch + offset
            x, y = corpus.samples(start, count)  # each [count, T]
            loss, n = self.microbatch(f"{step}:{start}:{count}", x, y)
            loss_sum += loss
            tokens += n
        for runtime in self.runtimes:
            runtime.apply_step(step)
        return loss_sum / tokens

    def evaluate(self, corpus: Corpus, count: int) -> float:
        """Mean token loss on the first `count` held-out samples, through the forward codecs."""
        import torch

        from swarmpipe.model import token_loss_sum

        x_all, y_all = corpus.heldout(count)  # each [count, T]
        x_all, y_all = x_all.to(self.device), y_all.to(self.device)
        loss_sum = 0.0
        with torch.no_grad():
            for start in range(0, x_all.shape[0], EVAL_BATCH):
                x = tokens = x_all[start : start + EVAL_BATCH]
                for index, runtime in enumerate(self.runtimes):
                    x = runtime.module(x if index == 0 else x.float(), tokens)
                    if index < self.hops:
                        x = self._cross(
                            x, self.setting.activation_codec, index, "activation", count=False
                        )
                loss_sum += float(token_loss_sum(x, y_all[start : start + EVAL_BATCH]))
        return loss_sum / y_all.numel()

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes per token crossing one hop, for each kind of traffic."""
        n = max(self.hop_tokens, 1)
        return {kind: total / n for kind, total in self.wire.items()}


def train_setting(
    overrides: Sequence[str],
    setting: BoundarySetting,
    seed: int,
    *,
    steps: int,
    eval_every: int,
    eval_samples: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train one setting with `seed` for `steps` steps; its losses, held-out curve, bytes
    and time."""
    from swarmpipe.data import Corpus

    started = time.perf_counter()
    pipe = SimulatedPipeline([*overrides, f"train.seed={seed}"], setting, device)
    cfg = pipe.config
    corpus = Corpus.load(cfg.data, cfg.model.context, cfg.train.seed)
    train_losses: list[float] = []
    curve: list[tuple[int, float]] = []
    for step in range(steps):
        train_losses.append(pipe.train_step(step, corpus))
        done = step + 1
        if done == steps or (eval_every and done % eval_every == 0):
            curve.append((done, pipe.evaluate(corpus, eval_samples)))
            logger.info(
                "%s seed %d: step %d/%d train loss %.4f eval loss %.4f",
                setting.name,
                seed,
                done,
                steps,
                train_losses[-1],
                curve[-1][1],
            )
        elif done % PROGRESS_EVERY == 0:  # a long run shows its pace between evaluations
            logger.info(
                "%s seed %d: step %d/%d train loss %.4f after %.0f s",
                setting.name,
                seed,
                done,
                steps,
                train_losses[-1],
                time.perf_counter() - started,
            )
    return {
        "setting": asdict(setting),
        "seed": seed,
        "eval_loss": curve[-1][1],
        "eval_curve": curve,
        "train_loss_last": train_losses[-1],
        "train_losses": train_losses,
        "bytes_per_token_per_hop": pipe.bytes_per_token(),
        "hops": pipe.hops,
        "parameters": sum(r.n_parameters for r in pipe.runtimes),
        "seconds": time.perf_counter() - started,
        "device": device_name(device),
        "corpus": corpus.fingerprint,
        "wire": WIRE,
    }


def device_name(device: str) -> str:
    """What `device` is, for the record: `cpu`, or the accelerator's own name."""
    import torch

    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _start_worker(threads: int, log_level: int) -> None:
    """A worker process's setup: its torch threads, and logging (it is an entry point)."""
    import torch

    from swarmpipe.process.logs import configure_logging

    configure_logging(logging.getLevelName(log_level), who="bench convergence")
    torch.set_num_threads(threads)


def train_all(
    overrides: Sequence[str],
    plan: Sequence[tuple[BoundarySetting, int]],
    *,
    jobs: int,
    threads: int,
    steps: int,
    eval_every: int,
    eval_samples: int,
    device: str = "cpu",
) -> Iterator[dict[str, Any]]:
    """Train each (setting, seed) of `plan` as `train_setting` does, `jobs` at a time with
    `threads` torch threads each; yields each run as it finishes (in plan order with one job).
    """
    level = logging.getLogger().getEffectiveLevel()
    # One run's keywords, bound once (a partial of a module function pickles for the pool).
    run = functools.partial(
        train_setting, steps=steps, eval_every=eval_every, eval_samples=eval_samples, device=device
    )
    if jobs == 1:
        _start_worker(threads, level)
        for setting, seed in plan:
            yield run(overrides, setting, seed)
        return
    # spawn, not fork: the parent may hold torch threads, which fork does not copy safely.
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(threads, level),
    ) as pool:
        futures = [pool.submit(run, overrides, setting, seed) for setting, seed in plan]
        for future in concurrent.futures.as_completed(futures):
            yield future.result()


def check_device(device: str) -> str:
    """The torch device `device` (a node's --device spec) names here, as a string;
    ConfigError (one line, exit 2) unless it exists."""
    from swarmpipe.node.device import resolve_device

    return str(resolve_device(device))
