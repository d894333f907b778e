"""`ftjob operator`'s flags: bad values refused by argparse naming the flag, env defaults."""

from __future__ import annotations

import argparse

import pytest

from finetune_operator.settings import add_operator_arguments, parse_operator_args


@pytest.mark.parametrize("port", ["-1", "65536", "99999", "http"])
def test_metrics_port_out_of_range_is_refused_naming_the_flag(port: str) -> None:
    with pytest.raises(argparse.ArgumentError, match="--metrics-port"):
        parse_operator_args([f"--metrics-port={port}"])


@pytest.mark.parametrize(("port", "expected"), [("0", None), ("9090", 9090), ("65535", 65535)])
def test_metrics_port_in_range(port: str, expected: int | None) -> None:
    assert parse_operator_args([f"--metrics-port={port}"]).metrics_port == expected


def test_env_defaults_are_read_and_checked() -> None:
    settings = parse_operator_args([], {"FINETUNE_OPERATOR_METRICS_PORT": "9191"})
    assert settings.metrics_port == 9191
    with pytest.raises(argparse.ArgumentError, match="--metrics-port"):
        parse_operator_args([], {"FINETUNE_OPERATOR_METRICS_PORT": "70000"})


def test_help_states_the_defaults_the_environment_gives() -> None:
    parser = argparse.ArgumentParser(prog="ftjob operator")
    add_operator_arguments(parser, {"FINETUNE_OPERATOR_RECONCILE_INTERVAL_SECONDS": "7"})
    text = " ".join(parser.format_help().split())
    assert "hangs; default: 7)" in text and "default: 9090)" in text


# A value each flag takes, other than its default.
_ENV_VALUES = {
    "--liveness": "http://0.0.0.0:8081/healthz",
    "--peering": "other",
    "--metrics-port": "9191",
    "--reconcile-interval": "7",
    "--scrape-timeout": "3",
    "--watch-timeout": "30",
    "--trainer-image": "registry.example/trainer:1",
    "--gang-scheduler": "volcano",
    "--gang-scheduler-name": "my-scheduler",
}


def _parsed(env: dict[str, str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="ftjob operator")
    add_operator_arguments(parser, env)
    return vars(parser.parse_args([]))


def test_help_names_every_environment_variable_and_each_sets_its_flag() -> None:
    """`--help` named none of them, and their names are not the flags' (RECONCILE_INTERVAL_SECONDS
    for --reconcile-interval)."""
    from finetune_operator.settings import ENV_FLAGS, ENV_PREFIX

    parser = argparse.ArgumentParser(prog="ftjob operator")
    add_operator_arguments(parser, {})
    text = " ".join(parser.format_help().split())
    assert {flag for flag, _ in ENV_FLAGS} == set(_ENV_VALUES)
    defaults = _parsed({})
    for flag, key in ENV_FLAGS:
        assert f"{ENV_PREFIX}{key} ({flag})" in text
        dest = flag.removeprefix("--").replace("-", "_")
        assert _parsed({ENV_PREFIX + key: _ENV_VALUES[flag]})[dest] != defaults[dest], key
