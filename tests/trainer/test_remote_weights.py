"""Pretrained weights on object storage (model.source uri, model.path s3://...): the header and
range arithmetic of the ranged safetensors reader, and loads against a real S3-compatible
server (moto) giving the logits of a plain `from_pretrained` of the same files, with the
bytes each rank fetched; errors that name the URI."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import MethodSpec, ModelSpec
from finetune_trainer import safetensors_ranges
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.loading import load_parallel_model
from finetune_trainer.location import Location, locate
from finetune_trainer.ranged_reads import RetryPolicy
from finetune_trainer.safetensors_header import Span, parse_header, row_range
from finetune_trainer.safetensors_ranges import batches
from finetune_trainer.tokenizer import build_tokenizer
from tests.objectstore import MotoServer
from tests.trainer.conftest import REPO, TORCHRUN, make_job, write_job
from tests.trainer.test_loading import INPUT, plain_logits, save_pretrained

CPU = torch.device("cpu")
WORKER = REPO / "tests" / "trainer" / "loading_worker.py"


# ---- pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "offsets", "lengths", "want"),
    [((6, 4), (0, 0), (3, 4), (100, 148)), ((6, 4), (3, 0), (3, 4), (148, 196)),
     ((6, 4), (2, 1), (1, 2), (132, 148)), ((5,), (4,), (1,), (116, 120)), ((), (), (), (100, 104))],
    ids=["first-half", "second-half", "inner-slice-reads-whole-rows", "vector", "scalar"],
)  # fmt: skip
def test_a_slice_reads_the_rows_of_dim0_it_covers(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...],
    want: tuple[int, int],
) -> None:  # fmt: skip
    n = 1
    for d in shape:
        n *= d
    span = Span("f", torch.float32, shape, 100, 100 + 4 * n)
    assert row_range(span, offsets, lengths) == want


@pytest.mark.parametrize(
    ("sizes", "limit", "want"),
    [([10, 10, 10], 25, [[0, 1], [2]]), ([30, 5], 25, [[0], [1]]), ([], 5, []),
     ([5, 5, 5], 15, [[0, 1, 2]])],
    ids=["split", "oversized-alone", "empty", "exact"],
)  # fmt: skip
def test_reads_are_batched_by_bytes(sizes: list[int], limit: int, want: list[list[int]]) -> None:
    assert batches(sizes, limit) == want


def header(entries: dict[str, object]) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"\xff not json", "header is not JSON"),
     (header({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}), "dtype 'F8_E4M3'"),
     (header({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}), "spans 8 bytes"),
     (header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "truncated"),
     (b"[1, 2]", "not a JSON object"),
     (header({"w": {"dtype": "F32", "data_offsets": [0, 4]}}), "not lists of non-negative"),
     (header({"w": {"dtype": "F32", "shape": [], "data_offsets": [4, 0]}}), "reversed"),
     (header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),
      "tensors a and b overlap")],
    ids=["not-json", "unknown-dtype", "span-shape-mismatch", "past-the-object", "not-an-object",
         "no-shape", "reversed-offsets", "overlapping"],
)  # fmt: skip
def test_bad_headers_are_refused_naming_the_file(raw: bytes, message: str) -> None:
    # The object as listed: its data ends 1 byte short of the last tensor's.
    size = 8 + len(raw) + 15
    with pytest.raises(ValueError, match=message) as err:
        parse_header("s3://b/m/model.safetensors", raw, 8 + len(raw), size)
    assert "s3://b/m/model.safetensors" in str(err.value)


def test_header_spans_are_absolute() -> None:
    raw = header({"__metadata__": {"format": "pt"},
                  "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                  "b": {"dtype": "F32", "shape": [], "data_offsets": [12, 16]}})  # fmt: skip
    spans = parse_header("f", raw, 8 + len(raw))
    assert spans["a"] == Span("f", torch.bfloat16, (2, 3), 8 + len(raw), 20 + len(raw))
    assert spans["b"].begin == 20 + len(raw) and spans["b"].shape == ()


# ---- against moto ------------------------------------------------------------------------


def upload_dir(local: Path, target: Location) -> None:
    for path in sorted(local.iterdir()):
        (target / path.name).upload(path)


def s3_job(server: MotoServer, uri: str, *, strategy: str, method: str = "full") -> JobConfig:
    job = make_job(strategy=strategy)
    job.spec.model = ModelSpec(name="tiny-llama", source="uri", path=uri)
    job.spec.method = MethodSpec(type=method)  # type: ignore[arg-type]
    job.spec.storage.object_store = server.spec()
    return job


@pytest.fixture
def s3_model(tmp_path: Path, s3_credentials: MotoServer) -> tuple[MotoServer, str, Path]:
    """A tiny Llama saved as sharded safetensors, uploaded to a fresh bucket."""
    save_pretrained(tmp_path / "m", tied=False)
    uri = f"s3://{s3_credentials.new_bucket()}/models/tiny"
    upload_dir(tmp_path / "m", locate(uri, "test", object_store=s3_credentials.spec()))
    return s3_credentials, uri, tmp_path / "m"


class Fetched(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "bytes_read"):
            self.rows.append((record.bytes_read, record.bytes_total))


def test_s3_weights_load_like_from_pretrained_reading_the_whole_model_once(
    s3_model: tuple[MotoServer, str, Path], world_one: None
) -> None:
    server, uri, local = s3_model
    job = s3_job(server, uri, strategy="fsdp-full-shard")
    tokenizer = build_tokenizer(job.spec.model, job.spec.storage.object_store)
    assert tokenizer.pad_token == "<pad>"  # the tokenizer files came with the config
    fetched = Fetched()
    logging.getLogger("finetune_trainer.pretrained").addHandler(fetched)
    logging.getLogger("finetune_trainer.pretrained").setLevel(logging.INFO)
    try:
        model = load_parallel_model(job, tokenizer, CPU, 1).model.eval()
    finally:
        logging.getLogger("finetune_trainer.pretrained").removeHandler(fetched)
    with torch.no_grad():
        assert torch.equal(model(input_ids=INPUT).logits, plain_logits(local))
    # One rank holds every shard: it read every file once, headers and all, no more.
    total = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    assert fetched.rows == [(total, total)]


def test_missing_bucket_and_missing_model_are_refused_naming_the_uri(
    s3_credentials: MotoServer, world_one: None
) -> None:
    for uri in ("s3://no-such-bucket-here/m", f"s3://{s3_credentials.new_bucket()}/absent"):
        job = s3_job(s3_credentials, uri, strategy="ddp")
        with pytest.raises(UnsupportedConfigError) as err:
            build_tokenizer(job.spec.model, job.spec.storage.object_store)
        assert uri in str(err.value) and "spec.model.path" in str(err.value)


def test_a_truncated_weights_object_is_refused_naming_it(
    s3_model: tuple[MotoServer, str, Path], world_one: None
) -> None:
    """The object itself is shorter than its header says (a broken upload): every restart
    would read the same bytes, so it is a refusal (exit 2), not a restart loop."""
    server, uri, local = s3_model
    store = locate(uri, "test", object_store=server.spec())
    name = sorted(p.name for p in local.glob("*.safetensors"))[-1]
    data = (local / name).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert len(data) > 8 + length + 16
    (store / name).write_atomic(data[:-16])  # the header promises 16 bytes more
    job = s3_job(server, uri, strategy="fsdp-full-shard")
    tokenizer = build_tokenizer(job.spec.model, job.spec.storage.object_store)
    with pytest.raises(UnsupportedConfigError) as err:
        load_parallel_model(job, tokenizer, CPU, 1)
    assert f"{uri}/{name}" in str(err.value) and "truncated, 16 bytes short" in str(err.value)


def test_a_short_read_of_a_whole_object_is_an_error_naming_it_not_a_refusal(
    s3_model: tuple[MotoServer, str, Path], world_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer bytes than asked of an object that has them (a broken connection): a restart
    may read them, so not a refusal."""
    server, uri, _ = s3_model
    fs = locate(uri, "test", object_store=server.spec()).fs
    original = fs.cat_ranges

    def short(paths: list[str], starts: list[int], ends: list[int], **kw: object) -> list[bytes]:
        got = original(paths, starts, ends, **kw)
        return [got[0][:-1], *got[1:]]

    monkeypatch.setattr(fs, "cat_ranges", short)
    # Asked again (no pause here) and short every time: raised after the last attempt.
    monkeypatch.setattr(safetensors_ranges, "DEFAULT_RETRY", RetryPolicy(sleep=lambda s: None))
    job = s3_job(server, uri, strategy="fsdp-full-shard")
    tokenizer = build_tokenizer(job.spec.model, job.spec.storage.object_store)
    with pytest.raises(RuntimeError) as err:
        load_parallel_model(job, tokenizer, CPU, 1)
    assert not isinstance(err.value, UnsupportedConfigError)
    assert f"{uri}/" in str(err.value) and "a truncated read" in str(err.value)


