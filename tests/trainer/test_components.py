"""Tokenizer, data, model and strategy refusals on their own (no process group)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from finetune_operator.api.constants import BYTE_TOKENIZER_VOCAB
from finetune_operator.api.spec import DatasetSpec, MethodSpec
from finetune_trainer.data import build_dataset, load_records, pack, resolve_uri
from finetune_trainer.data.records import dataset_files
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.metrics import StepStats, TrainerMetrics
from finetune_trainer.model import build_model, decoder_layers
from finetune_trainer.parallelize import offload_policy, parallelize
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.trainer.conftest import make_job

CPU = torch.device("cpu")


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = build_byte_tokenizer()
    text = "Héllo, wörld\n\ttabs"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert (len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (259, 256, 257, 258)
    assert len(tok) == BYTE_TOKENIZER_VOCAB  # what the planner requires of inline models


def test_builtin_corpus_is_shipped_english_and_small() -> None:
    path = Path(resolve_uri("builtin://quickstart"))
    assert 50_000 < path.stat().st_size < 400_000
    first = json.loads(path.read_text().splitlines()[0])["text"]
    assert " the " in first
    with pytest.raises(UnsupportedConfigError, match="unknown builtin"):
        resolve_uri("builtin://nope")


def test_packing_makes_full_blocks() -> None:
    blocks = pack([[1, 2, 3], [4, 5, 6, 7], [8]], 3)
    assert blocks.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_quickstart_dataset_and_batch() -> None:
    ds = build_dataset(DatasetSpec(uri="builtin://quickstart"), build_byte_tokenizer(), 128)
    assert len(ds) > 1000
    batch = ds.batch([0, 5], CPU)
    assert batch["input_ids"].shape == (2, 128)
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_chat_messages_unpacked(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 3))
    spec = DatasetSpec(uri=str(tmp_path / "chat.jsonl"), messages_field="messages", packing=False)
    tok = build_byte_tokenizer()
    ds = build_dataset(spec, tok, 64)
    batch = ds.batch([0], CPU)
    ids = batch["input_ids"][0].tolist()
    assert ids[0] == tok.bos_token_id and "<|assistant|>\nyo" in tok.decode(ids)
    assert (
        (batch["labels"][0] == -100).sum() == (batch["input_ids"][0] == tok.pad_token_id).sum() > 0
    )


def test_missing_text_field_is_named(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UnsupportedConfigError, match="textField 'text'"):
        build_dataset(DatasetSpec(uri=str(tmp_path / "d.jsonl")), build_byte_tokenizer(), 8)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_missing_dataset_file_is_refused_not_crashed(fmt: str, tmp_path: Path) -> None:
    """A refusal fails the job at once naming the field; a crash would be restarted in vain."""
    spec = DatasetSpec(uri=str(tmp_path / f"missing.{fmt}"), format=fmt)
    with pytest.raises(UnsupportedConfigError, match=r"dataset.uri '.*missing.*': no such file"):
        build_dataset(spec, build_byte_tokenizer(), 8)


def test_missing_relative_dataset_names_the_directory_it_was_read_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative uri is read in the pod's working directory (`ftjob run --local`: its
    cluster's shared/), not where the user ran ftjob: the error says which directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedConfigError) as caught:
        dataset_files(DatasetSpec(uri="data/mine.jsonl"))
    assert str(caught.value) == (
        f"dataset.uri 'data/mine.jsonl': no such file in the working directory {tmp_path}: "
        "use an absolute path on a volume of spec.storage"
    )


def test_a_dataset_directory_reads_its_files_of_the_format(tmp_path: Path) -> None:
    """dataset.uri may be a directory (the reference says so): it was opened as a file, an
    IsADirectoryError that torchrun restarted until the budget ran out."""
    corpus = tmp_path / "my corpus"
    corpus.mkdir()
    (corpus / "b.jsonl").write_text('{"text": "second"}\n')
    (corpus / "a.jsonl").write_text('{"text": "first"}\n')
    (corpus / "notes.txt").write_text("not data")
    records = load_records(DatasetSpec(uri=str(corpus)))
    assert records.column("text") == ["first", "second"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedConfigError) as caught:
        load_records(DatasetSpec(uri=str(tmp_path / "empty")))
    assert str(caught.value).endswith(
        f"is a directory with no *.jsonl file in it: name the files (e.g. "
        f"'{tmp_path / 'empty' / '*.jsonl'}') or set dataset.format"
    )


@pytest.mark.parametrize("source", ["pvc", "uri"])
def test_a_missing_model_directory_is_refused_naming_the_field(source: str, tmp_path: Path) -> None:
    """The tokenizer is read before the model: for a path that is not there it raised
    transformers' "Repo id must be in the form 'namespace/repo_name'", which torchrun restarted
    until the budget ran out (BackoffLimitExceeded, 30 s, naming no field)."""
    from finetune_operator.api.spec import ModelSpec
    from finetune_trainer.tokenizer import build_tokenizer

    missing = tmp_path / "models" / "nope"
    spec = ModelSpec(name="tiny", source=source, path=str(missing))
    with pytest.raises(UnsupportedConfigError) as caught:
        build_tokenizer(spec)
    assert str(caught.value).startswith(f"spec.model.path '{missing}': no such directory")


def test_jsonl_files_read_as_written_with_missing_columns_none(tmp_path: Path) -> None:
    """Read without `datasets`, as `datasets` 4 gives them: every column on every row (None
    where a row lacks it), nested values as written, files of a glob in name order."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "name": "x"}]
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second", "id": 2}) + "\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "first", "messages": chat}) + "\n\n")
    records = load_records(DatasetSpec(uri=str(tmp_path / "*.jsonl")))
    assert records.column_names == ["text", "messages", "id"]
    assert records.column("text") == ["first", "second"]
    assert list(records.rows()) == [
        {"text": "first", "messages": chat, "id": None},
        {"text": "second", "messages": None, "id": 2},
    ]


