"""The planner's ZeRO model-state bytes against what DeepSpeed's engine actually holds.

For ZeRO stages 1, 2 and 3, without and with CPU offload (stage 1/2: offload_optimizer; stage 3:
offload_optimizer + offload_param, what the planner's `offload: cpu` means for zero3, and
offload_optimizer alone for reference), at world sizes 1 and 2 (torchrun, DeepSpeed's CPU
accelerator over gloo), it trains a ~60M-parameter Llama built from a config for two steps and
counts, per rank, every tensor storage the engine holds (bench/ds_accounting.py: parameters,
gradients, fp32 master weights, optimizer moments, buckets), inside the second optimizer step
(all states and gradient partitions alive). Each figure is split into device and host bytes by
where DeepSpeed allocates it on a GPU machine, and compared with the planner's
`estimate_memory(...)` breakdown (parameters + gradients + optimizer on the device, host_bytes
offloaded) for the same model, stage, offload and world size.

    DS_ACCELERATOR=cpu python bench/deepspeed_memory.py [--worlds 1,2] [--precisions bf16,fp16]
        [--only zero2] [--no-write]

Writes bench/results/deepspeed_memory.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MIB = 2**20
# ~60M parameters (untied head): large enough that per-parameter bytes dwarf the
# per-tensor constants (DeepSpeed's alignment padding, torch's step counters).
MODEL = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# For the CI test (tests/planner/test_deepspeed_engine.py): ~7M parameters, same structure.
SMALL = {**MODEL, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8000}  # fmt: skip
MODELS = {"bench": MODEL, "small": SMALL}
# Bucket sizes given to DeepSpeed (elements). Buckets are communication buffers, not model
# states; they are reported beside them.
REDUCE_BUCKET = 5_000_000
ALLGATHER_BUCKET = 5_000_000
SEQ = 32


@dataclass(frozen=True)
class Config:
    stage: int
    offload: str  # none | optimizer | all (stage 3: optimizer + params)
    precision: str
    world: int
    model: str = "bench"  # a key of MODELS

    @property
    def name(self) -> str:
        return f"zero{self.stage} offload={self.offload} {self.precision} N={self.world}"

    @property
    def reference(self) -> bool:
        """ZeRO-3 with offload_optimizer alone: not a planner choice (its `offload: cpu` for
        zero3 offloads parameters too); measured for reference, compared with nothing."""
        return self.stage == 3 and self.offload == "optimizer"

    @property
    def planner_offload(self) -> str:
        return "none" if self.offload == "none" else "cpu"


def ds_config(cfg: Config) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": cfg.stage,
        "reduce_bucket_size": REDUCE_BUCKET,
        "allgather_bucket_size": ALLGATHER_BUCKET,
    }
    if cfg.stage == 3:
        zero["stage3_prefetch_bucket_size"] = REDUCE_BUCKET
    if cfg.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if cfg.offload == "all":
        zero["offload_param"] = {"device": "cpu"}
    precision: dict[str, Any] = {"enabled": True}
    if cfg.precision == "fp16":
        precision["initial_scale_power"] = 8
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        cfg.precision: precision,
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }
    if cfg.offload != "none":
        # Offload requires DeepSpeedCPUAdam (built from the config's optimizer).
        conf["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return conf


def measure(cfg: Config, steps: int = 2) -> dict[str, Any]:
    """In a torchrun worker: train `steps` steps, account the engine inside the last optimizer
    step, return this rank's bytes per (placement, component)."""
    import deepspeed
    import deepspeed.ops
    import psutil
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # As the trainer does (finetune_trainer.deepspeed_engine): no JIT build of DeepSpeed's
    # shared-memory all-reduce op on the CPU accelerator (a compiler and minutes; unused here).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_accounting import account

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the working precision: no fp32 copy to free
    arch = MODELS[cfg.model]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in arch.items() if k != "model_type"}))
    torch.set_default_dtype(previous)
    n_params = sum(p.numel() for p in model.parameters())
    client = None if cfg.offload != "none" else torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=client, model_parameters=model.parameters(), config=ds_config(cfg)
    )
    inner = engine.optimizer.optimizer
    snapshots: list[Any] = []
    step_fn = inner.step
    armed = [False]

    def step(*args: Any, **kwargs: Any) -> Any:
        if armed[0]:
            snapshots.append(
                (
                    account(engine, cfg.offload != "none", cfg.offload == "all"),
                    proc.memory_info().rss,
                )
            )
        return step_fn(*args, **kwargs)

    inner.step = step
    # The step casts the gradient partition to fp32 from a flattened copy (stage_1_and_2.py
    # step(), stage3.py _prepare_fp32_grad_for_sub_group): at each flatten during the armed
    # step, what the engine holds + that copy + its fp32 cast is the step's transient peak.
    casts: list[int] = []
    in_step = [False]
    flatten_fn = engine.optimizer.flatten

    def flatten(tensors: Any) -> Any:
        flat = flatten_fn(tensors)
        if in_step[0]:
            held = account(engine, cfg.offload != "none", cfg.offload == "all")
            states = sum(v for (_, c), v in held.bytes.items() if c in STATES)
            casts.append(states + flat.numel() * (flat.element_size() + 4))
        return flat

    engine.optimizer.flatten = flatten
    ids = torch.randint(0, arch["vocab_size"], (1, SEQ))
    for i in range(steps):
        armed[0] = i == steps - 1
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if armed[0]:
            backward = account(engine, cfg.offload != "none", cfg.offload == "all")
        in_step[0] = armed[0]
        engine.step()
        in_step[0] = False
    # ZeRO-3 steps once per sub-group: the last snapshot has every state allocated.
    acc, rss = snapshots[-1]
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "params": n_params,
        "bytes": {f"{p}/{c}": v for (p, c), v in acc.bytes.items()},
        "paths": {f"{p}/{c}": sorted(set(v))[:6] for (p, c), v in acc.paths.items()},
        "backward": {f"{p}/{c}": v for (p, c), v in backward.bytes.items()},
        "backward_paths": {f"{p}/{c}": sorted(set(v))[:6] for (p, c), v in backward.paths.items()},
        "cast_peak": max(casts, default=0),
        "rss_delta": rss - rss0,
        # The process peak (VmHWM), runtime included: what a CPU job's memory must hold.
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "optimizer": f"{type(engine.optimizer).__name__}/{type(inner).__name__}",
    }