def test_a_peer_ranks_short_read_in_a_striped_load_is_no_refusal_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A striped replica load (replica_loading) whose read failed on another rank: DCP raises
    a CheckpointException here, holding that rank's error. A short read there may pass on a
    restart: this rank must not report a refusal (the operator fails the job on one)."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from finetune_trainer import replica_loading
    from finetune_trainer.ranged_reads import ShortReadError

    peer = ShortReadError("s3://bucket/model/model.safetensors: read 3 bytes of 4 at 8")

    def failed_on_rank1(*args: object, **kwargs: object) -> None:
        raise CheckpointException("read", {1: (peer, traceback.StackSummary())})

    monkeypatch.setattr(replica_loading.dcp, "load", failed_on_rank1)
    weights = locate(str(tmp_path), "test")
    reader = safetensors_ranges.RangedSafetensorsReader(weights)  # its own read went well
    with pytest.raises(RuntimeError) as err:
        replica_loading._load_group({}, None, reader, weights)  # type: ignore[arg-type]
    assert not isinstance(err.value, UnsupportedConfigError)
    assert "read 3 bytes of 4" in str(err.value)


# ---- torchrun ----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_read_their_shards_from_s3_not_the_model(
    tmp_path: Path, s3_model: tuple[MotoServer, str, Path]
) -> None:
    server, uri, local = s3_model
    job = s3_job(server, uri, strategy="fsdp-full-shard")
    cfg = write_job(tmp_path / "job.json", job)
    out = tmp_path / "out.pt"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", str(WORKER), "model", str(out), str(cfg)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert torch.equal(got["logits"], plain_logits(local))
    files = sorted(local.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in files)
    index = (local / "model.safetensors.index.json").stat().st_size
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in files)
    rows = got["fetched"]
    # Each rank half the data (dim-0 shards of even sizes), rank 0 the index and every
    # header for both (rank_zero_read); together, every byte exactly once.
    fetched = [row["bytes_read"] for row in rows]
    assert sum(fetched) == total, (fetched, total, headers)
    for rank, row in enumerate(rows):
        assert row["bytes_read"] < 0.6 * total, (fetched, total)
        # The model is far smaller than the 1 MiB gap: a rank's rows of each file coalesce
        # into one request (the other rank's rows between them read and dropped), besides,
        # on rank 0, the index and two reads per header.
        assert row["requests"] == len(files) + (1 + 2 * len(files) if rank == 0 else 0), row
        assert row["bytes_index"] == (index if rank == 0 else 0)
        assert 0 < row["bytes_gaps"] < total - headers, row

    # DDP holds a whole replica per rank, yet reads it from the store once per job: a stripe
    # per rank, all-gathered (finetune_trainer.replica_loading).
    ddp = write_job(tmp_path / "ddp.json", s3_job(server, uri, strategy="ddp"))
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", str(WORKER), "model", str(out), str(ddp)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert torch.equal(got["logits"], plain_logits(local))
    fetched = [row["bytes_read"] for row in got["fetched"]]
    # Every byte once between them: the headers read once (rank 0's, shared by every DCP
    # load of the stripes and every rank).
    assert sum(fetched) == total, (fetched, total)
    assert all(f < 0.6 * total for f in fetched), (fetched, total)  # neither read it whole


def test_a_tensor_in_two_files_of_the_prefix_is_refused_naming_both(tmp_path: Path) -> None:
    """A consolidated model.safetensors left beside the shards (or two models under one
    prefix): which copy of the tensor would be read is an accident, so neither is."""
    from safetensors.torch import save_file

    from finetune_trainer.safetensors_ranges import RangedSafetensorsReader

    save_file({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    reader = RangedSafetensorsReader(locate(str(tmp_path), "test"))
    with pytest.raises(ValueError, match="tensor w is also in") as err:
        reader.read_metadata()
    assert "model.safetensors" in str(err.value) and "model-00001-of-00001" in str(err.value)
    (tmp_path / "model.safetensors").unlink()
    assert set(reader.read_metadata().state_dict_metadata) == {"w"}
