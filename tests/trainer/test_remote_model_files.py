"""A remote model's config and tokenizer files (finetune_trainer.remote_model): fetched into
the pod's data-cache volume keyed by the objects' identity, reused by a restart, renamed into
place only when complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data.remote import RemoteObject, local_data_dir, stage_dataset, used_bytes
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, locate
from finetune_trainer.remote_model import MODELS_DIR, STAGING, cache_name, cache_root, model_files
from tests.objectstore import MotoServer


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    model_files.cache_clear()  # once per process in the trainer; per test here
    yield tmp_path / "data-cache" / MODELS_DIR
    model_files.cache_clear()


def fetch(location: Location, cache_dir: Path) -> Path:
    """As the trainer calls it: into the pod's data cache (RuntimeEnv.data_cache_dir)."""
    return model_files(location, "spec.model.path", cache_dir.parent)


def remote(files: dict[str, bytes]) -> Location:
    fs = fsspec.filesystem("memory")
    root = f"/models-{uuid.uuid4().hex[:8]}"
    for name, data in files.items():
        fs.pipe_file(f"{root}/{name}", data)
    return Location(fs, root, {})


CONFIG = json.dumps({"model_type": "llama"}).encode()


def test_the_key_changes_with_an_objects_etag() -> None:
    a = RemoteObject("s3://b/m/config.json", 10, "etag-1", None)
    b = RemoteObject("s3://b/m/config.json", 10, "etag-2", None)
    assert cache_name("s3://b/m", [a]) != cache_name("s3://b/m", [b])
    # One prefix, one URL hash: an older copy of the prefix is found by it.
    assert cache_name("s3://b/m", [a]).split("-")[0] == cache_name("s3://b/m", [b]).split("-")[0]


