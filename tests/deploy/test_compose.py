"""deploy/compose.yaml, checked without Docker: its YAML, its swarmpipe command lines (parsed
by swarmpipe's own parser), the broker's credentials and ACL, and the broker's start script
run against Debian's mosquitto."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from swarmpipe.cli import build_parser
from swarmpipe.control.bus import parse_broker_url
from swarmpipe.process.ready import poll_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return loaded


def _argv(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_services_are_a_broker_a_coordinator_and_scalable_nodes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"broker", "coordinator", "node"}
    assert services["node"]["deploy"]["replicas"] >= 2
    for name in ("coordinator", "node"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert services["node"]["restart"] == "on-failure"
    assert services["coordinator"]["restart"] == "no"  # a restart must be told to resume
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"compose mounts missing {source}"


@pytest.mark.parametrize("name", ["coordinator", "node"])
def test_swarmpipe_commands_parse(compose: dict[str, Any], name: str) -> None:
    args = build_parser().parse_args(_argv(compose["services"][name]))  # SystemExit on a bad flag
    assert args.command == name


def test_each_role_connects_as_its_broker_user(compose: dict[str, Any]) -> None:
    services = compose["services"]
    acl_users = re.findall(r"^user (\S+)$", (DEPLOY / "mosquitto" / "acl").read_text(), re.M)
    script = services["broker"]["command"][0]
    created = re.findall(r"mosquitto_passwd (?:-c )?-b \S+ (\S+) ", script)
    assert sorted(created) == sorted(acl_users) == ["coordinator", "node"]

    coordinator = build_parser().parse_args(_argv(services["coordinator"]))
    env = {k: "x" for k in services["coordinator"]["environment"]}
    assert parse_broker_url(coordinator.broker, env).username == "coordinator"
    assert services["node"]["environment"]["SWARMPIPE_BROKER_USERNAME"] == "node"
    conf = (DEPLOY / "mosquitto" / "mosquitto.conf").read_text()
    assert re.search(r"^allow_anonymous false$", conf, re.M)


def test_nodes_get_longer_than_their_drain_to_stop(compose: dict[str, Any]) -> None:
    grace = compose["services"]["node"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > 30  # node/daemon.py DRAIN_TIMEOUT_S


@pytest.fixture
def compose_broker(compose: dict[str, Any]) -> Iterator[int]:
    """The broker service's start script and mosquitto.conf, run by the local mosquitto with
    /mosquitto/ moved to a scratch folder and a free port; yields the port."""
    for tool in ("mosquitto", "mosquitto_passwd"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"{tool} is not installed (scripts/test.sh installs it as root)")
    if os.geteuid() != 0:
        pytest.skip("the broker's start script chowns its password file, which needs root")
    # Not under pytest's tmp_path: mosquitto drops to its own user, as in the container, and
    # that user cannot enter pytest's 0700 folders.
    scratch = Path(tempfile.mkdtemp(prefix="swarmpipe-compose-broker-"))
    scratch.chmod(0o755)
    root = scratch / "mosquitto"
    (root / "config").mkdir(parents=True)
    (root / "data").mkdir()
    shutil.copy(DEPLOY / "mosquitto" / "acl", root / "config" / "acl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = (DEPLOY / "mosquitto" / "mosquitto.conf").read_text()
    conf = conf.replace("/mosquitto/", f"{root}/").replace("listener 1883", f"listener {port}")
    (root / "config" / "mosquitto.conf").write_text(conf)
    script = compose["services"]["broker"]["command"][0].replace("$$", "$")
    script = script.replace("/mosquitto/", f"{root}/")
    env = {**os.environ, "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin"}
    env.update({"COORDINATOR_BROKER_PASSWORD": "c-pass", "NODE_BROKER_PASSWORD": "n-pass"})
    popen = subprocess.Popen(
        ["/bin/sh", "-c", script],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def accepting() -> bool:
            assert popen.poll() is None, "the broker's start script exited"
            with socket.socket() as c:
                return c.connect_ex(("127.0.0.1", port)) == 0

        poll_until(accepting, 15, "the compose broker to accept connections")
        yield port
    finally:
        popen.terminate()
        popen.wait(timeout=10)
        shutil.rmtree(scratch)


@pytest.mark.timeout(60)
def test_the_compose_broker_admits_its_users_and_refuses_strangers(compose_broker: int) -> None:
    import asyncio

    import aiomqtt

    from swarmpipe.control.bus import make_client

    async def connect(user: str, password: str) -> str:
        credentials = f"{user}:{password}@" if user else ""
        url = f"mqtt://{credentials}127.0.0.1:{compose_broker}"
        try:
            async with make_client(parse_broker_url(url, {}), f"probe-{user or 'anon'}"):
                return "connected"
        except aiomqtt.MqttError as exc:
            return str(exc)

    assert asyncio.run(connect("coordinator", "c-pass")) == "connected"
    assert asyncio.run(connect("node", "n-pass")) == "connected"
    assert "the broker refused user 'node'" in asyncio.run(connect("node", "c-pass"))
    assert "the broker refused an anonymous client" in asyncio.run(connect("", ""))
