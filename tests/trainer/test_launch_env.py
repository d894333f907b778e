"""The launcher (finetune_trainer.launch) gives torchrun a store per rendezvous round however
it is started: the start-up barrier (finetune_trainer.startup_barrier) counts on an empty one."""

from __future__ import annotations

import contextlib
import os

import pytest

from finetune_trainer.launch import main

VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def test_a_launcher_run_by_hand_disables_the_shared_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    with contextlib.suppress(SystemExit):  # torchrun's help, and no workers started
        main(["--help"])  # torchrun reads the variable when it joins a round, in this process
    assert os.environ[VAR] == "1"


def test_a_users_own_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "0")
    with contextlib.suppress(SystemExit):
        main(["--help"])
    assert os.environ[VAR] == "0"
