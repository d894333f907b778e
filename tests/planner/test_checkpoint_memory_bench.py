"""bench/checkpoint_memory.py's plan figures for each save mode: S is the state a save
captures whatever the mode (it printed 0 for sync saves and checkpoints off)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    path = REPO / "bench" / "checkpoint_memory.py"
    spec = importlib.util.spec_from_file_location("checkpoint_memory_bench", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_bench_reports_the_state_in_every_mode() -> None:
    bench = _bench()
    args = argparse.Namespace(strategy="ddp", hidden=512, layers=8, steps=12, every=4)
    figures = {
        mode: bench.planned_save(bench.spec_for(args, checkpoint))
        for mode, checkpoint in {"sync": {"async": False}, "async": {"async": True}}.items()
    }
    (s_sync, save_sync, _), (s_async, save_async, _) = figures["sync"], figures["async"]
    assert s_sync == s_async > 0  # the same state, whatever the mode
    assert save_sync == 0 and save_async > s_async  # sync on a CPU device: nothing held
