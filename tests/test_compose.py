"""compose.yaml cannot run here (no Docker): check that it says what the CLI and Settings
understand, so the file cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pagedq.cli import build_parser
from pagedq.settings import Settings

COMPOSE = yaml.safe_load((Path(__file__).resolve().parent.parent / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def test_services_and_their_commands_parse_with_the_cli():
    assert set(SERVICES) == {"redis", "api", "worker"}
    parser = build_parser()
    for name in ("api", "worker"):
        command = SERVICES[name]["command"]
        assert command[0] == "pagedq"
        args = parser.parse_args(command[1:])
        assert args.command == name
    api = parser.parse_args(SERVICES["api"]["command"][1:])
    assert SERVICES["api"]["ports"] == [f"{api.port}:{api.port}"] and api.host == "0.0.0.0"


@pytest.mark.parametrize("name", ["api", "worker"])
def test_environment_is_settings(name):
    environment = SERVICES[name]["environment"]
    assert environment == SERVICES["api"]["environment"]  # one configuration for both
    fields = set(Settings.model_fields)
    for variable in environment:
        assert variable.startswith("PAGEDQ_") and variable.removeprefix("PAGEDQ_").lower() in fields
    redis_host = environment["PAGEDQ_REDIS_URL"].split("//")[1].split(":")[0]
    assert redis_host == "redis"
    assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_redis_persists_and_everything_has_health_or_a_gpu():
    redis = SERVICES["redis"]
    assert redis["command"][:3] == ["redis-server", "--appendonly", "yes"]
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert "/health" in " ".join(SERVICES["api"]["healthcheck"]["test"])
    (device,) = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    worker_args = build_parser().parse_args(SERVICES["worker"]["command"][1:])
    assert worker_args.device == "cuda"
    # Long enough for the worker's SIGTERM drain.
    assert int(SERVICES["worker"]["stop_grace_period"].removesuffix("s")) > Settings.model_fields["drain_timeout_s"].default
