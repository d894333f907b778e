"""A dataset on object storage (dataset.uri s3://...), against a real S3-compatible server
(moto): fetched once per pod into its data area, read like files (jsonl, parquet, a glob),
and tokenized through the per-pod cache, whose key follows the objects' identity (ETag): a
rewritten object is fetched again and never served from the stale entry. Errors name the URI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data import CacheSettings, TokenBlocks, build_dataset
from finetune_trainer.data.remote import (
    OBJECTS_DIR,
    RemoteObject,
    fits,
    list_objects,
    local_names,
    stage_dataset,
)
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import locate
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.objectstore import MotoServer
from tests.trainer.test_data_cache import SEQ, reference_blocks, write_corpus


def obj(url: str, size: int = 1) -> RemoteObject:
    return RemoteObject(url, size, "e", None)


def test_local_names_keep_key_order_and_tell_equal_base_names_apart() -> None:
    names = local_names(
        [obj("s3://b/a/part.jsonl"), obj("s3://b/b/part.jsonl"), obj("s3://b/c.jsonl")]
    )
    assert names == ["00000-part.jsonl", "00001-part.jsonl", "00002-c.jsonl"]
    assert sorted(names) == names


@pytest.mark.parametrize(("budget", "want"), [(None, True), (30, True), (29, False)],
                         ids=["no-limit", "exact", "over"])  # fmt: skip
def test_a_corpus_must_fit_the_data_area(budget: int | None, want: bool) -> None:
    assert fits([obj("s3://b/x", 10), obj("s3://b/y", 20)], budget) is want


def texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


@pytest.fixture
def bucket(s3_credentials: MotoServer) -> tuple[MotoServer, str]:
    return s3_credentials, f"s3://{s3_credentials.new_bucket()}"


def put(server: MotoServer, uri: str, source: Path) -> None:
    locate(uri, "test", object_store=server.spec()).upload(source)


def load(server: MotoServer, spec: DatasetSpec, data_dir: Path, **kw: Any) -> TokenBlocks:
    staged = stage_dataset(spec, server.spec(), data_dir, kw.get("limit"))
    assert staged is not None
    cache = CacheSettings(data_dir, kw.get("limit"))
    return build_dataset(spec, build_byte_tokenizer(), SEQ, cache, staged=staged)


def test_jsonl_objects_are_fetched_once_and_a_changed_object_is_not_served_stale(
    bucket: tuple[MotoServer, str], tmp_path: Path
) -> None:
    server, root = bucket
    first, second = write_corpus(tmp_path / "a.jsonl"), write_corpus(tmp_path / "b.jsonl", seed=1)
    put(server, f"{root}/corpus/part-0.jsonl", first)
    put(server, f"{root}/corpus/part-1.jsonl", second)
    put(server, f"{root}/corpus/notes.txt", first)  # outside the glob
    spec = DatasetSpec(uri=f"{root}/corpus/part-*.jsonl", format="jsonl")
    data = tmp_path / "pod"
    built = load(server, spec, data)
    assert built.source == "cache built"
    assert np.array_equal(
        np.asarray(built.blocks), reference_blocks(texts(first) + texts(second), SEQ)
    )
    copies = sorted((data / OBJECTS_DIR).glob("*/[0-9]*"))
    assert [p.name for p in copies] == ["00000-part-0.jsonl", "00001-part-1.jsonl"]
    stamps = [p.stat().st_mtime_ns for p in copies]
    # A restart of the pod's workers: the copy is current, the entry is hit.
    assert load(server, spec, data).source == "cache hit"
    assert [p.stat().st_mtime_ns for p in copies] == stamps
    # The same key rewritten with other records of the very same size: only its ETag says.
    changed = tmp_path / "c.jsonl"
    changed.write_text(second.read_text().replace("quick", "brown"))
    assert changed.stat().st_size == second.stat().st_size and texts(changed) != texts(second)
    put(server, f"{root}/corpus/part-1.jsonl", changed)
    rebuilt = load(server, spec, data)
    assert rebuilt.source == "cache built"
    want = reference_blocks(texts(first) + texts(changed), SEQ)
    assert np.array_equal(np.asarray(rebuilt.blocks), want)


def test_a_parquet_object_reads_like_the_same_file_on_a_volume(
    bucket: tuple[MotoServer, str], tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    server, root = bucket
    rows = texts(write_corpus(tmp_path / "a.jsonl"))
    pq.write_table(pa.table({"text": rows}), tmp_path / "train.parquet", row_group_size=40)
    put(server, f"{root}/train.parquet", tmp_path / "train.parquet")
    remote = load(
        server, DatasetSpec(uri=f"{root}/train.parquet", format="parquet"), tmp_path / "pod"
    )
    local = build_dataset(DatasetSpec(uri=str(tmp_path / "train.parquet"), format="parquet"),
                          build_byte_tokenizer(), SEQ)  # fmt: skip
    assert np.array_equal(np.asarray(remote.blocks), local.blocks)


def test_missing_objects_and_buckets_and_a_corpus_too_big_are_refused_naming_the_uri(
    bucket: tuple[MotoServer, str], tmp_path: Path
) -> None:
    server, root = bucket
    put(server, f"{root}/big.jsonl", write_corpus(tmp_path / "a.jsonl", rows=400))
    cases = [
        (f"{root}/absent.jsonl", None, "no such bucket or object"),
        (f"{root}/absent-*.jsonl", None, "no such object"),
        ("s3://no-such-bucket-anywhere/x.jsonl", None, "no such bucket or object"),
        (f"{root}/big.jsonl", 1000, "raise dataset.cacheSizeLimit"),
    ]
    for uri, limit, message in cases:
        with pytest.raises(UnsupportedConfigError) as err:
            stage_dataset(DatasetSpec(uri=uri), server.spec(), tmp_path / "pod", limit)
        assert f"dataset.uri {uri!r}" in str(err.value) and message in str(err.value), err.value


def test_paths_are_not_staged(tmp_path: Path) -> None:
    assert stage_dataset(DatasetSpec(uri=str(tmp_path / "x.jsonl")), None, tmp_path) is None
    assert stage_dataset(DatasetSpec(uri="builtin://quickstart"), None, tmp_path) is None


def test_a_dataset_not_in_jsonl_or_parquet_objects_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedConfigError, match="format hf is not read from object storage"):
        stage_dataset(DatasetSpec(uri="s3://b/ds", format="hf"), None, tmp_path)


def test_denied_credentials_are_refused_naming_the_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that checks keys (moto with IAM auth from the first request): the test's keys
    belong to no user, so every request is denied (InvalidAccessKeyId, 403)."""
    from finetune_operator.api.spec import ModelSpec
    from finetune_trainer.tokenizer import build_tokenizer
    from tests.objectstore import CREDENTIALS, moto_server

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")
    with moto_server() as server:
        uri = "s3://some-bucket/data.jsonl"
        with pytest.raises(UnsupportedConfigError) as err:
            stage_dataset(DatasetSpec(uri=uri), server.spec(), tmp_path)
        assert f"dataset.uri {uri!r}: access denied" in str(err.value)
        model = ModelSpec(name="m", source="uri", path="s3://some-bucket/model")
        with pytest.raises(UnsupportedConfigError) as err:
            build_tokenizer(model, server.spec())
        assert "spec.model.path 's3://some-bucket/model': access denied" in str(err.value)


