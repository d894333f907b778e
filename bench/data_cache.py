"""The data phase of a rank's start, with and without the per-pod cache of packed blocks.

    python bench/data_cache.py [--mb 20] [--seq-len 512] [--ranks 1 2] [--tokenizer byte|bpe]
                               [--pods 2] [--open-mb 256]

A jsonl corpus of `--mb` MB is generated into a temporary directory (words of the shipped
quickstart corpus in random order: never committed) and read with the byte-level tokenizer
of inline models (one token per byte: the most tokens a corpus of this size can give) or,
with `--tokenizer bpe`, a byte-level BPE of 32,000 ids trained on the corpus first (as Llama 2
or GPT-2 tokenize: fewer tokens, more work per byte; its training is not timed). Each
case runs `--ranks` fresh processes at once, as the local ranks of one pod start together,
each timing its data phase (`build_dataset`, imports and tokenizer excluded) and reporting
its peak RSS (`ru_maxrss`) and the RSS it had before the phase:

- before: the reader this branch replaces, as it was: every row as a Python dict, the text
  column as a list, tokenized at once into lists, packed through one flat list (its code is
  `_before_build` below, kept only here as the baseline).
- uncached: the streaming build into memory (what a job without a cache volume does).
- first start: the streaming build into an empty cache (one rank builds, the others wait
  and map it).
- restart: the same cache again (every rank maps it: no reading, no tokenizing).
- replacement, tokenizing: a pod replacing another, with an empty cache of its own and no
  shared copy: what every replacement pod did before the shared copy (one rank builds).
- replacement, shared hit: a pod replacing another, with an empty cache of its own and the
  job's shared copy that the first start published (`finetune_trainer.data.shared`): one rank
  copies and verifies the entry, the others wait and map it; nothing is tokenized.

A second table shows a fresh job's `--pods` pods starting together (one rank each, each with
its own empty cache; `--pods 0` skips it):

- fresh job, every pod tokenizes: what each pod of a fresh job did before the election (every
  cache empty, nothing published yet), measured without the shared copy (so without the
  publication the first pod also did then: the baseline is, if anything, flattered).
- fresh job, one builds: the same start with the job's shared copy: one pod claims the key
  (`finetune_trainer.data.build_claim`), tokenizes and publishes; the others wait for the
  entry and copy it (verified), tokenizing nothing. Their CPU is the figure: on a cluster
  each pod is a node, and the nodes' tokenizing CPU is what the election saves.

The first start publishes its entry to the shared copy (its time includes that). The shared
copy is a directory on this machine's disk, standing in for the job's checkpoint volume: on a
cluster the copy runs at that volume's read throughput (NFS, CephFS, EFS: hundreds of MB/s to
GB/s) instead of the local disk's, while tokenizing costs the same CPU anywhere.

Every case's blocks are checked equal to the baseline's.

A third table (`--open-mb`, default 256; 0 skips it) times opening a pod's entry of that size
(random blocks, written by the cache's own writer): verified, reading every byte to check its
checksum (what every open of every rank did on every start), against stamped (the pod verified
it once and recorded the file's identity: `cache_entry.open_entry`'s `remember`), median of 5
opens each, in the same run. Both read a page cache the write left warm: on a cold cache the
full read also waits for the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]

CASES = (
    "before",
    "uncached",
    "first start",
    "restart",
    "replacement, tokenizing",
    "replacement, shared hit",
)
# Per case: the pod's cache directory (a suffix of the run's; None: no cache) and whether it
# uses the job's shared copy. Each replacement pod starts with an empty cache of its own.
POD: dict[str, tuple[str | None, bool]] = {
    "before": (None, False),
    "uncached": (None, False),
    "first start": ("", True),
    "restart": ("", True),
    "replacement, tokenizing": ("-replacement-a", False),
    "replacement, shared hit": ("-replacement-b", True),
}


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    quickstart = REPO / "trainer_image/finetune_trainer/data/quickstart.jsonl"
    words = " ".join(
        json.loads(line)["text"] for line in quickstart.read_text().splitlines()
    ).split()
    rng = random.Random(seed)
    target, written, rows = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 800)))}) + "\n"
            f.write(line)
            written += len(line)
            rows += 1
    return rows


def _before_build(uri: str, tokenizer: Any, seq_len: int) -> Any:
    """The trainer's jsonl path before streaming: rows -> column -> token lists -> pack."""
    import torch

    with open(uri, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    names = list(dict.fromkeys(k for row in rows for k in row))
    assert "text" in names
    texts = [str(t) for t in [row.get("text") for row in rows]]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    seqs = [[tokenizer.bos_token_id, *ids, tokenizer.eos_token_id] for ids in encoded]
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len).numpy()