def test_files_go_to_the_data_cache_and_a_restart_reuses_them(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = remote({"config.json": CONFIG, "tokenizer.json": b"{}", "w.safetensors": b"x"})
    got = fetch(location, cache_dir)
    assert got.parent == cache_dir
    assert sorted(p.name for p in got.iterdir()) == ["config.json", "tokenizer.json"]
    assert (got / "config.json").read_bytes() == CONFIG

    model_files.cache_clear()  # a restarted worker: a new process

    def no_fetch(*a: object, **kw: object) -> bytes:
        raise AssertionError("fetched again")

    monkeypatch.setattr(location.fs, "cat_file", no_fetch)
    assert fetch(location, cache_dir) == got


def test_a_rewritten_config_is_fetched_again_and_the_old_copy_removed(cache_dir: Path) -> None:
    location = remote({"config.json": CONFIG})
    first = fetch(location, cache_dir)
    location.fs.pipe_file(f"{location.path}/config.json", CONFIG + b" ")
    model_files.cache_clear()
    second = fetch(location, cache_dir)
    assert second != first and not first.exists()
    assert (second / "config.json").read_bytes() == CONFIG + b" "


def test_a_fetch_that_fails_part_way_leaves_nothing_that_is_used(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = remote({"config.json": CONFIG, "tokenizer.json": b"{}"})
    original = location.fs.cat_file

    def reset(path: str, *a: object, **kw: object) -> bytes:
        if path.endswith("tokenizer.json"):
            raise ConnectionResetError("reset by peer")
        return bytes(original(path, *a, **kw))

    monkeypatch.setattr(location.fs, "cat_file", reset)
    with pytest.raises(ConnectionResetError):  # transient: not a refusal
        fetch(location, cache_dir)
    assert list(cache_dir.iterdir()) == []  # config.json was fetched, but not renamed


def test_a_killed_fetchs_staging_directory_is_removed_not_used(cache_dir: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = cache_dir / f"{STAGING}{dead.stdout.strip()}-abcd1234"
    stale.mkdir(parents=True)
    (stale / "config.json").write_bytes(CONFIG[:5])  # killed mid-write
    mine = cache_dir / f"{STAGING}{os.getpid()}-live0000"  # a live rank's: kept
    mine.mkdir()
    got = fetch(remote({"config.json": CONFIG}), cache_dir)
    assert (got / "config.json").read_bytes() == CONFIG
    assert not stale.exists() and mine.exists()


def test_the_cache_root_is_the_one_passed_in_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FT_DATA_CACHE_DIR", str(tmp_path / "from-env"))
    assert cache_root(tmp_path / "pod") == tmp_path / "pod" / MODELS_DIR
    assert cache_root(None) == local_data_dir(None) / MODELS_DIR  # no data cache: temp dir


# ---- the data area's budget (dataset.cacheSizeLimit) --------------------------------------


def test_model_files_over_the_data_areas_budget_are_refused_before_fetching(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    tokenizer = b"t" * 5000
    location = remote({"config.json": CONFIG, "tokenizer.json": tokenizer})
    (cache_dir.parent / "objects").mkdir(parents=True)
    (cache_dir.parent / "objects" / "corpus.jsonl").write_bytes(b"c" * 1000)  # already there
    monkeypatch.setenv("FT_DATA_CACHE_LIMIT_BYTES", str(1000 + len(CONFIG) + len(tokenizer) - 1))
    with pytest.raises(UnsupportedConfigError, match=r"raise dataset\.cacheSizeLimit") as err:
        fetch(location, cache_dir)
    assert location.url in str(err.value)
    assert not [p for p in cache_dir.iterdir()]  # nothing fetched
    monkeypatch.setenv("FT_DATA_CACHE_LIMIT_BYTES", str(1000 + len(CONFIG) + len(tokenizer)))
    # Two local ranks may stage a copy each at once: both must fit.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UnsupportedConfigError, match="2 local ranks' copies"):
        fetch(location, cache_dir)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert (fetch(location, cache_dir) / "tokenizer.json").read_bytes() == tokenizer


def test_model_files_count_in_the_datasets_budget(
    cache_dir: Path, s3_credentials: MotoServer, tmp_path: Path
) -> None:
    """The corpus fetched after the model files (the trainer's order) has what they left."""
    fetch(remote({"config.json": CONFIG, "tokenizer.json": b"t" * 5000}), cache_dir)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"text": "hello"}\n' * 100)
    uri = f"s3://{s3_credentials.new_bucket()}/corpus.jsonl"
    locate(uri, "test", object_store=s3_credentials.spec()).upload(corpus)
    held = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
    assert held == len(CONFIG) + 5000
    data_dir = cache_dir.parent
    size = corpus.stat().st_size
    with pytest.raises(UnsupportedConfigError, match=r"raise dataset\.cacheSizeLimit"):
        stage_dataset(DatasetSpec(uri=uri), s3_credentials.spec(), data_dir, size + held - 1)
    assert stage_dataset(DatasetSpec(uri=uri), s3_credentials.spec(), data_dir, size + held)


def test_a_peers_copy_being_staged_is_not_counted_twice(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two local ranks, a budget for exactly both copies: the peer is part way through its
    # fetch (its staging directory is one of the two copies the check allows for).
    tokenizer = b"t" * 5000
    location = remote({"config.json": CONFIG, "tokenizer.json": tokenizer})
    (cache_dir.parent / "objects").mkdir(parents=True)
    (cache_dir.parent / "objects" / "corpus.jsonl").write_bytes(b"c" * 1000)
    files = len(CONFIG) + len(tokenizer)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("FT_DATA_CACHE_LIMIT_BYTES", str(1000 + 2 * files))
    peer = cache_dir / f"{STAGING}{os.getpid()}-peer0000"  # a live rank's
    peer.mkdir(parents=True)
    (peer / "tokenizer.json").write_bytes(tokenizer)
    assert (fetch(location, cache_dir) / "tokenizer.json").read_bytes() == tokenizer


def test_the_data_areas_use_skips_what_vanishes_while_it_is_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "objects").mkdir()
    (tmp_path / "objects" / "corpus.jsonl").write_bytes(b"c" * 1000)
    staging = tmp_path / MODELS_DIR / f"{STAGING}1-renamed0"
    staging.mkdir(parents=True)
    (staging / "config.json").write_bytes(CONFIG)
    real = os.scandir

    def renamed_meanwhile(path: object = ".") -> object:
        # A peer renames its staging directory into place between the listing of its
        # parent and the walk into it.
        if Path(os.fsdecode(path)) == staging:  # type: ignore[arg-type]
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", renamed_meanwhile)
    assert used_bytes(tmp_path) == 1000