def run_config(cfg: Config, timeout: int = 900) -> list[dict[str, Any]]:
    """Launch one configuration under torchrun; return each rank's measurement."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={cfg.world}", __file__, "--worker",
            "--stage", str(cfg.stage), "--offload", cfg.offload,
            "--precision", cfg.precision, "--model", cfg.model, "--out", tmp,
        ]  # fmt: skip
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if res.returncode != 0 or len(files) != cfg.world:
            raise RuntimeError(f"{cfg.name} failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
        return [json.loads(f.read_text()) for f in files]


def planner_states(cfg: Config) -> dict[str, int]:
    """The planner's per-rank model states for the same model, stage, offload and world."""
    from finetune_operator.api.spec import ModelArchitecture
    from finetune_operator.planner.architecture import shape_of
    from finetune_operator.planner.configuration import Candidate, TrainingShape
    from finetune_operator.planner.memory import estimate_memory
    from finetune_operator.planner.zero import zero_states

    shape = shape_of(ModelArchitecture.model_validate(MODELS[cfg.model]))

    def estimate(cuda: bool) -> Any:
        return estimate_memory(
            shape,
            TrainingShape(micro_batch_size=1, seq_len=SEQ, precision=cfg.precision),  # type: ignore[arg-type]
            Candidate(
                f"zero{cfg.stage}",  # type: ignore[arg-type]
                world_size=cfg.world,
                offload=cfg.planner_offload,  # type: ignore[arg-type]
                cuda=cuda,
            ),
        )

    est = estimate(cuda=True)
    b = est.breakdown
    # The same job on CPU (DS_ACCELERATOR=cpu, what this bench runs): the device total (its
    # transients and the process runtime included) and the offloaded host buffers share the
    # process's RAM (planner.search.evaluate adds them).
    cpu = estimate(cuda=False)
    e = 2 if cfg.precision in ("bf16", "fp16") else 4
    step = zero_states(
        cfg.stage, cfg.world, shape.total, 0, e, 12, fp32_master=True, offload=cfg.offload != "none"
    )
    return {
        "params": shape.total,
        "device/parameters": b.parameters,
        "device/gradients": b.gradients,
        "device/optimizer": b.optimizer,
        "device": b.parameters + b.gradients + b.optimizer,
        "host": est.host_bytes,
        "cpu_device_total": cpu.breakdown.total,
        "cpu_host": cpu.host_bytes,
        # Model states at the step's cast to fp32: + the e-byte partition alive beside it.
        "cast_peak": b.parameters + b.gradients + b.optimizer + step.step_transient,
    }