BPE_VOCAB = 32000


def train_bpe(corpus: Path, out: Path) -> None:
    """A byte-level BPE on the corpus (the GPT-2 / Llama 2 kind), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = (json.loads(line)["text"] for line in corpus.open(encoding="utf-8"))
    tok.train_from_iterator(lines, trainer)
    tok.save(str(out))


def load_tokenizer(path: str) -> Any:
    from finetune_trainer.tokenizer import build_byte_tokenizer

    if path == "byte":
        return build_byte_tokenizer()
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")  # fmt: skip


def child(case: str, uri: str, seq_len: int, cache: str, shared: str, out: str, tok: str) -> None:
    """One rank's data phase; writes its figures and a digest of its blocks to `out`."""
    import hashlib

    import numpy as np

    from finetune_operator.api.spec import CheckpointSpec, DatasetSpec
    from finetune_trainer.data import CacheSettings, build_dataset
    from finetune_trainer.data.shared import shared_cache_for

    tokenizer = load_tokenizer(tok)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu0, t0 = time.process_time(), time.perf_counter()
    if case == "before":
        blocks, source = _before_build(uri, tokenizer, seq_len), "tokenized"
    else:
        owner = {"job": "bench", "namespace": "default", "uid": "bench"}
        store = shared_cache_for(CheckpointSpec(uri=shared), None, owner) if shared != "-" else None
        settings = None if cache == "-" else CacheSettings(Path(cache), None, store)
        ds = build_dataset(DatasetSpec(uri=uri), tokenizer, seq_len, settings)
        blocks, source = ds.blocks, ds.source
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    digest = hashlib.sha256(np.ascontiguousarray(blocks, dtype=np.int64).tobytes()).hexdigest()
    Path(out).write_text(json.dumps({
        "seconds": seconds, "cpu": cpu, "rss_before": rss_before, "rss_peak": peak,
        "source": source, "blocks": len(blocks), "digest": digest,
    }))  # fmt: skip


def run_case(
    case: str, ranks: int, uri: str, seq_len: int, work: Path, tok: str
) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2]), "OMP_NUM_THREADS": "1"}
    suffix, shared = POD[case]
    cache = "-" if suffix is None else str(work / f"cache-{ranks}{suffix}")
    store = str(work / f"checkpoints-{ranks}") if shared else "-"
    outs = [
        work / f"{case.replace(' ', '-').replace(',', '')}-{ranks}-{r}.json" for r in range(ranks)
    ]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--child", case, uri, str(seq_len), cache, store,
                          str(o), tok], env=env)
        for o in outs
    ]  # fmt: skip
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{case} at {ranks} ranks failed")
    return [json.loads(o.read_text()) for o in outs]


FRESH_CASES = {"fresh job, every pod tokenizes": False, "fresh job, one builds": True}


