"""`difftest` command line. Exit codes: 0 parity (selftest: all caught), 1 divergence (selftest: a miss
or a false alarm), 2 bad input or usage, 3 internal error."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from difftest.errors import InputError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

EXIT_PARITY, EXIT_DIVERGED, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
# What a shell reports for a process stopped by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130
# One default-fixture report against one serving engine on a 2-core host, for the progress
# estimate (benchmarks/verdict_overhead.py: 47.8 s on SGLang alone, 66 s on SGLang and vLLM).
REPORT_ESTIMATE_S = 45.0


def quiet_engines(verbose: bool) -> None:
    """The engines log a great deal at import and load; keep it out of a user's terminal."""
    if verbose:
        return
    import logging
    import warnings

    from difftest.progress import silence_third_party_bars

    silence_third_party_bars()

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("sglang").setLevel(logging.ERROR)
    try:
        from loguru import logger

        logger.disable("speculators")
    except ImportError:
        pass
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


def fail(message: str, code: int = EXIT_INPUT) -> None:
    typer.echo(f"difftest: error: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def one_line_errors(verbose: bool):
    """Bad input is one line and exit 2; anything else is an engine or harness bug, one line
    and exit 3 (the traceback with -v). typer.Exit (a verdict's exit code) passes through."""
    try:
        yield
    except InputError as exc:
        fail(str(exc))
    except typer.Exit:
        raise
    except Exception as exc:
        if verbose:
            raise
        fail(f"internal error: {type(exc).__name__}: {exc} (rerun with -v for the traceback)", EXIT_INTERNAL)


def parse_dtype(name: str):
    from difftest.tolerances import DTYPES

    if name == "auto":
        return None
    if name not in DTYPES:
        fail(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@app.command()
def report(
    checkpoint: Optional[Path] = typer.Argument(None, help="draft checkpoint dir (default: the embedded SmolLM2 fixture; "
                                                "with --training specforge, the SpecForge draft on the same target)"),
    target: Optional[Path] = typer.Option(None, help="HF target model dir (embedding, head, norm); default: the "
                                          "verifier the checkpoint's config names, else a target/ beside or above it"),
    states: Optional[Path] = typer.Option(None, help="captured hidden states: a difftest states file, a speculators "
                                          "datagen directory, or SGLang server responses (.json/.jsonl); default: "
                                          "states.safetensors in the checkpoint directory or its parent"),
    dtype: str = typer.Option("auto", help="auto (the checkpoint's stored dtype) | fp32 | bf16 | fp16"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    out: Path = typer.Option(Path("reports"), help="output directory"),
    max_tokens: Optional[int] = typer.Option(None, help="use only the first whole requests up to this many tokens"),
    serve_without_aux_capture: bool = typer.Option(False, hidden=True, help="test switch (selftest, CI): feed SGLang the target's last state only"),
    serve_lm_head_from_target: bool = typer.Option(False, hidden=True, help="test switch (selftest, CI): set_embed_and_head with the target's head"),
    allow_pickle: bool = typer.Option(False, help="accept .bin/.pt weights (loaded by torch.load with weights_only on)"),
    baseline: Optional[Path] = typer.Option(None, help="an earlier report.json: exit 1 only if this run regressed against it"),
    baseline_factor: float = typer.Option(2.0, help="with --baseline: how much a probe's error may grow"),
    audit_config: bool = typer.Option(True, "--audit-config/--no-audit-config",
                                      help="measure, field by field, whether SGLang honors the config (about 10 s more)"),
    chain_steps: int = typer.Option(4, help="draft steps per chain for predicted acceptance (0: skip the simulation)"),
    target_capture: bool = typer.Option(True, "--target-capture/--no-target-capture",
                                        help="run the target through SGLang and compare its aux capture with the states"),
    training_metrics: Optional[Path] = typer.Option(None, help="JSON with speculators' held-out full_acc_0.. (shown next to the predictions)"),
    training_run: Optional[Path] = typer.Option(None, help="the training run's output directory (or its saved checkpoint): "
                                                "when acceptance falls below training's, the checkpoint is compared with it"),
    serve: Optional[Path] = typer.Option(None, help="the served draft directory, exactly as deployed (needs --launch or --launch-file)"),
    launch: Optional[str] = typer.Option(None, help="the launch command that serves it, as one string: `python -m sglang.launch_server ...` or `vllm serve ...`"),
    launch_file: Optional[Path] = typer.Option(None, help="a file holding the launch command (relative paths in it resolve against its directory)"),
    training_engine: Optional[str] = typer.Option(None, "--training",
                                                  help="the engine that trained the checkpoint: speculators or specforge "
                                                  "(default: what the directory shows; SGLang's layout without "
                                                  "speculators' norm flags needs it said)"),
    serving_engines: str = typer.Option("sglang,vllm", "--serving", envvar="DIFFTEST_SERVING",
                                        help="the serving engines to compare with training, comma-separated: sglang, "
                                        "vllm (vLLM runs in its own venv, .venv-vllm)"),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="print only the verdict line"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="show engine logs and tracebacks"),
) -> None:
    """Run both engines on the same captured states and report parity probe by probe."""
    quiet_engines(verbose)
    from difftest.engines.base import ServingSetup

    try:
        deployment = read_deployment(serve, launch, launch_file)
    except InputError as exc:
        fail(str(exc))

    engines = parse_serving(serving_engines)
    from difftest.engines import TRAINING_ENGINES

    if training_engine is not None and training_engine not in TRAINING_ENGINES:
        fail(f"--training takes one of {', '.join(TRAINING_ENGINES)}; got {training_engine!r}")
    if deployment is not None and deployment.engine not in engines:
        fail(f"{deployment.source} starts a {deployment.engine} server; add {deployment.engine} to --serving")
    torch_dtype = parse_dtype(dtype)
    if device.split(":")[0] not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail(f"--device {device}: no CUDA device is visible to torch {torch.__version__} "
                 f"(torch.cuda.is_available() is false); run on cpu or on a machine with an NVIDIA GPU")
    if not 0 <= chain_steps <= 16:
        fail(f"--chain-steps must be between 0 and 16, got {chain_steps}")
    if max_tokens is not None and max_tokens < 1:
        fail(f"--max-tokens must be at least 1, got {max_tokens}")
    from difftest.outputs import output_dir
    from difftest.progress import PlannedStep, Tracker

    # One display for the whole run: the fixture build (when it is the default one) and each report.
    tracker = Tracker(not quiet)
    inputs = (checkpoint, target, states, serve, launch_file, training_run, training_metrics, baseline)
    with one_line_errors(verbose):
        with output_dir(out, inputs), tracker.live():
            jobs: list[tuple[Path, Path]] = []
            extra: dict = {}
            if checkpoint is None and training_engine == "specforge":
                from difftest.fixturegen import specforge_smollm2

                tracker.extend([PlannedStep("report:legacy", "report (SpecForge's export)",
                                            REPORT_ESTIMATE_S * len(engines))])
                sf = specforge_smollm2.build(tracker=tracker)
                target, states = target or sf.fixture.target, states or sf.states
                # The export as SpecForge wrote it, served as it is with the command beside it.
                jobs = [(sf.draft, out)]
                deployment = deployment or read_deployment(sf.draft, None, sf.launch)
            elif checkpoint is None:
                import json

                from difftest.fixturegen.default import default_fixture

                tracker.extend([PlannedStep("report:speculators", "report (speculators format)",
                                            REPORT_ESTIMATE_S * len(engines))])
                fx = default_fixture(tracker=tracker)
                target, states = target or fx.target, states or fx.states
                # The training checkpoint as trained, against the fixture's deployment: the
                # directory `difftest convert` writes for it and the launch command it prints.
                jobs = [(fx.checkpoint, out)]
                deployment = deployment or read_deployment(fx.served, None, fx.launch)
                if fx.training and fx.training.is_file():
                    extra["training"] = json.loads(fx.training.read_text())
                training_run = training_run or fx.training_run
            else:
                jobs = [(checkpoint, out)]
            if training_engine is None:
                from difftest.checkpoint import load_checkpoint
                from difftest.engines import training_engine_for

                training_engine = training_engine_for(load_checkpoint(jobs[0][0], allow_pickle=allow_pickle))
            if training_metrics is not None:
                extra["training"] = _read_training_metrics(training_metrics)
            if training_run is not None:
                from difftest.audit.shortfall import final_training_checkpoint

                final_training_checkpoint(training_run)  # a run with no checkpoint is an input error, up front
            analysis = {"chain_steps": chain_steps, "measure_target_capture": target_capture, "training": training_engine,
                        "training_metrics": extra.get("training"), "training_run": training_run}
            old_report = None
            if baseline is not None:
                from difftest.report.baseline import load_baseline

                if checkpoint is None:
                    fail("--baseline needs an explicit CKPT (a baseline describes one checkpoint)")
                if not baseline_factor >= 1.0:
                    fail(f"--baseline-factor must be at least 1, got {baseline_factor}")
                old_report = load_baseline(baseline)
            if deployment is not None and (serve_without_aux_capture or serve_lm_head_from_target):
                fail("--serve-without-aux-capture and --serve-lm-head-from-target simulate a deployment; with --serve "
                     "the launch command decides both")
            setup = ServingSetup(aux_capture=not serve_without_aux_capture, lm_head_from_target=serve_lm_head_from_target)
            # The engine whose server the launch starts serves the deployment; another engine serves
            # the training checkpoint the way that engine reads it (its adapter says how).
            serving = {name: dataclasses.replace(setup, deployment=deployment if deployment is not None
                                                 and name == deployment.engine else None)
                       for name in engines}
            codes = []
            for ckpt, out_dir in jobs:
                base = {"report": old_report, "path": str(baseline), "factor": baseline_factor} if old_report else None
                rep, paths = _report_one(ckpt, target, states, torch_dtype, device, out_dir, max_tokens, serving, extra,
                                         audit_config, allow_pickle, base, tracker, analysis)
                from difftest.report.build import verdict_line

                line = verdict_line(rep)
                typer.echo(f"{line}  [{rep['checkpoint']['format']}: {ckpt}]" if len(jobs) > 1 else line)
                if not quiet:
                    typer.echo(f"wrote {paths['json']}, {paths['md']} and {paths['html']}")
                if base:
                    found = rep["baseline"]["regressions"]
                    typer.echo(f"baseline: {len(found)} regression(s) against {baseline}" + "".join(f"\n  {r}" for r in found))
                    codes.append(EXIT_DIVERGED if found else EXIT_PARITY)
                else:
                    codes.append(EXIT_PARITY if rep["verdict"] == "PARITY" else EXIT_DIVERGED)
    raise typer.Exit(max(codes))


def parse_serving(text: str) -> list[str]:
    """--serving: serving engine names, comma-separated, each once, in the order given."""
    from difftest.engines import SERVING_ENGINES

    engines = list(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    if not engines or any(e not in SERVING_ENGINES for e in engines):
        fail(f"--serving takes serving engines from {', '.join(SERVING_ENGINES)}, comma-separated; got {text!r}")
    return engines


def read_deployment(serve: Path | None, launch: str | None, launch_file: Path | None):
    """--serve with its launch command. The command is split as a shell would and handed,
    unread, to the serving engine's adapter: its own parser is the only one that reads it."""
    import shlex

    from difftest.engines.base import Deployment

    if serve is None:
        if launch is not None or launch_file is not None:
            raise InputError("--launch/--launch-file describe how --serve DIR is served; give --serve too")
        return None
    if (launch is None) == (launch_file is None):
        raise InputError("--serve needs exactly one of --launch \"python -m sglang.launch_server ...\" (or \"vllm serve "
                         "...\") or --launch-file FILE")
    if not serve.is_dir():
        raise InputError(f"--serve {serve}: not a directory")
    if not (serve / "config.json").is_file():
        raise InputError(f"--serve {serve}: no config.json (a served draft directory holds the config the serving engine reads)")
    from difftest.checkpoint import check_weight_files

    # The weight files as the serving loader picks them (through the index): a shard it names
    # but that is missing is refused here, before any engine starts. The config is the engine's to read.
    check_weight_files(serve)
    if launch_file is not None:
        try:
            text, base, source = launch_file.read_text(), launch_file.resolve().parent, f"--launch-file {launch_file}"
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--launch-file {launch_file}: cannot read it ({exc})") from None
    else:
        text, base, source = launch, Path.cwd(), "--launch"
    try:
        argv = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise InputError(f"{source}: cannot split the command as a shell would ({exc})") from None
    if not argv:
        raise InputError(f"{source}: empty launch command")
    from difftest.engines import launch_engine

    engine = launch_engine(tuple(argv))
    if engine is None:
        raise InputError(f"{source}: names no serving engine's server (expected `python -m sglang.launch_server ...`, "
                         f"`sglang serve ...` or `vllm serve ...`): {' '.join(argv)[:120]}")
    return Deployment(serve.resolve(), tuple(argv), base, source, engine)


def _read_training_metrics(path: Path) -> dict:
    import json

    try:
        metrics = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: training metrics must be a JSON object ({exc})") from None
    if not isinstance(metrics, dict) or not isinstance(metrics.get("full_acc_0"), (int, float)):
        raise InputError(f"{path}: training metrics need a numeric full_acc_0 (speculators' step-0 accuracy)")
    return metrics


def _report_one(ckpt, target, states, dtype, device, out_dir, max_tokens, serving, extra, audit_config=False,
                allow_pickle=False, base=None, tracker=None, analysis=None):
    from difftest import pipeline
    from difftest.progress import PlannedStep, Tracker
    from difftest.report import build_report, write_reports
    from difftest.report.build import build_set_report

    tracker = tracker or Tracker(False)
    # Bad input fails inside prepare, before any progress line: its error stays the only line.
    inputs = pipeline.prepare(ckpt, target, states, max_tokens=max_tokens, allow_pickle=allow_pickle, device=device)
    name = f"report:{inputs.checkpoint.format.value}"
    tracker.extend([PlannedStep(name, f"report ({inputs.checkpoint.format.value} format)",
                                REPORT_ESTIMATE_S * len(serving))])
    tracker.start(name)
    results = pipeline.run_set(inputs, serving, dtype=dtype or inputs.checkpoint.stored_dtype(), device=device,
                               audit_config=audit_config, on_step=tracker.note, **(analysis or {}))
    tracker.note("writing reports")
    command = ["difftest", *sys.argv[1:]]
    reports = {name: build_report(result, command=command, extra=extra) for name, result in results.items()}
    rep = next(iter(reports.values())) if len(reports) == 1 else build_set_report(reports, command)
    if base:
        from difftest.report.baseline import regressions

        rep["baseline"] = {"path": base["path"], "factor": base["factor"],
                           "regressions": regressions(rep, base["report"], base["factor"])}
    paths = write_reports(rep, out_dir)
    tracker.finish(name)
    return rep, paths


# Divergences no conversion can remove: the serving engine does not implement what the draft
# was trained with. Each names the choices the user has.
NOT_REMOVABLE_BY_CONVERSION = {
    "norm_before_residual_ignored": ("SGLang 0.5.23 does not implement norm_before_residual, so no served config "
                                     "can express it. Choices: retrain with norm_before_residual=false; or serve "
                                     "on an engine that honors it; or accept the gap the report measures."),
}


@app.command()
def capture(
    checkpoint: Path = typer.Argument(..., help="the draft checkpoint whose aux layers are captured; never written to"),
    prompts: Path = typer.Option(..., help="JSON or JSONL: records with input_ids (and loss_mask), or chats with "
                                 "messages, rendered with the target's chat template"),
    out: Path = typer.Option(..., help="the states file to write (difftest's layout, what report --states reads)"),
    target: Optional[Path] = typer.Option(None, help="HF target model dir (default: as `difftest report` finds it)"),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 | fp16: the target forward's precision"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    force: bool = typer.Option(False, "--force", help="replace an existing OUT file"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="show engine logs and tracebacks"),
) -> None:
    """Capture the target's hidden states at the draft's aux layers, as its server hands them to the draft."""
    quiet_engines(verbose)
    import tempfile
    import time

    from difftest.capture import capture as capture_states, read_prompts
    from difftest.checkpoint import load_checkpoint
    from difftest.engines.base import RunOptions
    from difftest.pipeline import candidate_adapter, resolve_target_path
    from difftest.states import save_states
    from difftest.target import load_target
    from difftest.validate import validate_checkpoint

    with one_line_errors(verbose):
        torch_dtype = parse_dtype(dtype)
        if torch_dtype is None:
            fail("--dtype must be fp32, bf16 or fp16 for a capture")
        if device.split(":")[0] not in ("cpu", "cuda"):
            fail(f"--device must be cpu or cuda, got {device!r}")
        ckpt = load_checkpoint(checkpoint)
        validate_checkpoint(ckpt)
        tgt = load_target(resolve_target_path(ckpt, target))
        out = out.resolve()
        for given in (ckpt.origin, tgt.path):
            if out.is_relative_to(Path(given).resolve()):
                fail(f"--out {out} is inside an input ({given}); inputs are never written to")
        if out.exists() and not force:
            fail(f"--out {out} exists; pass --force to replace it")
        if not out.parent.is_dir():
            fail(f"--out {out}: its directory does not exist")
        rows = read_prompts(prompts, tgt.path, tgt.vocab_size, int(tgt.config.get("max_position_embeddings", 2048)))
        t0 = time.perf_counter()
        engine = candidate_adapter()
        states = capture_states(ckpt, tgt, rows, engine, RunOptions(dtype=torch_dtype, device=device))
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_states(states, tmp)
            os.replace(tmp, out)  # a failed write leaves no file that could pass for the states
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    typer.echo(f"wrote {out}: {len(rows)} requests, {states.num_tokens} rows, hidden_states{list(states.aux_layer_ids)} "
               f"from {engine.name}'s target forward, in {time.perf_counter() - t0:.1f}s")


@app.command()
def convert(
    checkpoint: Path = typer.Argument(..., help="the training checkpoint (speculators or legacy format); never written to"),
    out: Path = typer.Argument(..., help="the served directory to write (must not exist or be empty, unless --force)"),
    target: Optional[Path] = typer.Option(None, help="HF target model dir (default: as `difftest report` finds it)"),
    states: Optional[Path] = typer.Option(None, help="captured hidden states for the parity report (default: as `report` finds them)"),
    reports: Path = typer.Option(Path("reports/convert"), help="where the parity report on the output goes"),
    force: bool = typer.Option(False, "--force", help="replace an existing OUT directory (written beside it, then swapped in)"),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="print only the launch command and the verdict line"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="show engine logs and tracebacks"),
) -> None:
    """Write an SGLang-ready directory, print the command that serves it, then prove parity on what was written."""
    quiet_engines(verbose)
    from difftest.outputs import output_dir

    with one_line_errors(verbose):
        with output_dir(reports, (checkpoint, target, states, out), flag="--reports"):
            rep, paths = _convert(checkpoint, out, target, states, reports, quiet, force)
    from difftest.report.build import verdict_line

    typer.echo(verdict_line(rep))
    if not quiet:
        typer.echo(f"wrote {paths['json']}, {paths['md']} and {paths['html']}")
    if rep["verdict"] == "PARITY":
        typer.echo(f"parity proven on {out}: serve it with the command above")
        raise typer.Exit(EXIT_PARITY)
    cause = (rep.get("diagnosis") or {}).get("cause")
    if cause in NOT_REMOVABLE_BY_CONVERSION:
        typer.echo(f"not removable by conversion: {cause}. {NOT_REMOVABLE_BY_CONVERSION[cause]}")
    raise typer.Exit(EXIT_DIVERGED)


def _convert(checkpoint: Path, out: Path, target, states, reports: Path, quiet: bool, force: bool = False):
    import shlex
    import time

    from difftest import convert as conversion
    from difftest import pipeline
    from difftest.checkpoint import load_checkpoint
    from difftest.engines.base import Deployment, ServingSetup
    from difftest.outputs import refuse_inside_inputs
    from difftest.progress import Tracker
    from difftest.validate import validate_checkpoint

    refuse_inside_inputs(out, (checkpoint, target, states), flag="OUT")
    dest = out.resolve()
    if dest.exists() and not dest.is_dir():
        raise InputError(f"{out}: exists and is not a directory; choose a new path")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise InputError(f"{out}: already exists and is not empty; choose a new path, or pass --force to replace it")
    ckpt = load_checkpoint(checkpoint)
    validate_checkpoint(ckpt)
    target_path = pipeline.resolve_target_path(ckpt, target)
    # Every input of the parity report is read before anything is written: bad input leaves no directory.
    pipeline.prepare(checkpoint, target_path, states)
    if dest.exists() and not any(dest.iterdir()):
        dest.rmdir()  # empty: the atomic rename below needs the name free
    t0 = time.perf_counter()
    try:
        conversion.served_copy(ckpt, dest)
    except OSError as exc:
        raise InputError(f"{out}: cannot write the served directory ({exc.strerror or exc})") from None
    argv = conversion.launch_command(str(dest), str(target_path), ckpt.stored_dtype())
    typer.echo(f"wrote {out} in {time.perf_counter() - t0:.1f}s; serve it with:\n  {shlex.join(argv)}")
    deployment = Deployment(dest, tuple(argv), Path.cwd(), "difftest convert's launch command")
    tracker = Tracker(not quiet)
    with tracker.live():
        return _report_one(checkpoint, target_path, states, None, "cpu", reports, None,
                           {"sglang": ServingSetup(deployment=deployment)}, {}, True, False, None, tracker,
                           {"chain_steps": 4, "measure_target_capture": True})


@app.command()
def selftest(
    fixture: str = typer.Option("all", help="tiny | default (the SmolLM2 draft) | all"),
    dtype: list[str] = typer.Option(["fp32", "bf16"], help="run dtypes (repeatable)"),
    fault: Optional[list[str]] = typer.Option(None, help="only these faults (repeatable; default: the whole catalog)"),
    out: Path = typer.Option(Path("reports/selftest"), help="where selftest.json and selftest.md go"),
    training_engine: str = typer.Option("speculators", "--training",
                                        help="the training engine whose fixture drafts are faulted: speculators "
                                        "(tiny and the SmolLM2 draft) or specforge (its tiny export)"),
    serving_engines: str = typer.Option("sglang,vllm", "--serving", envvar="DIFFTEST_SERVING",
                                        help="the serving engines each fault is run against, comma-separated"),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="print only the score line"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="show engine logs and tracebacks"),
) -> None:
    """Inject every known fault into scratch copies and check each is caught, at the right place, with the right cause."""
    quiet_engines(verbose)
    engines = parse_serving(serving_engines)
    from difftest.faults import FAULTS_BY_NAME
    from difftest.tolerances import DTYPES

    if fixture not in ("tiny", "default", "all"):
        fail(f"--fixture must be tiny, default or all, got {fixture!r}")
    from difftest.engines import TRAINING_ENGINES

    if training_engine not in TRAINING_ENGINES:
        fail(f"--training takes one of {', '.join(TRAINING_ENGINES)}; got {training_engine!r}")
    for name in dtype:
        if name not in DTYPES:
            fail(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    unknown = sorted(set(fault or ()) - set(FAULTS_BY_NAME))
    if unknown:
        fail(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS_BY_NAME)}")
    from rich.console import Console

    from difftest.selftest import run_selftest, write_selftest

    console = Console(stderr=True, quiet=quiet)
    from difftest.outputs import output_dir

    def show(o) -> None:
        if not o.applies:
            console.print(f"n/a  {o.serving} {o.fixture} {o.dtype} {o.fault}: {o.why}", highlight=False)
            return
        mark = "[green]pass[/]" if o.passed else "[red]FAIL[/]"
        console.print(f"{mark} {o.serving} {o.fixture} {o.dtype} {o.fault}: expected {o.expected_at} / "
                      f"{o.expected_cause}, found {o.found_at} / {o.found_cause} ({o.seconds:.1f}s)", highlight=False)

    with one_line_errors(verbose):
        with output_dir(out, owned=("selftest.json", "selftest.md")):
            score = run_selftest(fixture, dtypes=dtype, only=fault, on_outcome=show, serving=engines,
                                 training=training_engine)
            paths = write_selftest(score, out)
    if not quiet:
        from difftest.selftest import render_table

        Console().print(render_table(score))
    from difftest.selftest import score_line

    typer.echo(f"selftest: {score_line(score)}" + ("" if quiet else f"; wrote {paths['json']} and {paths['md']}"))
    raise typer.Exit(EXIT_PARITY if score.ok else EXIT_DIVERGED)


@app.command()
def fuzz(
    examples: int = typer.Option(50, help="how many drafted configs to run through both engines"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 (default: drawn per example)"),
    seed: int = typer.Option(0, help="Hypothesis seed: the same seed explores the same cases"),
    shrink_budget: int = typer.Option(60, help="examples Hypothesis may spend shrinking each distinct divergence"),
    out: Path = typer.Option(Path("reports/fuzz"), help="where fuzz.json goes"),
    save_regressions: bool = typer.Option(False, "--save-regressions", help="write each shrunk divergence to fixtures/regressions/"),
    serving_engine: str = typer.Option("sglang", "--serving", help="the serving engine the drafted configs run on: "
                                       "sglang | vllm"),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="print only the summary"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="show engine logs and tracebacks"),
) -> None:
    """Draw draft configs and vocab mappings with Hypothesis, run both engines, shrink each distinct divergence."""
    quiet_engines(verbose)
    if examples < 1:
        fail(f"--examples must be at least 1, got {examples}")
    if dtype is not None and dtype not in ("fp32", "bf16"):
        fail(f"--dtype must be fp32 or bf16, got {dtype!r}")
    serving = parse_serving(serving_engine)
    if len(serving) != 1:
        fail(f"--serving for fuzz names one engine (each gets its own run), got {serving_engine!r}")
    serving = serving[0]
    import json as _json

    from difftest import fuzz as fz
    from difftest.progress import steps
    from difftest.report.build import atomic_write

    from difftest.outputs import output_dir

    with one_line_errors(verbose):
        with output_dir(out, owned=("fuzz.json",)), steps(not quiet, "difftest fuzz") as step:
            count = [0]

            def seen(o) -> None:
                count[0] += 1
                step(f"{count[0]}/{examples} {o.verdict} {o.cause or ''} {o.first_divergence or ''}".rstrip())

            summary = fz.explore(examples, seed=seed, dtype=dtype, on_outcome=seen, serving=serving)
            for sig in sorted({o.signature for o in summary.outcomes if o.verdict == "DIVERGED"}, key=str):
                step(f"shrinking {sig[1]} at {sig[2]}")
                minimal = fz.shrink(sig, budget=shrink_budget, seed=seed, dtype=dtype, serving=serving)
                if minimal is not None:
                    summary.minimal[sig] = minimal
    out.mkdir(parents=True, exist_ok=True)
    doc = {"examples": len(summary.outcomes), "seconds": summary.seconds, "examples_per_minute": summary.examples_per_minute,
           "signatures": [{"verdict": v, "cause": c, "first_divergence": p, "count": n}
                          for (v, c, p), n in sorted(summary.signatures.items(), key=str)],
           "unexplained": [list(s) for s in summary.unexplained],
           "minimal": [m.as_dict() for m in summary.minimal.values()],
           "outcomes": [o.as_dict() for o in summary.outcomes]}
    atomic_write(out / "fuzz.json", _json.dumps(doc, indent=2, default=str) + "\n")
    written = [str(fz.write_regression(m)) for m in summary.minimal.values()] if save_regressions else []
    typer.echo(f"fuzz: {len(summary.outcomes)} examples in {summary.seconds:.0f}s ({summary.examples_per_minute:.1f}/min), "
               f"{len(summary.signatures)} distinct outcomes, {len(summary.unexplained)} unexplained")
    if not quiet:
        for row in doc["signatures"]:
            typer.echo(f"  {row['count']:4d}  {row['verdict']:8s} {row['cause'] or '-'} at {row['first_divergence'] or '-'}")
        for m in summary.minimal.values():
            case = {k: v for k, v in m.case.items() if k != "seed"}
            typer.echo(f"  minimal {m.cause} at {m.first_divergence}: {_json.dumps(case)}")
        for path in written:
            typer.echo(f"  wrote {path}")
    raise typer.Exit(EXIT_DIVERGED if summary.unexplained else EXIT_PARITY)


@app.command("build-fixtures")
def build_fixtures(
    which: str = typer.Argument("tiny", help="tiny | default | specforge (a SpecForge draft on the default's target) | "
                                "llama3.1-8b | kimi-k2.5 (random weights at real shapes)"),
    out: Optional[Path] = typer.Option(None, help="output dir (tiny: default fixtures/tiny; real shapes: default .cache/difftest/<name>)"),
    from_scratch: bool = typer.Option(False, help="default, specforge: generate and train for real instead of using the shipped, checksummed generations and draft"),
    ship: bool = typer.Option(False, help="default, specforge, with --from-scratch: write the result to fixtures/ as the shipped artifact"),
) -> None:
    """Build the tiny committed fixture, the SmolLM2 default fixture, or a real-shape random draft."""
    quiet_engines(False)
    if (from_scratch or ship) and which not in ("default", "specforge"):
        fail("--from-scratch and --ship apply to the default and specforge fixtures only")
    if ship and not from_scratch:
        fail("--ship writes a from-scratch build; add --from-scratch")
    if out is not None:
        from difftest.outputs import check_writable

        try:
            check_writable(out)
        except InputError as exc:
            fail(str(exc))
    if which == "tiny":
        from difftest.fixturegen import tiny

        dest = out or Path("fixtures/tiny")
        tiny.build(dest)
        typer.echo(f"built {dest}")
    elif which == "default":
        from difftest.fixturegen import smollm2
        from difftest.fixturegen.default import default_fixture

        if from_scratch:
            os.environ[smollm2.FROM_SCRATCH_ENV] = "1"
        try:
            fx = default_fixture(progress=True)
            shipped = smollm2.ship(smollm2.Paths(fx.target.parent)) if ship else None
        except InputError as exc:
            fail(str(exc))
        typer.echo(f"built {fx.checkpoint}" + (f"; shipped as {shipped}" if shipped else ""))
    elif which == "specforge":
        from difftest.fixturegen import specforge_smollm2

        # Only SpecForge's own steps are rebuilt from scratch: the default fixture's shipped
        # conversations are what the speculators draft trained on too.
        try:
            p = specforge_smollm2.build(from_scratch=from_scratch)
            same = specforge_smollm2.matches_shipped(p) if from_scratch else None
            shipped = specforge_smollm2.ship(p) if ship else None
        except InputError as exc:
            fail(str(exc))
        said = {True: "; bit for bit the shipped export", False: "; differs from the shipped export"}.get(same, "")
        typer.echo(f"built {p.draft}{said}" + (f"; shipped as {shipped}" if shipped else ""))
    elif which in ("llama3.1-8b", "kimi-k2.5"):
        from difftest.fixturegen import realshape
        from difftest.fixturegen.cache import cache_root

        dest = realshape.build(which, out or cache_root() / which)
        typer.echo(f"built {dest} (speculators/, legacy/, target/, states.safetensors)")
    else:
        fail(f"unknown fixture {which!r}: expected tiny, default, specforge, llama3.1-8b or kimi-k2.5")


def main() -> None:
    """Usage errors are one line, like every other bad input; an interrupt says so."""
    try:  # typer 0.29 vendors click as typer._click; earlier releases raise click's own
        from typer._click import exceptions as cli_errors
    except ImportError:
        from click import exceptions as cli_errors

    command = typer.main.get_command(app)
    try:
        code = command.main(standalone_mode=False)
    except cli_errors.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help())
        code = EXIT_INPUT
    except cli_errors.UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        message = " ".join(exc.format_message().split())
        typer.echo(f"difftest: error: {where}{message}{hint}", err=True)
        code = EXIT_INPUT
    except cli_errors.Abort:
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        # Every output is written atomically: an interrupted run leaves no partial file behind.
        typer.echo("difftest: interrupted; nothing partial was written", err=True)
    from difftest.process_exit import exit_after_handlers

    exit_after_handlers(code or 0)


if __name__ == "__main__":
    main()