@pytest.mark.parametrize(
    ("line", "why"), [("{oops", "is not JSON"), ("[1, 2]", "is not a JSON object")]
)
def test_jsonl_line_that_is_no_record_is_refused_naming_it(
    line: str, why: str, tmp_path: Path
) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(UnsupportedConfigError, match=rf"dataset.uri .*d.jsonl line 2 {why}"):
        load_records(DatasetSpec(uri=str(tmp_path / "d.jsonl")))


def test_jsonl_bad_line_error_says_where_on_the_line_and_what_to_do(tmp_path: Path) -> None:
    # json's own message for a raw newline in a string is "Invalid control character at",
    # which names no place: the error adds the column and the remedy.
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": "broken\tline"}\n')
    with pytest.raises(UnsupportedConfigError) as caught:
        load_records(DatasetSpec(uri=str(tmp_path / "d.jsonl")))
    assert "line 2 is not JSON (Invalid control character at column 17)" in str(caught.value)
    assert "fix or remove that line" in str(caught.value)


def test_parquet_records(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": ["hello world " * 20] * 4, "n": [1, 2, 3, 4]}), tmp_path / "d.parquet"
    )
    spec = DatasetSpec(uri=str(tmp_path / "d.parquet"), format="parquet")
    assert load_records(spec).column("n") == [1, 2, 3, 4]
    assert len(build_dataset(spec, build_byte_tokenizer(), 64)) == 4 * 242 // 64


def test_inline_model_and_lora() -> None:
    job = make_job()
    tok = build_byte_tokenizer()
    full = build_model(
        job.spec.model, job.spec.method, tok, CPU, activation_checkpointing=True, precision="fp32"
    )
    assert full.config.vocab_size == 259 and len(decoder_layers(full)) == 2
    assert full.is_gradient_checkpointing
    lora = build_model(
        job.spec.model,
        MethodSpec(type="lora"),
        tok,
        CPU,
        activation_checkpointing=False,
        precision="fp32",
    )
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in lora.parameters()) / 5
    assert len(decoder_layers(lora)) == 2  # found through the peft wrapper


