"""``dattri-llm <command> [options]``: parse, run in a staged output directory, report.

Each command's failures that a user can fix (a bad flag, a missing file, a
store that does not fit the method, a layer pattern that matches nothing)
print one line, ``dattri-llm <command>: error: <message>``, and exit non-zero
(2 for usage errors, 1 otherwise) with no finished-looking output directory.
``DATTRI_LLM_TRACEBACK=1`` re-raises instead, with the full traceback (a
``TypeError`` or ``OSError`` may also be a bug worth reporting).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.cli.arguments import COMMANDS, RunArguments, ValidateArguments
from dattri_llm.cli.attribute import run_attribute
from dattri_llm.cli.capture import run_capture
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.fit import run_fit
from dattri_llm.cli.output import check_output_dir, staged_output
from dattri_llm.cli.parsing import parse, resolved_config
from dattri_llm.cli.plan import run_plan
from dattri_llm.cli.report import run_report
from dattri_llm.cli.scores import scores_config
from dattri_llm.cli.topk import run_top_k
from dattri_llm.cli.validate import default_retrain_dir, run_validate

__all__ = ["main"]

USAGE = "usage: dattri-llm {" + ",".join(COMMANDS) + "} [options]  (dattri-llm <command> --help)"
# Set (to anything but "0") to get the full traceback instead of the one-line message.
TRACEBACK_ENV = "DATTRI_LLM_TRACEBACK"
# What the library and the file system raise for input a user can fix.
USER_ERRORS = (
    CLIError,
    ValueError,
    TypeError,
    FileNotFoundError,
    NotImplementedError,
    OSError,
    yaml.YAMLError,
)


def main(argv: list[str] | None = None) -> int:
    """Run one command; return 0, or raise ``SystemExit`` with a one-line message on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        for name, (description, _) in COMMANDS.items():
            print(f"  {name:<10} {description}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        return _fail(
            "dattri-llm", f"unknown command {command!r}; choose one of {list(COMMANDS)}", 2
        )
    try:
        _run(command, rest)
    except USER_ERRORS as err:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        code = err.code if isinstance(err, CLIError) else 1
        return _fail(f"dattri-llm {command}", _one_line(err), code)
    return 0


def _run(command: str, argv: list[str]) -> None:
    parsed = parse(command, argv)
    run = next(p for p in parsed if isinstance(p, RunArguments))
    args = next(p for p in parsed if isinstance(p, AttributionArguments))
    final = check_output_dir(args.output_dir, run.overwrite)
    args.output_dir = str(final)
    _absolute_paths(parsed)
    _method_of_scores(command, parsed)
    for instance in parsed:  # recorded, so that a replayed config reuses the same retrains
        if isinstance(instance, ValidateArguments) and instance.retrain_dir is None:
            instance.retrain_dir = str(default_retrain_dir(final))
    options = [p for p in parsed if not isinstance(p, (RunArguments, AttributionArguments))]
    checked = {"quiet": run.quiet, "force": run.force, "final": final}
    with staged_output(final, resolved_config(command, parsed)) as staging:
        if command == "capture":
            summary = run_capture(staging, args, *options, **checked)
            how = "trained on and captured" if summary.get("trained") else "captured"
            message = (
                f"{how} {summary['train']} training and {summary['query']} query "
                f"samples over {summary['layers']} layers"
            )
        elif command == "attribute":
            summary = run_attribute(staging, args, *options, **checked)
            message = (
                f"{summary['algorithm']}: {summary['rows']} training rows x "
                f"{summary['queries']} queries"
            )
        elif command == "fit":
            summary = run_fit(staging, args, *options, **checked)
            message = f"{summary['algorithm']} fit ({summary['file']})"
        elif command == "plan":
            message = run_plan(staging, args, *options, quiet=run.quiet)
        elif command == "report":
            message = run_report(staging, args, *options, quiet=run.quiet)
        elif command == "validate":
            message = run_validate(staging, args, *options, quiet=run.quiet, final=final)
        else:
            message = run_top_k(staging, args, *options, quiet=run.quiet)
    print(message)
    printed_table = command in ("top-k", "plan") or (
        command == "report" and options[-1].format != "html"
    )
    if not printed_table:  # a printed table or JSON stays parseable
        print(f"written to {final}")


def _absolute_paths(parsed: tuple[Any, ...]) -> None:
    """Local paths of the run made absolute, so its config replays from any directory."""
    for instance in parsed:
        for name in (
            "train_data", "query_data", "store", "scores", "model", "tokenizer", "fit",
            "optimizer_state",
        ):  # fmt: skip
            value = getattr(instance, name, None)
            if isinstance(value, str) and Path(value).expanduser().exists():
                setattr(instance, name, str(Path(value).expanduser().absolute()))
            elif isinstance(value, list):  # validate's --scores: several directories
                setattr(instance, name, [_absolute(v) for v in value])
        for name in ("planted", "retrain_dir"):  # validate's: a retrain_dir may not exist yet
            value = getattr(instance, name, None)
            if isinstance(value, str):
                setattr(instance, name, str(Path(value).expanduser().absolute()))


def _method_of_scores(command: str, parsed: tuple[Any, ...]) -> None:
    """``top-k`` / ``report --scores DIR``: the method is the scored run's (its ``config.yaml``).

    The ``--method`` flag does not choose anything there; recording the run's own method
    keeps this run's ``config.yaml`` and the report's wording true to what was ranked.
    """
    if command not in ("top-k", "report"):
        return
    scores = next((getattr(p, "scores", None) for p in parsed if hasattr(p, "scores")), None)
    if not isinstance(scores, str):
        return
    method = scores_config(scores).get("method")
    for instance in parsed:
        if method is not None and hasattr(instance, "method"):
            instance.method = method


def _absolute(value: Any) -> Any:
    """``value`` as an absolute path when it is an existing local path, else unchanged."""
    if isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().absolute())
    return value


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, CLIError) else f"{type(err).__name__}: {text}"


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    sys.exit(main())
