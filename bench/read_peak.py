"""Bytes a rank holds while it reads pretrained safetensors into its tensors, and the time
per GB read, before and after the reader wrote each slice straight into its target
(finetune_trainer.slice_sink), in the same run.

A synthetic shard (`--mib`, fp32 and bf16 tensors written by `safetensors`, read into fp32
as a DDP replica is) is read whole by one rank (finetune_trainer.safetensors_ranges: the
DCP read of every tensor) from a local directory (mapped) and from moto's S3 server on
loopback (ranged GETs in batches of READ_BATCH_BYTES). Each reader runs in a subprocess:
the code of this checkout ("after") and of `--before` (a git revision, exported with `git
archive`). Peak: Python's allocations during the read (tracemalloc: the GETs' bytes and any
buffer; the targets are torch's, allocated before), in a run of its own; time: another
runs, untraced, the best of two. Baseline, measured in the same run: the planned raw figure
(planner.loading.striped_read_bytes less its stripes: one batch of GETs, READ_BATCH_BYTES or
the file if smaller, plus the S3 client's join of one GET's blocks, READ_PART_BYTES; none for a
mapped file) and the "after" reader's time.

    python bench/read_peak.py [--mib 384] [--before 2bae470] [--out bench/results/read_peak.txt]

moto serves from memory on the same machine: its seconds are not a real store's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def save_shard(path: Path, mib: int) -> None:
    """A 128 MiB fp32 embedding (read whole in several parts), then fp32 tensors of 16 MiB
    and bf16 ones of 8 MiB, alternating, `mib` in all."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"embed.weight": torch.randn(32768, 1024, generator=g)}
    total, i = 128 * MIB, 0
    while total < mib * MIB:
        if i % 2:
            t = torch.randn(4096, 1024, generator=g).to(torch.bfloat16)
        else:
            t = torch.randn(4096, 1024, generator=g)
        tensors[f"layers.{i}.weight"] = t
        total += t.numel() * t.element_size()
        i += 1
    save_file(tensors, str(path / "model.safetensors"))


def measure(uri: str, endpoint: str, traced: bool) -> dict[str, object]:
    """In the subprocess: one DCP read of every tensor of `uri` into fp32 targets."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from finetune_operator.api.storage import ObjectStoreSpec
    from finetune_trainer.location import locate
    from finetune_trainer.safetensors_ranges import RangedSafetensorsReader

    store = (
        ObjectStoreSpec(endpoint_url=endpoint, region="eu-west-1", path_style=True)
        if endpoint
        else None
    )
    location = locate(uri, "bench", object_store=store)
    reader = RangedSafetensorsReader(location)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    state = {
        k: torch.zeros(v.size, dtype=torch.float32)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    plan = planner.create_local_plan()
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    reader.read_data(plan, planner).wait()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    import finetune_trainer

    return {"peak": peak, "seconds": seconds, "bytes": reader.bytes_total,
            "code": finetune_trainer.__file__}  # fmt: skip


def run(code: Path, uri: str, endpoint: str, traced: bool) -> dict[str, float]:
    """`measure` in a subprocess importing the trainer of `code`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(code / "operator"), str(code / "trainer_image")])
    out = subprocess.run(
        [sys.executable, __file__, "--measure", uri, endpoint, "1" if traced else "0"],
        env=env, capture_output=True, text=True, cwd=code,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"measure ({code}, {uri}) failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert str(got.pop("code")).startswith(str(code)), got  # not the installed trainer
    return dict(got)


def export(rev: str, into: Path) -> Path:
    archive = into / "before.tar"
    subprocess.run(
        ["git", "archive", "-o", str(archive), rev, "operator", "trainer_image"],
        cwd=REPO, check=True,
    )  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(into / "before", filter="data")
    return into / "before"


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--measure":
        print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4] == "1")))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=384)
    # The last revision whose reader copied requests and misaligned slices.
    parser.add_argument("--before", default="2bae470")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    sys.path[:0] = [str(REPO), str(REPO / "operator"), str(REPO / "trainer_image")]
    from finetune_operator.api.weights_reads import READ_BATCH_BYTES, READ_PART_BYTES
    from finetune_trainer.location import locate
    from tests.objectstore import CREDENTIALS, moto_server

    os.environ.update(CREDENTIALS)
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, moto_server() as server:
        root = Path(tmp)
        (root / "m").mkdir()
        save_shard(root / "m", args.mib)
        size = (root / "m" / "model.safetensors").stat().st_size
        uri = f"s3://{server.new_bucket()}/models/shard"
        shard = locate(uri, "bench", object_store=server.spec()) / "model.safetensors"
        shard.upload(root / "m" / "model.safetensors")
        before = export(args.before, root)
        lines.append(
            f"shard {size / MIB:.0f} MiB (fp32 and bf16 tensors, read into fp32); "
            f"before = {args.before}, after = this checkout"
        )
        sources = [("local (mapped)", str(root / "m"), "", 0),
                   ("s3 (moto)", uri, server.endpoint, min(READ_BATCH_BYTES, size) + min(READ_PART_BYTES, size))]  # fmt: skip
        for name, where, endpoint, planned in sources:
            got = {
                label: (
                    run(code, where, endpoint, True),
                    min(
                        (run(code, where, endpoint, False) for _ in range(2)),
                        key=lambda r: r["seconds"],
                    ),
                )
                for label, code in (("before", before), ("after", REPO))
            }
            base_s = got["after"][1]["seconds"] / (got["after"][1]["bytes"] / 1e9)
            lines.append(f"{name}: planned raw bytes held {planned / MIB:.0f} MiB")
            for label, (traced, timed) in got.items():
                per_gb = timed["seconds"] / (timed["bytes"] / 1e9)
                over = (traced["peak"] - planned) / MIB
                lines.append(
                    f"  {label:6s} peak held {traced['peak'] / MIB:7.1f} MiB "
                    f"({over:+7.1f} MiB over planned)  {per_gb:6.2f} s/GB "
                    f"({per_gb / base_s:.2f}x after's)"
                )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
