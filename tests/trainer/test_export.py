"""The model export (`spec.output`) in one process (gloo, world 1, the DDP wrapper the trainer
uses): full model, LoRA adapter, merged LoRA, atomic replacement; the no-op stand-in; and a
two-rank FSDP2 run under torchrun (slow)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import MethodSpec, OutputSpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.export import (
    FINISHED_MARKER,
    HfExporter,
    NoOpExporter,
    build_exporter,
    resolve_output,
)
from finetune_trainer.location import locate
from finetune_trainer.model import build_model
from finetune_trainer.ownership import StorageRefusedError
from finetune_trainer.parallelize import parallelize
from finetune_trainer.termination_log import write_error_report, write_final_report
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.objectstore import MotoServer
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    tail,
    write_job,
)

INPUT = torch.tensor([[256, *b"The export reloads.", 257]])


def trained(method: MethodSpec, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """The quickstart model as the trainer wraps it (DDP), with weights moved off their init
    (LoRA B starts at zero: an untrained adapter would be a no-op)."""
    job = make_job()
    torch.manual_seed(0)
    model = build_model(
        job.spec.model,
        method,
        tokenizer,
        torch.device("cpu"),
        activation_checkpointing=False,
        precision=job.spec.training.precision,
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return parallelize(
        model,
        job.plan,
        torch.device("cpu"),
        1,
        precision=job.spec.training.precision,
    ).model


def logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def exporter(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    method: MethodSpec,
    out: Path,
    *,
    merge: bool = False,
) -> HfExporter:
    spec = OutputSpec(uri=str(out), merge_lora=merge)
    return HfExporter(
        spec,
        model=model,
        tokenizer=tokenizer,
        method=method,
        rank=0,
        meta={"job": "t", "strategy": "ddp"},
    )


def test_full_model_reloads_with_identical_logits(world_one: None, tmp_path: Path) -> None:
    tok, method = build_byte_tokenizer(), MethodSpec(type="full")
    model = trained(method, tok)
    out = tmp_path / "out"
    assert exporter(model, tok, method, out).export(7, loss=1.5) == locate(str(out), "o")

    assert {"config.json", "model.safetensors", FINISHED_MARKER} <= {p.name for p in out.iterdir()}
    marker = json.loads((out / FINISHED_MARKER).read_text())
    assert marker["step"] == 7 and marker["loss"] == 1.5 and marker["method"] == "full"
    assert marker["strategy"] == "ddp" and marker["time"] > 0
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(reloaded), logits(model))
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    text = "héllo ✓"
    assert reloaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert reloaded_tok.pad_token_id == tok.pad_token_id
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing staged left behind


def test_lora_adapter_reloads_with_peft(world_one: None, tmp_path: Path) -> None:
    from peft import PeftModel

    tok, method = build_byte_tokenizer(), MethodSpec(type="lora")
    model = trained(method, tok)
    live = model.module
    base = copy.deepcopy(live).unload()  # the untouched base weights the adapter applies to
    base.save_pretrained(tmp_path / "base")
    out = tmp_path / "out"
    exporter(model, tok, method, out).export(3)

    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", FINISHED_MARKER} <= names
    assert "model.safetensors" not in names
    assert all("lora_" in k for k in load_file(out / "adapter_model.safetensors"))
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out
    )
    torch.testing.assert_close(logits(adapted), logits(model), rtol=0, atol=1e-6)


def test_merged_lora_is_a_plain_model_with_the_adapted_logits(
    world_one: None, tmp_path: Path
) -> None:
    tok, method = build_byte_tokenizer(), MethodSpec(type="lora")
    model = trained(method, tok)
    before = logits(model)
    out = tmp_path / "out"
    exporter(model, tok, method, out, merge=True).export(3)

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= names and "adapter_config.json" not in names
    assert not any("lora" in k for k in load_file(out / "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(merged), before, rtol=0, atol=1e-5)
    assert torch.equal(logits(model), before)  # merging left the trained model alone
    assert json.loads((out / FINISHED_MARKER).read_text())["mergeLora"] is True


def test_export_replaces_the_previous_one_and_cleans_unfinished(
    world_one: None, tmp_path: Path
) -> None:
    tok, method = build_byte_tokenizer(), MethodSpec(type="full")
    model = trained(method, tok)
    out = tmp_path / "out"
    (tmp_path / "out.tmp-2").mkdir()  # a crashed earlier attempt
    (tmp_path / "out.tmp-2" / "model.safetensors").write_text("half")
    exporter(model, tok, method, out).export(2)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    exporter(model, tok, method, out).export(4)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((out / FINISHED_MARKER).read_text())["step"] == 4
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model))


def test_an_existing_directory_that_is_not_our_export_is_refused_untouched(
    world_one: None, tmp_path: Path
) -> None:
    tok, method = build_byte_tokenizer(), MethodSpec(type="full")
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(StorageRefusedError, match="not an export of this job"):
        exporter(nn.Linear(1, 1), tok, method, out)  # refused at start, before training
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # Filled while the job trained: refused at publish, the staged copy removed.
    fresh = tmp_path / "fresh"
    exp = exporter(trained(method, tok), tok, method, fresh)
    fresh.mkdir()
    (fresh / "notes.txt").write_text("keep me")
    with pytest.raises(StorageRefusedError):
        exp.export(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "results"]
    assert (fresh / "notes.txt").read_text() == "keep me"


def test_export_to_s3_reloads_and_replaces_the_previous_one(
    world_one: None, tmp_path: Path, s3_credentials: MotoServer
) -> None:
    """s3:// (moto's server): the export is uploaded with its marker last; a second export
    replaces the first without leaving any of its files; the model reloads."""
    tok, method = build_byte_tokenizer(), MethodSpec(type="full")
    model = trained(method, tok)
    uri = f"s3://{s3_credentials.new_bucket()}/models/q"
    spec = OutputSpec(uri=uri)

    def export(step: int) -> None:
        exp = build_exporter(
            spec,
            model=model,
            tokenizer=tok,
            method=method,
            rank=0,
            meta={"job": "t"},
            object_store=s3_credentials.spec(),
        )
        assert str(exp.export(step)) == uri

    export(2)
    root = resolve_output(uri, object_store=s3_credentials.spec())
    (root / "stale.bin").write_atomic(b"from the first export")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    export(4)
    names = set(root.sizes())
    assert {"config.json", "model.safetensors", FINISHED_MARKER} <= names
    assert "stale.bin" not in names
    assert json.loads((root / FINISHED_MARKER).read_text())["step"] == 4
    local = tmp_path / "download"
    root.fs.get(root.path + "/", str(local), recursive=True)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(local)), logits(model))


def test_no_output_uri_is_a_no_op() -> None:
    exp = build_exporter(
        OutputSpec(),
        model=nn.Linear(1, 1),
        tokenizer=build_byte_tokenizer(),
        method=MethodSpec(),
        rank=0,
        meta={},
    )
    assert isinstance(exp, NoOpExporter)
    assert exp.export(5, loss=1.0) is None


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("out/model", "cwd/out/model"),
        ("/abs/model", "/abs/model"),
        ("file:///abs/model", "/abs/model"),
    ],
    ids=["relative", "absolute", "file-scheme"],
)
def test_output_uri_resolves_like_the_checkpoint_uri(uri: str, expected: str) -> None:
    assert resolve_output(uri, Path("cwd")).url == expected


@pytest.mark.parametrize(
    ("uri", "method", "merge", "field"),
    [
        ("gs://bucket/model", "full", False, "output.uri"),
        ("out", "qlora", True, "output.mergeLora"),
    ],
    ids=["object-storage", "qlora-merge"],
)
def test_unsupported_outputs_name_the_field(uri: str, method: str, merge: bool, field: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=field):
        build_exporter(
            OutputSpec(uri=uri, merge_lora=merge),
            model=nn.Linear(1, 1),
            tokenizer=build_byte_tokenizer(),
            method=MethodSpec(type=method),
            rank=0,
            meta={},
        )


@pytest.mark.parametrize("output", [None, "/shared/out"], ids=["without", "with"])
def test_final_report_carries_the_output(tmp_path: Path, output: str | None) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    assert write_final_report(
        step=3, loss=None, checkpoint_step=0, rank=0, path=str(log), output=output
    )
    report = json.loads(log.read_text())
    assert report == {"step": 3, "rank": 0, **({"output": output} if output else {})}


def with_output(job: JobConfig, uri: str, method: str, merge: bool) -> JobConfig:
    spec = job.spec.model_copy(
        update={"method": MethodSpec(type=method), "output": OutputSpec(uri=uri, merge_lora=merge)}
    )
    return job.model_copy(update={"spec": spec})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "merge"), [("full", False), ("lora", True)], ids=["full", "lora-merged"]
)
def test_fsdp_two_ranks_export_matches_the_final_checkpoint(
    tmp_path: Path, procs: list[Proc], method: str, merge: bool
) -> None:
    job = with_output(
        make_job(
            strategy="fsdp-full-shard", training={"maxSteps": 6}, checkpoint={"intervalSteps": 6}
        ),
        "output/model",
        method,
        merge,
    )
    p = launch_standalone(
        write_job(tmp_path / "job.json", job), cwd=tmp_path, log=tmp_path / "fsdp.log", procs=procs
    )
    assert p.wait(180) == 0, tail(p.log)

    out = tmp_path / "output" / "model"
    marker = json.loads((out / FINISHED_MARKER).read_text())
    assert marker["step"] == 6 and marker["strategy"] == "fsdp-full-shard"
    assert list((tmp_path / "output").iterdir()) == [out]
    exported = AutoModelForCausalLM.from_pretrained(out)
    # The trained model as the final checkpoint holds it, rebuilt in this process.
    dcp_to_torch_save(
        tmp_path / "checkpoints" / "quickstart" / "step-00000006", tmp_path / "ckpt.pt"
    )
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    tok = build_byte_tokenizer()
    # The base as the trainer built it (its seeded init does not depend on the world size):
    # a LoRA checkpoint holds only the adapters (state.py, ignore_frozen_params).
    trained = build_model(
        job.spec.model,
        job.spec.method,
        tok,
        torch.device("cpu"),
        activation_checkpointing=False,
        precision=job.spec.training.precision,
        seed=job.spec.training.seed,
    )
    missing, unexpected = trained.load_state_dict(saved, strict=False)
    frozen = {n for n, p in trained.named_parameters() if not p.requires_grad}
    assert not unexpected and set(missing) == (frozen if merge else set())
    torch.testing.assert_close(logits(exported), logits(trained), rtol=0, atol=1e-5)
    if merge:  # the adapter trained away from its no-op start, and it is in the weights
        with trained.disable_adapter():
            assert not torch.allclose(logits(exported), logits(trained), rtol=0, atol=1e-4)
    else:
        exported_sd = exported.state_dict()
        assert set(saved) == set(exported_sd)
        assert all(torch.equal(exported_sd[k], v) for k, v in saved.items())


def test_error_report_is_json_the_operator_reads(tmp_path: Path) -> None:
    from finetune_operator.reconcile.progress import parse_trainer_error

    log = tmp_path / "termination-log"
    log.touch()
    assert write_error_report("output.uri /x holds ... " + "y" * 10000, rank=3, path=str(log))
    error = parse_trainer_error(log.read_text())
    assert error is not None and error.startswith("output.uri /x holds")
    assert len(log.read_text()) <= 4096