def _sum(meas: dict[str, Any], placement: str, comps: tuple[str, ...]) -> int:
    return sum(meas["bytes"].get(f"{placement}/{c}", 0) for c in comps)


STATES = ("parameters", "gradients", "master", "optimizer")


def _ratio(plan: int, ds: int) -> float:
    """plan/ds; NaN (printed n/a) where neither holds a MiB there: ZeRO-3 offload keeps only
    its persistent small parameters (norms, kilobytes) on the device, offload casts nothing."""
    if max(plan, ds) < MIB:
        return float("nan")
    return plan / ds if ds else float("inf")


def compare(cfg: Config, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    plan = planner_states(cfg)
    rows = []
    for meas in ranks:
        ds_dev = _sum(meas, "device", STATES)
        ds_host = _sum(meas, "host", STATES)
        rows.append(
            {
                "config": cfg.name + (" (ref)" if cfg.reference else ""),
                "reference": cfg.reference,
                "rank": meas["rank"],
                "ds_params": _sum(meas, "device", ("parameters",)),
                "ds_grads": _sum(meas, "device", ("gradients",)),
                "ds_optim": _sum(meas, "device", ("master", "optimizer")),
                "ds_device": ds_dev,
                "ds_host": ds_host,
                "ds_buffers": _sum(meas, "device", ("buffers",)) + _sum(meas, "host", ("buffers",)),
                "ds_other": _sum(meas, "device", ("other",)) + _sum(meas, "host", ("other",)),
                "plan_params": plan["device/parameters"],
                "plan_grads": plan["device/gradients"],
                "plan_optim": plan["device/optimizer"],
                "plan_device": plan["device"],
                "plan_host": plan["host"],
                "ratio_device": _ratio(plan["device"], ds_dev),
                "ratio_host": _ratio(plan["host"], ds_host),
                "ratio_total": (plan["device"] + plan["host"]) / (ds_dev + ds_host),
                "rss_ratio": meas["rss_delta"]
                / (
                    ds_dev
                    + ds_host
                    + _sum(meas, "device", ("buffers",))
                    + _sum(meas, "host", ("buffers",))
                ),
                "paths": meas["paths"],
                "cast_peak": meas["cast_peak"],
                "plan_cast_peak": plan["cast_peak"],
                "backward": meas["backward"],
                "backward_paths": meas["backward_paths"],
                "optimizer": meas["optimizer"],
                "peak_rss": meas["peak_rss"],
                "cpu_device_total": plan["cpu_device_total"],
                "cpu_host": plan["cpu_host"],
            }
        )
    return rows


def _cast_ratio(r: dict[str, Any]) -> float:
    """Offload steps on the host (DeepSpeedCPUAdam): no device cast to compare."""
    return _ratio(r["plan_cast_peak"], r["cast_peak"]) if r["cast_peak"] else float("nan")


def _fmt_ratio(x: float) -> str:
    return "   n/a" if x != x else f"{x:6.3f}"


def _fmt_row(r: dict[str, Any]) -> str:
    def mib(v: int) -> str:
        return f"{v / MIB:8.1f}"

    return (
        f"{r['config']:<34} r{r['rank']} | {mib(r['ds_params'])} {mib(r['ds_grads'])} "
        f"{mib(r['ds_optim'])} {mib(r['ds_device'])} {mib(r['ds_host'])} | {mib(r['plan_params'])} "
        f"{mib(r['plan_grads'])} {mib(r['plan_optim'])} {mib(r['plan_device'])} "
        f"{mib(r['plan_host'])} | {_fmt_ratio(r['ratio_device'])} {_fmt_ratio(r['ratio_host'])} "
        f"{r['ratio_total']:6.3f} | {mib(r['cast_peak'])} {mib(r['plan_cast_peak'])} "
        f"{_fmt_ratio(_cast_ratio(r))} | {mib(r['ds_buffers'])} "
        f"{mib(r['ds_other'])} {r['rss_ratio']:5.2f}"
    )


def _fmt_cpu_need(r: dict[str, Any]) -> str:
    """A CPU job's plan against the process's peak RSS: the device total plus the offloaded
    host buffers (one RAM), beside the larger half (what checking the halves apart needed)."""
    total, host = r["cpu_device_total"], r["cpu_host"]
    return (
        f"    CPU job: planned device total {total / MIB:.1f} + host {host / MIB:.1f} ="
        f" {(total + host) / MIB:.1f} MiB (apart: {max(total, host) / MIB:.1f}); peak RSS"
        f" {r['peak_rss'] / MIB:.1f} MiB; planned/peak {(total + host) / r['peak_rss']:.2f}"
        f" (apart: {max(total, host) / r['peak_rss']:.2f})"
    )


HEADER = (
    f"{'configuration':<34} rk | {'DeepSpeed engine (MiB): params':>30} {'grads':>8} {'optim':>8} "
    f"{'device':>8} {'host':>8} | {'planner: params':>15} grads    optim   device     host"
    " | plan/ds: dev   host  total | at cast: ds     plan  ratio | buffers    other rss/acc"
)


def configs(worlds: list[int], precisions: list[str], only: str | None) -> list[Config]:
    out = []
    for precision in precisions:
        for world in worlds:
            for stage, offload in (
                (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"),
                (3, "none"), (3, "all"), (3, "optimizer"),
            ):  # fmt: skip
                cfg = Config(stage, offload, precision, world)
                if only is None or only in cfg.name:
                    out.append(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--offload", default="none")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--out", default="")
    ap.add_argument("--model", default="bench", choices=sorted(MODELS))
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--precisions", default="bf16")
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print the paths behind each figure")
    args = ap.parse_args()
    if args.worker:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        result = measure(Config(args.stage, args.offload, args.precision, world, args.model))
        Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))
        # Ended as the trainer ends a rank (see exit_process): without it, gloo's threads call
        # std::terminate at interpreter finalisation (SIGABRT) in about 1 of 6 runs on 2 cores,
        # and torchrun reports a rank that measured and wrote its file as failed.
        from finetune_trainer.distributed import destroy_distributed, exit_process

        destroy_distributed()
        exit_process(0)
    import deepspeed
    import torch

    rows = []
    print(HEADER, flush=True)
    for cfg in configs(
        [int(w) for w in args.worlds.split(",")], args.precisions.split(","), args.only
    ):
        for row in compare(cfg, run_config(cfg)):
            rows.append(row)
            print(_fmt_row(row), flush=True)
            print(_fmt_cpu_need(row), flush=True)
            if args.verbose:
                for key, paths in sorted(row["paths"].items()):
                    print(f"    step {key}: {paths}", flush=True)
                for key, paths in sorted(row["backward_paths"].items()):
                    print(f"    bwd  {key} {row['backward'][key] / MIB:.1f}: {paths}", flush=True)
    compared = [r for r in rows if not r["reference"]]
    worst = max(abs(r["ratio_total"] - 1) for r in compared)
    worst_cast = max(
        (abs(r["plan_cast_peak"] / r["cast_peak"] - 1) for r in compared if r["cast_peak"]),
        default=float("nan"),  # offload only (--only): nothing cast on the device
    )
    lines = [
        f"# deepspeed {deepspeed.__version__}, torch {torch.__version__}, DS_ACCELERATOR=cpu (gloo)",
        f"# model: {MODEL}, {planner_states(Config(1, 'none', 'bf16', 1))['params']:,} params;"
        f" micro-batch 1 x {SEQ} tokens; reduce/allgather bucket {REDUCE_BUCKET:,} elements;"
        " figures per rank, inside the 2nd optimizer step; device/host = where DeepSpeed"
        " allocates them on a GPU machine",
        "# at cast: model states while the step casts the gradient partition to fp32"
        " (bench: at each flatten in step(); planner: + ZeroStates.step_transient)",
        HEADER,
        *(_fmt_row(r) for r in rows),
        f"# worst |planner/DeepSpeed - 1| over model states (device + host): {worst:.3f};"
        f" at the step's fp32 cast: {worst_cast:.3f} ((ref) rows excluded: no planner mode)",
    ]
    print(lines[-1])
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "deepspeed_memory.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