def test_qlora_refused_on_cpu() -> None:
    job = make_job()
    with pytest.raises(UnsupportedConfigError, match="qlora needs a CUDA GPU"):
        build_model(
            job.spec.model,
            MethodSpec(type="qlora"),
            build_byte_tokenizer(),
            CPU,
            activation_checkpointing=False,
            precision="bf16",
        )


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_refused_not_replaced(strategy: str) -> None:
    """The torch path never runs a DeepSpeed row as something else (zero3 on deepspeed is not
    FSDP full shard), implemented or not."""
    job = make_job(strategy=strategy)
    plan = job.plan.model_copy(update={"backend": "deepspeed"})
    with pytest.raises(UnsupportedConfigError, match="backend deepspeed is not implemented by"):
        parallelize(
            torch.nn.Linear(2, 2),
            plan,
            CPU,
            1,
            precision="bf16",
        )


METRIC_NAMES = [
    "finetune_trainer_step",
    "finetune_trainer_total_steps",
    "finetune_trainer_loss",
    "finetune_trainer_step_duration_seconds_bucket",
    "finetune_trainer_compute_duration_seconds_sum",
    "finetune_trainer_wait_duration_seconds_count",
    "finetune_trainer_tokens_total",
    "finetune_trainer_checkpoint_blocking_seconds_count",
    "finetune_trainer_checkpoint_save_duration_seconds_count",
    "finetune_trainer_checkpoint_stall_seconds_count",
    "finetune_trainer_checkpoint_failures_total",
    "finetune_trainer_last_failed_checkpoint_step",
    "finetune_trainer_last_checkpoint_step",
    "finetune_trainer_last_checkpoint_timestamp_seconds",
    "finetune_trainer_reforms",
    "finetune_trainer_peak_memory_bytes",
]


def test_metrics_names_and_labels() -> None:
    m = TrainerMetrics(job="quickstart", rank=1, device=CPU, reforms=2, total_steps=60)
    m.observe_step(
        StepStats(
            step=3,
            loss=2.5,
            lr=1e-3,
            tokens=1024,
            step_seconds=0.2,
            compute_seconds=0.15,
            wait_seconds=0.05,
        ),
        world_size=2,
    )
    m.observe_checkpoint_committed(3, 0.4)
    text = generate_latest(m.registry).decode()
    for name in METRIC_NAMES:
        pattern = rf'^{name}{{[^}}]*finetunejob="quickstart"[^}}]*rank="1"'
        assert re.search(pattern, text, re.M), name
    assert 'finetune_trainer_reforms{finetunejob="quickstart",rank="1"} 2.0' in text
    assert 'finetune_trainer_tokens_total{finetunejob="quickstart",rank="1"} 512.0' in text
    assert "job=" not in text.replace("finetunejob=", "")


def test_token_count_is_read_on_the_host_and_matches_the_mask() -> None:
    from finetune_trainer.data import TokenBlocks

    blocks = np.array([[1, 2, 9, 9], [3, 9, 9, 9]], dtype=np.uint16)
    padded = TokenBlocks(blocks=blocks, pad_id=9)
    batch = padded.batch([0, 1], CPU)
    assert padded.count_tokens([0, 1]) == int(batch["attention_mask"].sum()) == 3
    packed = TokenBlocks(blocks=blocks, pad_id=None)
    assert packed.count_tokens([1]) == int(packed.batch([1], CPU)["attention_mask"].sum()) == 4


def test_fused_adamw_only_where_every_trainable_parameter_is_on_cuda() -> None:
    from finetune_trainer.optim import adamw_implementation

    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    assert adamw_implementation([torch.nn.Parameter(torch.zeros(2)), frozen]) == {}
    assert adamw_implementation([frozen]) == {}


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("1", True), ("0", False)])
def test_compile_knob(raw: str | None, expected: bool) -> None:
    from finetune_trainer.config import RuntimeEnv

    env = {} if raw is None else {"FT_COMPILE": raw}
    assert RuntimeEnv.from_environ(env).compile is expected


def test_fsdp_offloads_as_the_plan_says_and_only_from_a_gpu() -> None:
    # The planner's offload is what runs (none for FSDP2 on a CPU device); the device is
    # checked again in case a GPU plan meets a CPU.
    assert type(offload_policy("cpu", torch.device("cuda"))) is CPUOffloadPolicy
    assert type(offload_policy("none", torch.device("cuda"))) is OffloadPolicy
    assert type(offload_policy("cpu", CPU)) is OffloadPolicy
    with pytest.raises(UnsupportedConfigError, match="nvme"):
        offload_policy("nvme", torch.device("cuda"))
