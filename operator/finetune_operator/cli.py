"""`ftjob`: plan a job, print the CRD, run a job on the local cluster, run the operator, replay
a step trace through the straggler detector."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import entry_points

from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.api.crd import render_crd_yaml
from finetune_operator.api.manifest import ManifestError, load_manifest
from finetune_operator.api.policy import JobPolicy, policy_refusals
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.settings import (
    add_image_policy_arguments,
    add_operator_arguments,
    image_policy_from_args,
    settings_from_args,
)

# `ftjob plan` does not know the cluster's policy: without its flags it checks against the
# operator's defaults (the chart's with no policy values), and only warns.
POLICY_FLAGS = ("allowed_image", "allowed_service_account", "trainer_service_account")


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
        print(f"error: {err}", file=sys.stderr)  # the message starts with the field
        return 2
    if args.output == "json":
        print(json.dumps(plan.to_json_dict(), indent=2))
    else:
        print(render_plan_table(plan))
    memory_warning = _pod_memory_warning(manifest.spec)
    if memory_warning:
        print(f"warning: {memory_warning}", file=sys.stderr)
    if not manifest.spec.output.uri and not manifest.spec.checkpoint.enabled:
        print(
            "warning: spec.output.uri is unset and spec.checkpoint.enabled is false: the "
            "trained model is kept nowhere (set output.uri to export it)",
            file=sys.stderr,
        )
    if args.trace:
        from finetune_operator.planner.trace import format_trace_comparison, trace_plan

        with warnings.catch_warnings():
            # Building the model (transformers, peft) warns of their own deprecations, e.g.
            # "`is_gradient_checkpointing` is deprecated": printed as "warning: ..." among the
            # manifest's warnings, it read as one about the job (activationCheckpointing).
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            trace = trace_plan(manifest.spec, plan)
        print(format_trace_comparison(plan, trace))
    policy_given = _report_policy(manifest.spec, args)
    if not plan.fits:
        return 1
    # What the operator refuses next (the job would end Failed/Unsupported): the plan is
    # shown, and the exit says the job cannot run as written.
    refusals = trainer_refusals(manifest.spec, plan)
    if len(refusals) == 1:
        print(f"error: {refusals[0]}", file=sys.stderr)
    elif refusals:  # one "field: reason" line each, as for an invalid manifest
        lines = "".join(f"\n  {refusal}" for refusal in refusals)
        print(f"error: the trainer cannot run {args.manifest}:{lines}", file=sys.stderr)
    return 2 if refusals or policy_given else 0


def _pod_memory_warning(spec: FineTuneJobSpec) -> str | None:
    """`memory: 80` is 80 bytes, not 80Gi. The plan refuses a pod too small for its runtime
    (planner/hardware.runtime_host_bytes), saying what would fit; this names the likely slip."""
    memory = spec.resources.memory
    # Under a MiB without a unit nobody means bytes ('1073741824' may well mean them).
    if memory is None or not memory.isdigit() or int(memory) >= 1024**2:
        return None
    return (
        f"spec.resources.memory: {memory!r} has no unit, so it is bytes: did you mean '{memory}Gi'?"
    )


def _policy_given(args: argparse.Namespace) -> bool:
    default = JobPolicy().trainer_image
    return any(getattr(args, f) for f in POLICY_FLAGS) or args.trainer_image != default


def _report_policy(spec: FineTuneJobSpec, args: argparse.Namespace) -> bool:
    """What the operator's job policy (api/policy.py) refuses of `spec.image` and
    `spec.resources.serviceAccountName`: an error against a policy given by flags (True:
    refused), a warning against the defaults, which the cluster's may widen."""
    refusals = policy_refusals(spec, image_policy_from_args(args))
    if not refusals:
        return False
    if _policy_given(args):
        for refusal in refusals:
            print(f"error: {refusal}: the operator's job policy refuses it", file=sys.stderr)
        return True
    for refusal in refusals:
        print(
            f"warning: {refusal} under the operator's default job policy: the job would end "
            "Failed/NotAllowed unless your operator allows it (chart values policy.allowedImages, "
            "policy.allowedServiceAccounts, trainer.*); pass its policy (--allowed-image, "
            "--allowed-service-account, --trainer-image, --trainer-service-account) to check "
            "against it",
            file=sys.stderr,
        )
    return False


def _local_runner() -> Callable[..., int] | None:
    """The local cluster's runner, registered as an entry point by the `finetune_local`
    package (beside the product, absent from the operator image)."""
    for ep in entry_points(group="finetune_operator.run", name="local"):
        try:
            runner: Callable[..., int] = ep.load()
        except ImportError:
            return None
        return runner
    return None


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        print("error: only --local is supported; on a cluster use kubectl apply", file=sys.stderr)
        return 2
    run_local = _local_runner()
    if run_local is None:
        print(
            "error: ftjob run --local needs the local cluster: "
            "pip install 'finetune-operator[local]' from a source checkout",
            file=sys.stderr,
        )
        return 2
    return run_local(
        args.manifest,
        data_dir=args.data_dir,
        timeout_seconds=args.timeout,
        nodes=args.nodes,
        keep=args.keep,
        **({"node_capacity": dict(args.node_capacity)} if args.node_capacity else {}),
    )