def test_a_short_download_is_an_error_naming_the_object_and_leaves_no_file(
    bucket: tuple[MotoServer, str], tmp_path: Path
) -> None:
    """Fewer bytes than the listing promised (a broken connection, or the object replaced
    meanwhile): not a refusal (a restart fetches it again), and nothing half-written stays."""
    from finetune_trainer.data.remote import download

    server, root = bucket
    corpus = write_corpus(tmp_path / "a.jsonl")
    uri = f"{root}/data.jsonl"
    put(server, uri, corpus)
    promised = RemoteObject(uri, corpus.stat().st_size + 10, "etag", None)
    target = tmp_path / "copy" / "00000-data.jsonl"
    target.parent.mkdir()
    with pytest.raises(OSError) as err:
        download(DatasetSpec(uri=uri), locate(uri, "test", object_store=server.spec()),
                  promised, target)  # fmt: skip
    assert not isinstance(err.value, UnsupportedConfigError)
    assert f"{uri} downloaded {corpus.stat().st_size} of {promised.size} bytes" in str(err.value)
    assert list(target.parent.iterdir()) == []


def test_an_object_rewritten_while_fetched_is_not_kept_under_its_listed_etag(
    bucket: tuple[MotoServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key rewritten (same size) between the listing and the end of its download: the
    bytes are not the listed object's, so neither the copy nor its manifest is kept (else the
    tokenized cache would serve the new records for the old ETag); a restart fetches anew."""
    server, root = bucket
    first = write_corpus(tmp_path / "a.jsonl")
    changed = tmp_path / "b.jsonl"
    changed.write_text(first.read_text().replace("quick", "brown"))
    assert changed.stat().st_size == first.stat().st_size
    uri = f"{root}/corpus/part-0.jsonl"
    put(server, uri, first)
    spec = DatasetSpec(uri=f"{root}/corpus/part-*.jsonl", format="jsonl")
    source = locate(uri, "test", object_store=server.spec())
    fs, original = source.fs, source.fs.get_file
    # Another process's client: this process's cached listing does not see its write.
    writer = type(fs)(**{**fs.storage_options, "skip_instance_cache": True})

    def get_then_rewrite(rpath: str, lpath: str, **kw: Any) -> None:
        original(rpath, lpath, **kw)
        writer.put_file(str(changed), source.path)  # a writer replacing the object meanwhile

    monkeypatch.setattr(fs, "get_file", get_then_rewrite)
    data = tmp_path / "pod"
    with pytest.raises(OSError, match="changed while downloading") as err:
        stage_dataset(spec, server.spec(), data)
    assert not isinstance(err.value, UnsupportedConfigError)  # transient: a restart
    assert list((data / OBJECTS_DIR).glob("*/*")) == []
    monkeypatch.setattr(fs, "get_file", original)
    built = load(server, spec, data)  # the restart: the object as it is now
    assert np.array_equal(np.asarray(built.blocks), reference_blocks(texts(changed), SEQ))


def test_every_rank_stages_the_listing_it_is_given_not_its_own(
    bucket: tuple[MotoServer, str], tmp_path: Path
) -> None:
    """Rank 0 listed before a second object appeared (its listing broadcast: `agree`): this
    rank, listing after, still stages rank 0's objects, so both tokenize one corpus (the same
    length, the same step count) and the tokenized cache is keyed alike."""
    server, root = bucket
    first, second = write_corpus(tmp_path / "a.jsonl"), write_corpus(tmp_path / "b.jsonl", seed=1)
    put(server, f"{root}/corpus/part-0.jsonl", first)
    spec = DatasetSpec(uri=f"{root}/corpus/part-*.jsonl", format="jsonl")
    rank0 = list_objects(spec, locate(spec.uri, "test", object_store=server.spec()))
    put(server, f"{root}/corpus/part-1.jsonl", second)
    seen: list[list[RemoteObject]] = []

    def agree(mine: list[RemoteObject]) -> list[RemoteObject]:
        seen.append(mine)
        return rank0

    staged = stage_dataset(spec, server.spec(), tmp_path / "pod", agree=agree)
    assert staged is not None and len(seen[0]) == 2  # its own listing had both
    assert staged.files == [o.identity() for o in rank0]
    assert [p.name for p in (tmp_path / "pod" / OBJECTS_DIR).glob("*/[0-9]*")] == [
        "00000-part-0.jsonl"
    ]


def test_the_listing_rank_0_broadcasts_arrives_whole() -> None:
    """What the trainer passes as `agree` (one rank here: the pickling round trip)."""
    import torch
    import torch.distributed as dist

    from finetune_trainer.distributed import Distributed
    from tests.trainer.conftest import free_port

    listing = [RemoteObject("s3://b/k/part-0.jsonl", 12, "9b2cf535f27731c974343645a3985328", None)]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        group = Distributed(torch.device("cpu"), 1, 0, checkpoint_group=dist.group.WORLD)
        assert group.rank0s(listing) == listing
    finally:
        dist.destroy_process_group()


def test_an_object_gone_between_listing_and_download_is_not_a_refusal(
    bucket: tuple[MotoServer, str], tmp_path: Path
) -> None:
    """Rank 0 listed it; it was deleted (or replaced by delete and put) before this rank's
    download: a race a restart's listing settles, so not exit 2."""
    server, root = bucket
    uri = f"{root}/corpus/part-0.jsonl"
    put(server, uri, write_corpus(tmp_path / "a.jsonl"))
    spec = DatasetSpec(uri=f"{root}/corpus/part-*.jsonl", format="jsonl")
    rank0 = list_objects(spec, locate(spec.uri, "test", object_store=server.spec()))
    put(server, f"{root}/corpus/part-1.jsonl", tmp_path / "a.jsonl")  # the glob still matches
    locate(uri, "test", object_store=server.spec()).remove()
    with pytest.raises(OSError, match="was listed but is gone") as err:
        stage_dataset(spec, server.spec(), tmp_path / "pod", agree=lambda _: rank0)
    assert not isinstance(err.value, UnsupportedConfigError)
