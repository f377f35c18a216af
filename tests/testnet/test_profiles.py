"""`--node-profile`: per-node send limits and compute slowdowns, and what a bad one says."""

from __future__ import annotations

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.testnet.profiles import NodeProfile, parse_profiles


def test_profiles_become_node_flags() -> None:
    profiles = parse_profiles(["n0=mbit:50,slow:2", "n2=slow:3.5"], nodes=3)
    assert profiles == {"n0": NodeProfile(mbit=50.0, slow=2.0), "n2": NodeProfile(slow=3.5)}
    assert profiles["n0"].node_args() == ["--link-mbit", "50", "--compute-slowdown", "2"]
    assert profiles["n2"].node_args() == ["--compute-slowdown", "3.5"]
    assert NodeProfile(mbit=0.0).node_args() == ["--link-mbit", "0"]  # 0: no limit
    assert parse_profiles([], nodes=3) == {}
    [(name, far)] = parse_profiles(["n1=lat:80,mbit:100"], nodes=3).items()
    assert name == "n1" and far == NodeProfile(mbit=100.0, lat=80.0)
    assert far.node_args() == ["--link-mbit", "100", "--latency-ms", "80"]


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("n0", "give NODE=mbit:X,slow:Y"),
        ("n9=slow:2", "no node 'n9' in this testnet (n0 to n2)"),
        ("n0=fast:2", "'fast:2' is not mbit:NUMBER, slow:NUMBER or lat:MS"),
        ("n0=slow:two", "'slow:two' is not mbit:NUMBER, slow:NUMBER or lat:MS"),
        ("n0=slow:nan", "is not mbit:NUMBER, slow:NUMBER or lat:MS"),
        ("n0=slow:0.5", "slow:0.5 must be 1 to 1000"),
        ("n0=mbit:-3", "out of range"),
        ("n0=lat:-1", "n0 lat:-1 is out of range"),
        ("n0=lat:20000", "give 0 (none) to 10000 ms"),
    ],
)
def test_a_bad_profile_says_what_is_wrong(item: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_profiles([item], nodes=3)


def test_a_node_gets_one_profile() -> None:
    with pytest.raises(ConfigError, match="n1 has two profiles"):
        parse_profiles(["n1=slow:2", "n1=mbit:5"], nodes=3)
