"""Broker URLs and credentials: what `parse_broker_url` takes from the URL and the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmpipe.control.bus import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USERNAME_ENV,
    BrokerAddress,
    make_client,
    parse_broker_url,
)
from swarmpipe.errors import ConfigError


def test_a_url_without_credentials_is_anonymous() -> None:
    broker = parse_broker_url("mqtt://broker.example", environ={})
    assert broker == BrokerAddress(host="broker.example", port=1883)
    assert broker.username == "" and broker.password == ""


def test_credentials_in_the_url_stay_out_of_its_printable_forms() -> None:
    broker = parse_broker_url("mqtt://node:s%40cret@10.0.0.5:1884", environ={})
    assert (broker.host, broker.port, broker.username, broker.password) == (
        "10.0.0.5",
        1884,
        "node",
        "s@cret",
    )
    # The coordinator sends .url to every node and logs it; repr reaches tracebacks.
    assert broker.url == "mqtt://10.0.0.5:1884"
    assert "s@cret" not in repr(broker)


def test_the_environment_fills_in_what_the_url_leaves_out() -> None:
    env = {USERNAME_ENV: "node", PASSWORD_ENV: "from-env"}
    broker = parse_broker_url("mqtt://h:1883", environ=env)
    assert (broker.username, broker.password) == ("node", "from-env")
    broker = parse_broker_url("mqtt://coordinator@h:1883", environ=env)
    assert (broker.username, broker.password) == ("coordinator", "from-env")
    broker = parse_broker_url("mqtt://coordinator:in-url@h:1883", environ=env)
    assert (broker.username, broker.password) == ("coordinator", "in-url")


def test_a_password_file_wins_over_the_password_variable(tmp_path: Path) -> None:
    secret = tmp_path / "broker-password"
    secret.write_text("from-file\n")
    env = {PASSWORD_FILE_ENV: str(secret), PASSWORD_ENV: "from-env"}
    broker = parse_broker_url("mqtt://node@h", environ=env)
    assert broker.password == "from-file"


def test_an_unreadable_password_file_is_a_config_error(tmp_path: Path) -> None:
    env = {PASSWORD_FILE_ENV: str(tmp_path / "missing")}
    with pytest.raises(ConfigError, match=f"{PASSWORD_FILE_ENV}=.*missing"):
        parse_broker_url("mqtt://node@h", environ=env)


def test_a_password_without_a_user_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=f"no user name.*{USERNAME_ENV}"):
        parse_broker_url("mqtt://h:1883", environ={PASSWORD_ENV: "x"})


@pytest.mark.parametrize("url", ["http://h:1883", "mqtt://", "mqtt://h:notaport"])
def test_malformed_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError, match="broker URL"):
        parse_broker_url(url, environ={})


async def test_make_client_hands_the_credentials_to_paho() -> None:
    client = make_client(parse_broker_url("mqtt://node:pw@h", environ={}), "c1")
    assert client._client._username == b"node"  # paho keeps them as bytes
    assert client._client._password == b"pw"
    anonymous = make_client(parse_broker_url("mqtt://h", environ={}), "c2")
    assert anonymous._client._username is None
