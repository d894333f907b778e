"""`ftjob`: plan a job, print the CRD, run a job on the local cluster, run the operator."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from finetune_operator.api.crd import render_crd_yaml
from finetune_operator.api.manifest import ManifestError, load_manifest


def _cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(render_crd_yaml())
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    from finetune_operator.planner import PlanningError, plan_job
    from finetune_operator.planner.report import render_plan_table

    try:
        plan = plan_job(manifest.spec)
    except PlanningError as err:
        print(f"error: {err.field}: {err}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(plan.to_json_dict(), indent=2))
    else:
        print(render_plan_table(plan))
    if args.trace:
        from finetune_operator.planner.trace import format_trace_comparison, trace_plan

        print(format_trace_comparison(plan, trace_plan(manifest.spec, plan)))
    return 0 if plan.fits else 1


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        print("error: only --local is supported; on a cluster use kubectl apply", file=sys.stderr)
        return 2
    from finetune_operator.local.runner import run_local

    return run_local(
        args.manifest,
        data_dir=args.data_dir,
        timeout_seconds=args.timeout,
        nodes=args.nodes,
        keep=args.keep,
    )


def _cmd_operator(args: argparse.Namespace) -> int:
    from finetune_operator.handlers import run_operator

    namespaces = None if args.all_namespaces else (args.namespace or ["default"])
    run_operator(
        namespaces=namespaces,
        liveness=args.liveness,
        peering=None if args.standalone else args.peering,
        metrics_port=args.metrics_port,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftjob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="print the FineTuneJob CRD (YAML)")
    crd.set_defaults(func=_cmd_crd)

    plan = sub.add_parser("plan", help="plan GPUs, strategy and memory for a FineTuneJob")
    plan.add_argument("manifest", help="FineTuneJob YAML")
    plan.add_argument("-o", "--output", choices=["table", "json"], default="table")
    plan.add_argument("--trace", action="store_true", help="also trace the step with PyTorch")
    plan.set_defaults(func=_cmd_plan)

    run = sub.add_parser("run", help="run a FineTuneJob")
    run.add_argument("manifest", help="FineTuneJob YAML")
    run.add_argument("--local", action="store_true", help="on the embedded local cluster")
    run.add_argument("--data-dir", default=None, help="local cluster state (default: temp dir)")
    run.add_argument("--timeout", type=float, default=1800.0, help="give up after N seconds")
    run.add_argument("--nodes", type=int, default=4, help="virtual nodes in the local cluster")
    run.add_argument("--keep", action="store_true", help="keep the data dir afterwards")
    run.set_defaults(func=_cmd_run)

    op = sub.add_parser("operator", help="run the operator (kopf) against the current cluster")
    op.add_argument("-n", "--namespace", action="append", help="namespace to watch (repeat)")
    op.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces")
    op.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8080/healthz")
    op.add_argument("--peering", default=None, help="kopf peering name (leader election)")
    op.add_argument("--standalone", action="store_true", help="no peering, no leader election")
    op.add_argument("--metrics-port", type=int, default=9090, help="operator /metrics port")
    op.set_defaults(func=_cmd_operator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except ManifestError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback (`run --local` cleans up on its own)
        print("interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