def run_pods(
    case: str, pods: int, uri: str, seq_len: int, work: Path, tok: str
) -> list[dict[str, Any]]:
    """`pods` pods of a fresh job at once: an empty cache each, the job's shared copy or none."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2]), "OMP_NUM_THREADS": "1"}
    tag = case.replace(" ", "-").replace(",", "")
    store = str(work / f"checkpoints-{tag}") if FRESH_CASES[case] else "-"
    outs = [work / f"{tag}-{i}.json" for i in range(pods)]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--child", case, uri, str(seq_len),
                          str(work / f"cache-{tag}-{i}"), store, str(o), tok], env=env)
        for i, o in enumerate(outs)
    ]  # fmt: skip
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{case} with {pods} pods failed")
    return [json.loads(o.read_text()) for o in outs]


def fresh_job(pods: int, uri: str, seq_len: int, work: Path, tok: str) -> None:
    print()
    print("| pods | case | data phase, slowest pod | pods' CPU, sum | source (per pod) |")
    print("|---|---|---|---|---|")
    results = {c: run_pods(c, pods, uri, seq_len, work, tok) for c in FRESH_CASES}
    for case, rs in results.items():
        print(f"| {pods} | {case} | {max(r['seconds'] for r in rs):.3f} s "
              f"| {sum(r['cpu'] for r in rs):.2f} s "
              f"| {', '.join(sorted(r['source'] for r in rs))} |")  # fmt: skip
    assert len({r["digest"] for rs in results.values() for r in rs}) == 1
    every, one = (sum(r["cpu"] for r in results[c]) for c in FRESH_CASES)
    print(f"|   | CPU, one builds / every pod tokenizes: {one / every:.4f} "
          f"({every / one:.1f}x less) ||||")  # fmt: skip


def open_times(megabytes: float, work: Path, repeats: int = 5) -> None:
    """Median open of a `megabytes` entry, verified against stamped (module docstring)."""
    import statistics

    import numpy as np

    from finetune_trainer.data.cache_entry import STAMP_FILE, EntryWriter, open_entry

    seq_len = 512
    rows = max(1, int(megabytes * 1e6) // (seq_len * 2))
    entry = work / "open-entry"
    entry.mkdir()
    writer = EntryWriter(entry, None)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 4096):
        n = min(4096, rows - start)
        writer.write(rng.integers(0, 65535, size=(n, seq_len), dtype=np.uint16))
    writer.finish(key="bench", dtype=np.dtype(np.uint16), seq_len=seq_len, samples=rows)

    def timed(remember: bool) -> float:
        times = []
        for _ in range(repeats):
            if not remember:
                (entry / STAMP_FILE).unlink(missing_ok=True)
            t0 = time.perf_counter()
            assert open_entry(entry, "bench", remember=remember) is not None
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    verified = timed(remember=False)
    assert open_entry(entry, "bench", remember=True) is not None  # the pod's one verification
    time.sleep(0.05)  # past the file's last clock tick, or the stamp is not trusted
    assert open_entry(entry, "bench", remember=True) is not None
    assert (entry / STAMP_FILE).exists()
    stamped = timed(remember=True)
    size = rows * seq_len * 2
    print()
    print("| entry | open, verified (every byte hashed) | open, stamped | stamped / verified |")
    print("|---|---|---|---|")
    print(f"| {mib(size)} | {verified * 1e3:.1f} ms ({verified / (size / 1e9):.3f} s/GB) "
          f"| {stamped * 1e3:.3f} ms | {stamped / verified:.5f} "
          f"({verified / stamped:.0f}x faster) |")  # fmt: skip


def mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--open-mb", type=float, default=256.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="data-cache-bench-"))
    try:
        uri = str(work / "corpus.jsonl")
        rows = generate_corpus(Path(uri), args.mb)
        size = os.path.getsize(uri)
        tok = "byte"
        if args.tokenizer == "bpe":
            tok = str(work / "tokenizer.json")
            train_bpe(Path(uri), Path(tok))
        name = "byte tokenizer" if tok == "byte" else f"byte-level BPE of {BPE_VOCAB} ids"
        print(f"corpus: {size / 1e6:.1f} MB, {rows} rows; seq len {args.seq_len}; {name}")
        print(
            f"load (uptime): {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}"
        )
        print(
            "| ranks | case | data phase, slowest rank | rank CPU, sum | x before | source (per rank) "
            "| peak RSS, max | RSS added by the phase, max | cache on disk |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for ranks in args.ranks:
            cache = work / f"cache-{ranks}"
            results = {c: run_case(c, ranks, uri, args.seq_len, work, tok) for c in CASES}
            base = max(r["seconds"] for r in results["before"])
            digests = {r["digest"] for rs in results.values() for r in rs}
            assert len(digests) == 1, "a case gave other blocks than the baseline"
            disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
            for case, rs in results.items():
                slowest = max(r["seconds"] for r in rs)
                print(f"| {ranks} | {case} | {slowest:.3f} s | {sum(r['cpu'] for r in rs):.2f} s "
                      f"| {slowest / base:.4f} | {', '.join(sorted(r['source'] for r in rs))} "
                      f"| {mib(max(r['rss_peak'] for r in rs))} "
                      f"| {mib(max(r['rss_peak'] - r['rss_before'] for r in rs))} "
                      f"| {mib(disk) if POD[case][0] is not None else '-'} |")  # fmt: skip
            first = max(r["seconds"] for r in results["first start"])
            hit = max(r["seconds"] for r in results["restart"])
            print(
                f"|   | restart / first start: {hit / first:.4f} ({first / hit:.0f}x faster) |||||||"
            )
            tokenizing = max(r["seconds"] for r in results["replacement, tokenizing"])
            shared_hit = max(r["seconds"] for r in results["replacement, shared hit"])
            print(
                f"|   | replacement pod, shared hit / tokenizing: {shared_hit / tokenizing:.4f} "
                f"({tokenizing / shared_hit:.0f}x faster) |||||||"
            )
            published = sum(
                p.stat().st_size for p in (work / f"checkpoints-{ranks}").rglob("*") if p.is_file()
            )
            print(f"|   | shared copy on the checkpoint volume: {mib(published)} |||||||")
        if args.pods > 0:
            fresh_job(args.pods, uri, args.seq_len, work, tok)
        if args.open_mb > 0:
            open_times(args.open_mb, work)
        print(f"load (uptime) after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:4], int(sys.argv[4]), *sys.argv[5:9])
    else:
        main()
