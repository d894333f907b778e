"""What a fixed glibc mmap threshold costs a training step, against glibc's default (dynamic)
threshold, in the same run: the other side of its gain on model loading (bench/model_loading.py
`--mmap-threshold`: the resident set follows the freed tensors).

    python bench/malloc_threshold.py [--rounds 5] [--threshold 1048576]

With `MALLOC_MMAP_THRESHOLD_` set, every allocation at or over the threshold is its own mmap
and every free its munmap: fresh pages, faulted in and zeroed by the kernel, on each reuse.
glibc's dynamic threshold instead rises to the largest block freed (up to 32 MiB) and serves
such blocks from its heap again. So the cost is in the allocations between the threshold and
32 MiB that a step makes and frees again. Three workloads, each in a fresh interpreter per
setting, settings interleaved round by round (drift from other load hits both alike), one
torch thread:

  quickstart  examples/quickstart.yaml's model and batch (micro-batch 2 x 128 tokens), AdamW
  mid         a wider Llama (hidden 256, 4 layers, vocab 2048; 4 x 256 tokens): temporaries of
              1-16 MiB, the sizes the threshold moves
  alloc       allocation-heavy microbench: tensors of 1-8 MiB allocated, written once, freed

Per step (per iteration for `alloc`): CPU seconds (user + system: barely moved by other
processes' load on a shared machine), wall seconds, and minor page faults (the mechanism).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

QUICKSTART = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 259,
              "max_position_embeddings": 256}  # fmt: skip
MID = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 2048,
       "max_position_embeddings": 512}  # fmt: skip
WORKLOADS: dict[str, dict[str, Any]] = {
    "quickstart": {"arch": QUICKSTART, "batch": (2, 128), "steps": 40},
    "mid": {"arch": MID, "batch": (4, 256), "steps": 12},
    "alloc": {"iterations": 3000},
}
WARMUP = 3


def _usage() -> tuple[float, float, int]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), u.ru_utime + u.ru_stime, u.ru_minflt


def child(name: str) -> dict[str, float]:
    """One workload in this process: per-step wall, CPU seconds and minor faults."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = WORKLOADS[name]
    if name == "alloc":
        sizes = [(1 + i % 8) * 2**20 // 4 for i in range(work["iterations"])]  # fp32: 1-8 MiB
        t0, c0, f0 = _usage()
        for n in sizes:
            x = torch.empty(n)
            x.fill_(1.0)
            del x
        t1, c1, f1 = _usage()
        count = len(sizes)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**work["arch"]))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, work["arch"]["vocab_size"], work["batch"])

        def step() -> None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)

        for _ in range(WARMUP):
            step()
        t0, c0, f0 = _usage()
        for _ in range(work["steps"]):
            step()
        t1, c1, f1 = _usage()
        count = work["steps"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"wall": (t1 - t0) / count, "cpu": (c1 - c0) / count, "faults": (f1 - f0) / count,
            "maxrss_mib": rss}  # fmt: skip


def run(name: str, threshold: int | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    out = subprocess.run([sys.executable, __file__, "--child", name], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threshold", type=int, default=2**20)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--child", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    settings: dict[str, int | None] = {"dynamic": None, "fixed": args.threshold}
    print(f"glibc mmap threshold: dynamic (default) vs fixed MALLOC_MMAP_THRESHOLD_={args.threshold}; "
          f"{args.rounds} rounds, medians; per step (alloc: per iteration)")  # fmt: skip
    print(
        f"{'workload':10} {'setting':8} {'cpu ms':>8} {'wall ms':>8} {'faults':>8} {'maxrss MiB':>10}"
    )
    for name in args.workloads:
        rows: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
        for _ in range(args.rounds):
            for setting, threshold in settings.items():
                rows[setting].append(run(name, threshold))
        med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in rows.items()}
        for setting, m in med.items():
            print(f"{name:10} {setting:8} {m['cpu'] * 1e3:8.2f} {m['wall'] * 1e3:8.2f} "
                  f"{m['faults']:8.0f} {m['maxrss_mib']:10.0f}")  # fmt: skip
        cpu = med["fixed"]["cpu"] / med["dynamic"]["cpu"]
        wall = med["fixed"]["wall"] / med["dynamic"]["wall"]
        print(f"{name:10} fixed/dynamic: cpu {cpu:.2f}x, wall {wall:.2f}x")


if __name__ == "__main__":
    main()
