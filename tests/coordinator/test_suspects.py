"""The coordinator's bench: a majority of a stage's other replicas, or one data-plane witness."""

from __future__ import annotations

from swarmpipe.coordinator.suspects import DATA, REDUCE, Suspects


def _report(
    s: Suspects,
    reporter: str,
    suspect: str,
    peers: set[str],
    kind: str = REDUCE,
    *,
    sole: bool = False,
    step: int = 4,
    conclusive: bool = False,
):  # type: ignore[no-untyped-def]
    return s.report(
        conclusive=conclusive,
        sole_server=sole,
        reporter=reporter,
        suspect=suspect,
        step=step,
        kind=kind,
        reason="norm too large",
        stage=1,
        stage_peers=peers,
        now=100.0,
    )


def test_two_honest_replicas_bench_a_third_but_one_cannot_bench_an_honest_one() -> None:
    s = Suspects(bench_s=60.0, verdicts=1)
    assert _report(s, "x", "a", {"b", "x"}) is None  # x alone against a: not a majority
    assert _report(s, "a", "x", {"a", "b"}) is None
    entry = _report(s, "b", "x", {"a", "b"})
    assert entry is not None and entry.reporters == ("a", "b") and entry.until == 160.0
    assert s.is_benched("x", 159.0) and not s.is_benched("a", 159.0)
    refusal = s.refusal("x", 130.0)
    assert (
        refusal is not None and "benched for 30 s more" in refusal and "norm too large" in refusal
    )
    assert s.refusal("x", 160.0) is None  # the bench has run out
    assert len(s.history) == 1 and s.accepted == 3


def test_in_a_stage_of_two_one_replica_cannot_bench_the_other() -> None:
    s = Suspects(bench_s=60.0, verdicts=1)
    assert _report(s, "a", "x", {"a"}) is None  # a majority of one, but either may be odd
    assert not s.is_benched("x", 100.0)


def test_a_data_plane_refusal_benches_on_one_report() -> None:
    s = Suspects(bench_s=60.0, verdicts=1)
    assert _report(s, "a", "y", set(), kind=DATA) is not None  # it serves nothing now


def test_a_data_plane_refusal_never_benches_a_stages_only_replica() -> None:
    # Nobody could take its traffic: benching it would stop the run for bench_s.
    s = Suspects(bench_s=60.0, verdicts=1)
    assert _report(s, "a", "y", set(), kind=DATA, sole=True) is None
    assert not s.is_benched("y", 100.0) and s.spared == 1
    # Once the stage has another serving replica, the next report benches.
    assert _report(s, "a", "y", {"z"}, kind=DATA) is not None


def test_bench_zero_reports_without_refusing() -> None:
    s = Suspects(bench_s=0.0, verdicts=1)
    assert _report(s, "a", "y", {"a", "b"}) is None
    assert _report(s, "b", "y", {"a", "b"}) is not None
    assert s.refusal("y", 100.0) is None


def test_a_reduce_suspect_is_benched_at_its_second_majority_verdict_within_four_steps() -> None:
    # An honest gradient fails a screen now and then (a loss spike, a small batch that looks
    # like noise); a hostile replica fails at every reduce it is judged in.
    s = Suspects(bench_s=60.0)
    peers = {"a", "b"}
    assert _report(s, "a", "x", peers, step=3) is None
    assert _report(s, "b", "x", peers, step=3) is None  # a majority, but once
    assert _report(s, "a", "x", peers, step=7) is None
    assert _report(s, "b", "x", peers, step=7) is None  # step 3 is out of the window now
    assert _report(s, "a", "x", peers, step=8) is None  # one voter is not a verdict
    entry = _report(s, "b", "x", peers, step=8)
    assert entry is not None and entry.step == 8 and s.is_benched("x", 100.0)
    # A data-plane refusal still benches at once: it has only one witness anyway.
    assert _report(s, "a", "y", peers, DATA) is not None


def test_a_conclusive_majority_verdict_benches_at_once_but_one_reporter_cannot_make_it() -> None:
    # The tensor-scale screen with a witness: no honest gradient has come near its bound.
    s = Suspects(bench_s=60.0)
    peers = {"a", "b"}
    assert _report(s, "a", "x", peers, step=2, conclusive=True) is None  # one voter
    entry = _report(s, "b", "x", peers, step=2, conclusive=True)
    assert entry is not None and entry.step == 2 and s.is_benched("x", 100.0)
    # A hostile reporter calling its own report conclusive does not make an honest
    # replica's one ordinary verdict a bench: conclusive needs a majority of its own.
    s = Suspects(bench_s=60.0)
    assert _report(s, "x", "c", {"a", "x", "d"}, step=2, conclusive=True) is None
    assert _report(s, "a", "c", {"a", "x", "d"}, step=2) is None
    assert not s.is_benched("c", 100.0)


def test_reports_of_a_step_begun_again_do_not_add_up_with_the_next_attempts() -> None:
    # x (hostile, say) reports honest c in the first attempt; one honest false positive in
    # the second must not make that a majority.
    s = Suspects(bench_s=60.0)
    peers = {"a", "x", "d"}
    assert _report(s, "x", "c", peers, step=2, conclusive=True) is None
    s.forget_reports(2)
    assert _report(s, "a", "c", peers, step=2, conclusive=True) is None
    assert not s.is_benched("c", 100.0) and "c" not in s.convicted
