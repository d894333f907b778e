"""LoRA checkpoint size and save time, whole state (base included: the code before
`ignore_frozen_params`) against what changes (adapters + optimizer + training state), on the
same job, in the same run.

    python bench/lora_checkpoint.py [--hidden 1024 --layers 8 --repeats 3] [--out bench/results/lora_checkpoint.txt]

One process, gloo world 1, CPU; a bf16 frozen base with fp32 rank-16 adapters on q/k/v/o, one
optimizer step taken (so Adam's moments exist), saved with synchronous `dcp.save` to a local
directory: what the trainer's checkpointer writes, without the async overlap.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from finetune_operator.api.spec import (  # noqa: E402
    MethodSpec,
    ModelArchitecture,
    ModelSpec,
    TrainingSpec,
)
from finetune_trainer.model import build_model  # noqa: E402
from finetune_trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from finetune_trainer.sampler import StepSampler  # noqa: E402
from finetune_trainer.state import TrainState  # noqa: E402
from finetune_trainer.tokenizer import build_byte_tokenizer  # noqa: E402

MB = 1e6


def build_state(hidden: int, layers: int) -> TrainState:
    arch = ModelArchitecture(hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 128, intermediate_size=hidden * 4,
                             vocab_size=32000)  # fmt: skip
    model = build_model(ModelSpec(name="bench", source="inline", architecture=arch),
                        MethodSpec(type="lora"), build_byte_tokenizer(), torch.device("cpu"),
                        activation_checkpointing=False, precision="bf16", seed=0)  # fmt: skip
    training = TrainingSpec(max_steps=10, learning_rate=1e-4)
    optimizer = build_optimizer(model, training)
    ids = torch.randint(0, 256, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    sampler = StepSampler(num_samples=64, global_batch=8, micro_batch_size=1, rank=0, world_size=1,
                          seed=0)  # fmt: skip
    return TrainState(model, optimizer, build_scheduler(optimizer, training, 10), sampler,
                      rank=0, seed=0, step=1)  # fmt: skip


def whole_state(state: TrainState) -> dict[str, Any]:
    """The state dict as the trainer captured it before: frozen base included."""
    sd = state.capture()
    sd["model"], sd["optim"] = get_state_dict(state.model, state.optimizer)
    return sd


def save(sd: dict[str, Any], path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=str(path))
    seconds = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path)
    return seconds, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    state = build_state(args.hidden, args.layers)
    total = sum(p.numel() for p in state.model.parameters())
    trainable = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
    rows: dict[str, list[tuple[float, int]]] = {"whole": [], "adapters": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # interleaved, so both see the same disk and cache
            rows["whole"].append(save(whole_state(state), Path(tmp) / f"whole-{i}"))
            rows["adapters"].append(save(state.capture(), Path(tmp) / f"adapters-{i}"))
    dist.destroy_process_group()
    best = {k: (min(s for s, _ in v), v[0][1]) for k, v in rows.items()}
    lines = [
        f"LoRA job: {total / 1e6:.0f}M parameters (bf16 base), {trainable / 1e6:.2f}M trainable "
        f"(fp32 adapters, rank 16, q/k/v/o); best of {args.repeats} synchronous dcp.save",
        f"{'checkpoint':<30} {'size MB':>9} {'save s':>8}",
        f"{'before: whole state':<30} {best['whole'][1] / MB:>9.1f} {best['whole'][0]:>8.3f}",
        f"{'after: what changes':<30} {best['adapters'][1] / MB:>9.1f} {best['adapters'][0]:>8.3f}",
        f"ratio before/after: size {best['whole'][1] / best['adapters'][1]:.1f}x, "
        f"save time {best['whole'][0] / best['adapters'][0]:.1f}x",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