def _cmd_stragglers(args: argparse.Namespace) -> int:
    from finetune_operator.stragglers import Policy, find_stragglers, policy_from_spec
    from finetune_operator.stragglers.report import detection_to_json, render_table
    from finetune_operator.stragglers.trace import TraceError, read_traces

    policy = Policy()
    if args.policy_from:
        policy = policy_from_spec(load_manifest(args.policy_from).spec.fault_tolerance.stragglers)
    try:
        records = read_traces(args.traces)
    except TraceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not records:  # "no straggler" would be a verdict on nothing (an empty or wrong file)
        print(f"error: {' '.join(args.traces)}: no step records to judge", file=sys.stderr)
        return 2
    detection = find_stragglers(records, policy)
    if args.output == "json":
        print(json.dumps(detection_to_json(detection, policy, records=len(records)), indent=2))
    else:
        print(render_table(detection, policy, records=len(records)))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from finetune_operator.handlers import NoClusterError, run_operator

    try:
        run_operator(settings_from_args(args, os.environ))
    except NoClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:  # also NaN
            raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _resource_quantity(text: str) -> tuple[str, str]:
    """RESOURCE=QUANTITY (the quantity itself is checked by the local cluster)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(
            f"expected RESOURCE=QUANTITY (e.g. memory=64Gi), not {text!r}"
        )
    return name.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftjob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="print the FineTuneJob CRD (YAML)")
    crd.set_defaults(func=_cmd_crd)

    plan = sub.add_parser(
        "plan",
        help="plan GPUs, strategy and memory for a FineTuneJob",
        epilog="exit status: 0 a plan fits; 1 valid, but no configuration fits; "
        "2 invalid (refused as the API server would, by the planner, as something the "
        "trainer does not implement, or by the job policy given by the flags above: the "
        "operator would fail the job), naming the field",
    )
    plan.add_argument("manifest", help="FineTuneJob YAML")
    plan.add_argument("-o", "--output", choices=["table", "json"], default="table")
    plan.add_argument("--trace", action="store_true", help="also trace the step with PyTorch")
    add_image_policy_arguments(
        plan.add_argument_group(
            "job policy: the operator's, to check spec.image and "
            "spec.resources.serviceAccountName against (default: the operator's defaults, "
            "warnings only; given: refusals are errors)"
        ),
        os.environ,
    )
    plan.set_defaults(func=_cmd_plan)

    run = sub.add_parser(
        "run",
        help="run a FineTuneJob",
        epilog="exit status: 0 Succeeded; 1 Failed (the cluster's directory and pod logs are "
        "kept); 2 refused before any cluster starts, as `ftjob plan` refuses, naming the field; "
        "3 timed out; "
        "128+N stopped by signal N (Ctrl-C: 130)",
    )
    run.add_argument("manifest", help="FineTuneJob YAML")
    run.add_argument("--local", action="store_true", help="on the embedded local cluster")
    run.add_argument(
        "--data-dir",
        default=None,
        help="local cluster state, always kept; the same one again resumes the job from its "
        "last checkpoint (default: a new .ftjob/run-* in the current directory, or in "
        "$FTJOB_LOCAL_DIR, removed after a success unless --keep)",
    )
    run.add_argument(
        "--timeout",
        type=_positive(float),
        default=1800.0,
        help="give up after N seconds (default: %(default)g)",
    )
    run.add_argument(
        "--nodes",
        type=_positive(int),
        default=4,
        help="virtual nodes in the local cluster (default: %(default)s)",
    )
    run.add_argument(
        "--node-capacity",
        type=_resource_quantity,
        action="append",
        default=[],
        metavar="RESOURCE=QUANTITY",
        help="each virtual node's capacity of a resource, over the default 8 cpu, 32Gi memory, "
        "200Gi ephemeral-storage, 110 pods (repeatable), e.g. memory=64Gi",
    )
    run.add_argument(
        "--keep", action="store_true", help="keep the default data dir after a success"
    )
    run.set_defaults(func=_cmd_run)

    strag = sub.add_parser(
        "stragglers", help="replay a recorded step trace through the straggler detector"
    )
    strag.add_argument("traces", nargs="+", help="trace files (JSON lines) or directories of them")
    strag.add_argument(
        "--policy-from", default=None, help="FineTuneJob YAML: its stragglers policy"
    )
    strag.add_argument("-o", "--output", choices=["table", "json"], default="table")
    strag.set_defaults(func=_cmd_stragglers)

    op = sub.add_parser("operator", help="run the operator (kopf) against the current cluster")
    add_operator_arguments(op, os.environ)  # env FINETUNE_OPERATOR_<FLAG> as defaults
    op.set_defaults(func=_cmd_operator)
    return parser


def _show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> str:
    """A deprecation in a manifest is the user's to fix: one line, not Python's source line."""
    return f"warning: {message}\n"


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Warnings in one line while a command runs, and the process's own format again after:
    `main` is called in-process too (tests, scripts), which must not keep ours."""
    previous = warnings.formatwarning
    warnings.formatwarning = _show_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _one_line_warnings():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except ManifestError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback (`run --local` cleans up on its own)
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ftjob plan job.yaml | head`: the reader left, as with any tool
        # Python would flush stdout again at exit and print a second error: point it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    return result


if __name__ == "__main__":
    sys.exit(main())
