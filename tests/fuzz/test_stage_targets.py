"""A stage target that drives its own event loop closes it once dropped."""

from __future__ import annotations

import gc
import inspect
import warnings

import pytest

from swarmpipe.bench.decoder_targets import TARGETS


@pytest.mark.parametrize("name", ["forward-request", "reduce-request"])
def test_a_dropped_stage_target_closes_its_event_loop(name: str) -> None:
    # Left unclosed, the loop and its two self-pipe sockets warned when collected, from
    # whichever test ran then; CI failed a codec test under filterwarnings("error") so.
    run = TARGETS[name].make()
    loop = inspect.getclosurevars(run).nonlocals["loop"]
    assert not loop.is_closed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del run
        gc.collect()
    assert loop.is_closed()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
