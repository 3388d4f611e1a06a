"""One difftest run: checkpoint -> engine adapters -> probe records -> comparison -> diagnosis.

The report module renders what this returns; nothing here formats text.
"""

from __future__ import annotations

import json
import time
from typing import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from difftest.checkpoint import Checkpoint, load_checkpoint
from difftest.compare import Comparison, compare_runs
from difftest.diagnosis import Diagnosis, rank_by_cost
from difftest.engines.base import EngineAdapter, EngineRun, RunOptions, ServingSetup
from difftest.errors import InputError, ServingRefused
from difftest.noise import noise_floor
from difftest.states import ACCEPTED_LAYOUTS, CapturedStates, check_states_fit, first_id_outside, load_states
from difftest.target import TargetWeights, load_target
from difftest.tolerances import Tolerance, tolerance_for

DEFAULT_STATES_NAMES = ("states.safetensors", "../states.safetensors")
# Whole requests up to this many tokens are run through the target for the capture audit.
CAPTURE_TOKENS = 192


def reference_adapter(name: str = "speculators") -> EngineAdapter:
    from difftest.engines import adapter

    return adapter(name)


def candidate_adapter(name: str = "sglang") -> EngineAdapter:
    from difftest.engines import adapter

    return adapter(name)


@dataclass
class RunInputs:
    checkpoint: Checkpoint
    target: TargetWeights
    states: CapturedStates
    states_source: str


@dataclass
class RunResult:
    inputs: RunInputs
    options: RunOptions
    tolerance: Tolerance
    reference: EngineRun
    candidate: EngineRun
    comparison: Comparison
    diagnosis: Diagnosis | None
    noise_floor: dict[str, dict[str, float]] | None
    timings_s: dict[str, float] = field(default_factory=dict)
    findings: list = field(default_factory=list)
    config_audit: list[dict] | None = None
    conversion: list[dict] = field(default_factory=list)
    capture: dict = field(default_factory=dict)
    target_capture: object = None  # audit.target_capture.CaptureParity, when measured
    acceptance: object = None  # acceptance.AcceptanceComparison, when simulated
    deployment: dict | None = None  # trained vs served: plan, tensor and launch rows, when --serve was given


# Below this many checkpoint bytes a full collection (about 0.5 s with both engines
# imported) costs more than the memory it could return.
COLLECT_ABOVE_BYTES = 256 << 20


def release_memory(collect: bool = True) -> None:
    """Hand freed engine memory back to the OS between phases. Without it glibc keeps the
    freed arenas of one engine's load, and the next engine's peak lands on top of them."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def resolve_target_path(ckpt: Checkpoint, target: str | Path | None) -> Path:
    if target is not None:
        return Path(target)
    verifier = ((ckpt.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    candidates = [ckpt.origin / verifier] if verifier and not Path(verifier).is_absolute() else ([Path(verifier)] if verifier else [])
    # The fixture layouts keep the target beside the draft, or one level up.
    candidates += [ckpt.origin.parent / "target", ckpt.origin.parent.parent / "target"]
    for c in candidates:
        if (c / "config.json").is_file():
            return c.resolve()
    raise InputError(f"{ckpt.origin}: no target found; pass --target DIR (an HF Llama target with safetensors weights)")


def resolve_states(ckpt: Checkpoint, states: str | Path | None) -> Path:
    if states is not None:
        return Path(states)
    for name in DEFAULT_STATES_NAMES:
        p = ckpt.origin / name
        if p.is_file():
            return p.resolve()
    raise InputError(f"{ckpt.origin}: no captured hidden states found ({' or '.join(DEFAULT_STATES_NAMES)} beside "
                     f"it); {ACCEPTED_LAYOUTS}, or `difftest capture` writes one")


def read_states(path: Path, ckpt: Checkpoint, tgt: TargetWeights, device: str = "cpu") -> tuple[CapturedStates, str]:
    """Any supported layout. Foreign layouts don't record which layers they hold: they hold
    what their producer's capture config resolves for this draft, so that is what is assumed."""
    from difftest.readers import StatesLayout, detect_layout, read_datagen, read_sglang_server

    layout = detect_layout(path)
    if layout == StatesLayout.DIFFTEST:
        return load_states(path), str(path)
    options = RunOptions(device=device)
    training_ids = reference_adapter().capture_plan(ckpt, tgt, options).hf_layer_ids
    if layout == StatesLayout.DATAGEN:
        return (read_datagen(path, training_ids, vocab_size=tgt.vocab_size),
                f"{path} ({layout}, layers {training_ids} from the training capture plan)")
    serving_ids = candidate_adapter().capture_plan(ckpt, tgt, options).hf_layer_ids or training_ids
    return (read_sglang_server(path, serving_ids, tgt.hidden_size, vocab_size=tgt.vocab_size),
            f"{path} ({layout}, layers {serving_ids} from the serving capture plan)")


def prepare(ckpt_path, target=None, states=None, max_tokens: int | None = None, allow_pickle: bool = False,
            device: str = "cpu") -> RunInputs:
    from difftest.validate import validate_checkpoint

    ckpt = load_checkpoint(ckpt_path, allow_pickle=allow_pickle)
    validate_checkpoint(ckpt)
    tgt = load_target(resolve_target_path(ckpt, target))
    states_path = resolve_states(ckpt, states)
    st, states_label = read_states(states_path, ckpt, tgt, device)
    if max_tokens:
        st = st.head(max_tokens)
    check_states_fit(st, ckpt.spec.target_hidden_size, ckpt.spec.num_aux, str(states_path))
    if tgt.hidden_size != ckpt.spec.target_hidden_size:
        raise InputError(f"target hidden size {tgt.hidden_size} does not match the draft's target_hidden_size {ckpt.spec.target_hidden_size}")
    if tgt.vocab_size != ckpt.spec.target_vocab_size:
        raise InputError(f"target vocab {tgt.vocab_size} does not match the draft config's vocab_size {ckpt.spec.target_vocab_size}")
    outside = first_id_outside(st.input_ids, tgt.vocab_size)
    if outside is not None:
        raise InputError(f"{states_path}: input_ids[{outside}] is {int(st.input_ids[outside])}, outside the target "
                         f"vocab [0, {tgt.vocab_size})")
    return RunInputs(ckpt, tgt, st, states_label)


def run(
    inputs: RunInputs,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    serving: ServingSetup = ServingSetup(),
    reference: EngineAdapter | None = None,
    candidate: EngineAdapter | None = None,
    measure_noise: bool | None = None,
    audit_config: bool = False,
    on_step: Callable[[str], None] = lambda _msg: None,
    chain_steps: int = 0,
    measure_target_capture: bool = False,
    training_metrics: dict | None = None,
    training_run: Path | None = None,
    config_audit_runs: dict | None = None,
) -> RunResult:
    """Training (`reference`) against one serving engine (`candidate`) on the same inputs.
    `config_audit_runs`: the config audit's runs by (engine, config), shared by the reports of
    one set, so training's variants are built once for every serving engine."""
    reference = reference or reference_adapter()
    candidate = candidate or candidate_adapter()
    options = RunOptions(dtype=dtype, device=device, serving=serving)
    t0 = time.perf_counter()
    # A launch command decides the serving draft's dtype and chain length; the reference
    # drafts the same number of steps so the two predictions are comparable.
    try:
        deployment = candidate.deployment_plan(inputs.checkpoint, inputs.target, options)
    except ServingRefused as refused:
        return refused_deployment(inputs, options, refused, reference, candidate, on_step)
    cand_options = options if deployment is None else replace(options, dtype=deployment.dtype)
    if deployment is not None and chain_steps > 0:
        chain_steps = deployment.chain_steps
    collect = inputs.checkpoint.nbytes() > COLLECT_ABOVE_BYTES
    chained = f" and {chain_steps}-step chain draft" if chain_steps > 0 else ""
    serving_plan = candidate.capture_plan(inputs.checkpoint, inputs.target, options)
    chain_states = None
    if chain_steps > 0:
        chain_states = serving_capture_states(inputs, serving_plan, candidate, cand_options, on_step)
    # Training runs the checkpoint as trained: no serving setup reaches it.
    ref_options = RunOptions(dtype=dtype, device=device)
    if not _already_run(reference, inputs.checkpoint, inputs.target, inputs.states, ref_options, chain_steps):
        on_step(f"{reference.name}: load, forward{chained}")
    ref_run = reference.run(inputs.checkpoint, inputs.target, inputs.states, ref_options, chain_steps=chain_steps)
    release_memory(collect)
    on_step(f"{candidate.name}: load, forward{chained}")
    try:
        cand_run = candidate.run(inputs.checkpoint, inputs.target, inputs.states, cand_options,
                                 chain_steps=chain_steps, chain_states=chain_states)
    except ServingRefused as refused:  # its loader refuses what it is served, as its server would at start
        return refused_deployment(inputs, options, refused, reference, candidate, on_step)
    release_memory(collect)
    if cand_run.chain is not None and chain_states is None and serving_plan.hf_layer_ids != list(inputs.states.aux_layer_ids):
        note = (f"drafted from the training states: the serving side captures {serving_plan.hf_layer_ids}, but these "
                "states carry no first tokens, so the full sequences to capture them from cannot be rebuilt")
        cand_run.chain.notes.append(note)
        cand_run.details.setdefault("chain_notes", []).append(note)
    floor = None
    if measure_noise if measure_noise is not None else dtype != torch.float32:
        fp32 = RunOptions(dtype=torch.float32, device=device)
        if not _already_run(reference, inputs.checkpoint, inputs.target, inputs.states, fp32):
            on_step(f"{reference.name}: fp32 run for the noise floor")
        full = reference.run(inputs.checkpoint, inputs.target, inputs.states, fp32)
        floor = noise_floor(ref_run, full)
        del full
        release_memory(collect)
    # Two precisions meet only under a launch whose dtype differs from training's: compare at the looser.
    tol = max((tolerance_for(dtype), tolerance_for(cand_options.dtype)), key=lambda t: t.rel_max)
    comparison = compare_runs(ref_run.probes, cand_run.probes, tol, {**ref_run.missing, **cand_run.missing})
    on_step("audit: ledgers, vocab, config translation, target capture")
    findings, conversion_rows, capture = audit(inputs, reference, candidate, ref_run, cand_run, options, serving_plan)
    served = None
    if deployment is not None:
        served = audit_deployment(inputs, serving.deployment.served_dir, serving.deployment.launch_argv, deployment,
                                  cand_run, dtype)
        findings += served.pop("findings")
    rows = None
    if audit_config:
        from difftest.audit.config import audit_config as run_config_audit

        on_step("audit: measuring each config field in both engines")
        # How each engine reads a config field is the engine's, whatever was deployed: the
        # audit measures it on the conversion difftest writes.
        plain = replace(options, serving=replace(options.serving, deployment=None))
        rows, config_findings = run_config_audit(inputs.checkpoint, inputs.target, inputs.states, reference, candidate, plain,
                                                 runs=config_audit_runs)
        # A known divergence the audit has just measured is reported as measured, once.
        measured = {r["cause"] for r in rows if "perturbed_to" in r} | {f.cause for f in config_findings}
        findings = [f for f in findings if not (f.check == "known" and f.cause in measured)] + config_findings
    parity = None
    if measure_target_capture:
        parity, parity_findings = target_capture_parity(inputs, candidate, options, on_step)
        findings += parity_findings
    accept = None
    if chain_steps > 0:
        from difftest.acceptance import compare_acceptance
        from difftest.audit.shortfall import check_training_shortfall

        accept = compare_acceptance(ref_run.chain, cand_run.chain, inputs.states, inputs.target, training_metrics)
        on_step("acceptance: against training's held-out accuracy")
        findings += check_training_shortfall(accept, ref_run.chain, inputs.checkpoint, inputs.states, training_run,
                                             findings, capture_measured=parity is not None)
    if accept is not None:
        engines = {"reference": (reference, ref_options), "candidate": (candidate, cand_options)}
        measure_repair_costs(findings, inputs, engines, chain_steps, ref_run, chain_states, accept, training_metrics,
                             training_run, on_step, deployed=deployment is not None)
    if accept is not None and deployment is not None:
        measure_undo_costs(findings, inputs, serving.deployment, deployment.served_config_file, candidate, options,
                           chain_steps, ref_run, accept, training_metrics, training_run, on_step)
    # The headline is the cause that costs the most acceptance, serving divergence or training shortfall.
    diagnosis = rank_by_cost(comparison, findings, accept)
    return RunResult(
        inputs=inputs, options=options, tolerance=tol, reference=ref_run, candidate=cand_run,
        comparison=comparison, diagnosis=diagnosis, noise_floor=floor,
        timings_s={"engines": time.perf_counter() - t0}, findings=findings, config_audit=rows,
        conversion=conversion_rows, capture=capture, target_capture=parity, acceptance=accept, deployment=served,
    )


class _TrainingRunsOnce:
    """The training engine behind a set of serving engines: one report compares it with each of
    them, and the same checkpoint, states, options and chain length give the same run, so each
    is run once. Anything else (a repaired copy, a variant) is a new run."""

    def __init__(self, adapter: EngineAdapter):
        self._adapter = adapter
        self.name = adapter.name
        # (ids of the inputs, chain steps) -> [(options, the inputs, the run)]
        self._runs: dict[tuple, list[tuple[RunOptions, tuple, EngineRun]]] = {}

    def __getattr__(self, attr):
        return getattr(self._adapter, attr)

    def _seen(self, checkpoint, target, states, options, chain_steps: int, chain_states) -> tuple[list, EngineRun | None]:
        inputs = (checkpoint, target, states, chain_states)
        # The same objects, not equal ones: each entry keeps its inputs alive, so no id is reused.
        # Options are compared, not hashed: a serving setup's config edits may hold lists.
        runs = self._runs.setdefault((*map(id, inputs), chain_steps), [])
        return runs, next((run_ for seen, _, run_ in runs if seen == options), None)

    def has_run(self, checkpoint, target, states, options, chain_steps: int = 0, chain_states=None) -> bool:
        return self._seen(checkpoint, target, states, options, chain_steps, chain_states)[1] is not None

    def run(self, checkpoint, target, states, options, chain_steps: int = 0, chain_states=None) -> EngineRun:
        runs, run_ = self._seen(checkpoint, target, states, options, chain_steps, chain_states)
        if run_ is None:
            run_ = self._adapter.run(checkpoint, target, states, options, chain_steps=chain_steps,
                                     chain_states=chain_states)
            runs.append((options, (checkpoint, target, states, chain_states), run_))
        return run_


def _already_run(reference: EngineAdapter, *run_args) -> bool:
    """Whether `reference.run(*run_args)` returns a run shared from an earlier report of the set
    (so the progress line does not announce work that will not happen)."""
    return isinstance(reference, _TrainingRunsOnce) and reference.has_run(*run_args)


def run_set(inputs: RunInputs, serving: dict[str, ServingSetup], on_step: Callable[[str], None] = lambda _msg: None,
            training: str = "speculators", **analysis) -> dict[str, RunResult]:
    """Training (the engine called `training`) compared with each serving engine in turn
    (`serving`: engine name -> how it is served), the training engine's runs shared between them."""
    reference = _TrainingRunsOnce(reference_adapter(training))
    engines = {name: candidate_adapter(name) for name in serving}
    # Workers first (they import in a process of their own and return at once), then the
    # training engine's import, which would otherwise wait for a worker's first answer.
    for engine in (*engines.values(), reference):
        getattr(engine, "start_early", lambda: None)()
    analysis.setdefault("config_audit_runs", {})
    if analysis.get("chain_steps", 0) > 0:
        # A launch command decides how many steps its engine drafts; every engine in the set
        # drafts as many, so their accept lengths (and training's) are comparable.
        for name, setup in serving.items():
            if setup.deployment is None:
                continue
            options = RunOptions(dtype=analysis.get("dtype", torch.float32), device=analysis.get("device", "cpu"),
                                 serving=setup)
            try:
                analysis["chain_steps"] = engines[name].deployment_plan(inputs.checkpoint, inputs.target,
                                                                        options).chain_steps
            except ServingRefused:
                pass  # its comparison reports the refusal; the others keep the asked length
            break
    results = {}
    for name, setup in serving.items():
        step = (lambda msg, name=name: on_step(f"[{name}] {msg}")) if len(serving) > 1 else on_step
        results[name] = run(inputs, serving=setup, reference=reference, candidate=engines[name],
                            on_step=step, **analysis)
        release_memory(inputs.checkpoint.nbytes() > COLLECT_ABOVE_BYTES)
    return results


def _redraft_under(deployment, inputs: RunInputs, candidate: EngineAdapter, options: RunOptions, chain_steps: int,
                   ref_run: EngineRun, training_metrics: dict | None, on_step: Callable[[str], None], what: str):
    """The serving engine's chain drafted again under another deployment (its own capture
    under that launch included), scored against the same reference chain."""
    from difftest.acceptance import compare_acceptance

    alt = replace(options, serving=replace(options.serving, deployment=deployment))
    plan = candidate.deployment_plan(inputs.checkpoint, inputs.target, alt)
    alt = replace(alt, dtype=plan.dtype)
    on_step(f"{candidate.name}: chain again with {what}")
    chain_states = serving_capture_states(inputs, candidate.capture_plan(inputs.checkpoint, inputs.target, alt),
                                          candidate, alt, on_step)
    run_undone = candidate.run(inputs.checkpoint, inputs.target, inputs.states, alt, chain_steps=chain_steps,
                               chain_states=chain_states)
    recovered = compare_acceptance(ref_run.chain, run_undone.chain, inputs.states, inputs.target, training_metrics)
    del run_undone
    release_memory(False)
    return recovered


def measure_undo_costs(findings: list, inputs: RunInputs, deployment, served_config_file: str | None,
                       candidate: EngineAdapter, options: RunOptions,
                       chain_steps: int, ref_run: EngineRun, accept, training_metrics: dict | None,
                       training_run: Path | None, on_step: Callable[[str], None]) -> None:
    """Each deployment cause costed on its own, by the serving engine: a launch cause with that
    one flag set back to what training used; a served-directory cause on a scratch copy of the
    served directory with that one defect repaired (difftest/repairs.py). The accept length
    its chain recovers is recorded on the finding."""
    from difftest.repairs import REPAIRS, RepairSources, repaired_copy

    served = None
    measured_repairs: dict[str, dict] = {}
    for finding in findings:
        undo = finding.measured.get("undo") or {}
        if "cost_accept_length" in finding.measured or not ("flag" in undo or "repair" in undo):
            continue
        if "repair" in undo and REPAIRS[undo["repair"]].emulates_serving:
            continue  # the training engine's, measured by measure_repair_costs
        key = json.dumps(undo, sort_keys=True)
        if key in measured_repairs:  # the same repair, found by two checks: measured once
            finding.measured.update(measured_repairs[key])
            continue
        repaired = None
        if "flag" in undo:
            undone = deployment.with_flag(undo["flag"], undo["value"])
            what = f"{undo['flag']} {undo['value']}" if undo["value"] is not None else f"without {undo['flag']}"
        else:
            served = served or load_checkpoint(deployment.served_dir)
            if undo["repair"] == "served_config_restored" and served_config_file:
                finding.measured["undo_not_measured"] = ("the launch reads the draft's config from "
                                                         "--decrypted-draft-config-file, not the served directory")
                continue
            sources = RepairSources(inputs.target, training_run, inputs.checkpoint)
            repaired, what = repaired_copy(served, undo, sources)
            undone = deployment.with_served_dir(repaired.path, what)
        try:
            recovered = _redraft_under(undone, inputs, candidate, options, chain_steps, ref_run, training_metrics,
                                       on_step, f"{what}, to cost {finding.cause} alone")
        except (InputError, ServingRefused) as exc:
            finding.measured["undo_not_measured"] = f"the deployment with {what} is refused: {exc}"
            continue
        result = {"cost_accept_length": recovered.candidate.mean_accept_length - accept.candidate.mean_accept_length,
                  "undone": what, "undone_in": candidate.name}
        finding.measured.update(result)
        measured_repairs[key] = result
        del repaired


def measure_repair_costs(findings: list, inputs: RunInputs, engines: dict[str, tuple[EngineAdapter, RunOptions]],
                         chain_steps: int, ref_run: EngineRun, chain_states: CapturedStates | None, accept,
                         training_metrics: dict | None, training_run: Path | None,
                         on_step: Callable[[str], None], deployed: bool = False) -> None:
    """Each checkpoint cause costed on its own: a scratch copy with that one defect repaired
    (difftest/repairs.py), its chain drafted again by the engine the finding names (the
    reference when both engines load the defect alike, so that it carries the whole cost; the
    candidate when only it lost something), and the accept length that engine recovers
    recorded on the finding. A copy that emulates the serving engine in the training engine
    costs what training's acceptance loses that way. Under a deployment, the served directory
    holds what is served: only emulations run here (measure_undo_costs repairs the rest)."""
    from difftest.acceptance import compare_acceptance
    from difftest.audit.shortfall import CHECK as SHORTFALL_CHECK
    from difftest.repairs import REPAIRS, RepairNotApplicable, RepairSources, repaired_copy

    sources = RepairSources(inputs.target, training_run)
    for finding in findings:
        undo = finding.measured.get("undo") or {}
        if "repair" not in undo or "undone" in finding.measured:
            continue
        repair = REPAIRS[undo["repair"]]
        if repair.served_only or (deployed and not repair.emulates_serving):
            continue
        role = undo.get("engine", "reference")
        engine, options = engines[role]
        try:
            repaired, undone = repaired_copy(inputs.checkpoint, undo, sources)
        except RepairNotApplicable as why:
            finding.measured["undo_not_measured"] = str(why)
            continue
        on_step(f"{engine.name}: chain again with {undone}, to cost {finding.cause} alone")
        run_repaired = engine.run(repaired, inputs.target, inputs.states, options, chain_steps=chain_steps,
                                  chain_states=chain_states if role == "candidate" else None)
        if role == "candidate":
            recovered = compare_acceptance(ref_run.chain, run_repaired.chain, inputs.states, inputs.target,
                                           training_metrics)
            before, after = accept.candidate, recovered.candidate
        else:
            recovered = compare_acceptance(run_repaired.chain, ref_run.chain, inputs.states, inputs.target,
                                           training_metrics)
            before, after = accept.reference, recovered.reference
        gained = after.mean_accept_length - before.mean_accept_length
        # A training shortfall keeps its own cost (training against the prediction); what the
        # undo recovers is recorded beside it.
        key = "recovered_accept_length" if finding.check == SHORTFALL_CHECK else "cost_accept_length"
        finding.measured[key] = -gained if repair.emulates_serving else gained
        finding.measured["undone"] = undone
        finding.measured["undone_in"] = engine.name
        if repair.emulates_serving:
            finding.measured["cost_method"] = "emulated"
        else:
            # What the training-shortfall audit would read on the repaired copy (step-1 acceptance).
            finding.measured["repaired_step1"] = after.reach[0] if after.reach else None
        del run_repaired, repaired
        release_memory(False)


def refused_deployment(inputs: RunInputs, options: RunOptions, refused: ServingRefused, reference: EngineAdapter,
                       candidate: EngineAdapter, on_step: Callable[[str], None]) -> RunResult:
    """The serving engine refuses the served directory before any forward, as its server would
    refuse to start: the verdict names that, with what the user can do. The training side still
    runs (its probes are in the report); nothing is compared, since nothing would be served."""
    from difftest.audit.findings import Finding, Severity
    from difftest.compare import Comparison

    t0 = time.perf_counter()
    on_step(f"{reference.name}: load, forward")
    ref_run = reference.run(inputs.checkpoint, inputs.target, inputs.states, replace(options, serving=ServingSetup()))
    why = f"not run: {refused.engine} refuses the served directory (the launch finding says why)"
    cand_run = EngineRun(candidate.name, probes={}, missing={name: why for name in ref_run.probes},
                         details={"refused": refused.reason})
    deployment = options.serving.deployment
    # Where the user named the directory, it is theirs to read; otherwise it is a scratch copy.
    where = refused.served_dir if deployment is not None else "the served checkpoint"
    finding = Finding("launch", refused.cause, Severity.ERROR, f"{refused.engine} refuses {where}: {refused.reason}",
                      {"served_dir": where, "engine_error": refused.reason})
    # What the checkpoint alone shows still stands: it may name why the engine fails.
    findings = [finding, *checkpoint_findings(inputs.checkpoint)]
    served = None if deployment is None else {
        "served_dir": str(deployment.served_dir), "launch_argv": list(deployment.launch_argv),
        "plan": {"dtype": "not resolved", "chain_steps": 0, "flags": [], "notes": [finding.message]},
        "tensors": [], "config": [], "launch": [], "refused": refused.reason}
    # Every probe is listed as not computed, with why; the cause is the refusal itself, found
    # by the launch audit, never paired with a probe it did not make diverge.
    tol = tolerance_for(options.dtype)
    comparison = compare_runs(ref_run.probes, {}, tol, cand_run.missing)
    return RunResult(inputs=inputs, options=options, tolerance=tol, reference=ref_run, candidate=cand_run,
                     comparison=comparison, diagnosis=rank_by_cost(Comparison([]), findings),
                     noise_floor=None, timings_s={"engines": time.perf_counter() - t0}, findings=findings,
                     deployment=served)


def serving_capture_states(inputs: RunInputs, serving_plan, candidate: EngineAdapter, options: RunOptions,
                           on_step: Callable[[str], None]) -> CapturedStates | None:
    """What the serving target hands its draft under this deployment, when its capture plan
    differs from the layers the states hold: the serving engine's own target forward over the
    same sequences, with the capture its own code sets up (no aux capture: the hidden state it
    keeps instead). None when the plans agree (the states are then what it captures, which
    the capture audit measures) or when the states carry no first tokens to rebuild from."""
    from dataclasses import replace as with_fields

    from difftest.audit.target_capture import draft_rows

    wanted = serving_plan.hf_layer_ids
    if wanted is not None and list(wanted) == list(inputs.states.aux_layer_ids):
        return None
    sequences = inputs.states.sequences()
    if sequences is None:
        return None
    on_step(f"{candidate.name}: target forward with this deployment's capture, for its chain")
    served = candidate.capture_target(inputs.checkpoint, inputs.target, sequences, options)
    ids = served.hf_layer_ids if served.hf_layer_ids is not None else [inputs.target.num_layers]
    return with_fields(inputs.states, aux_hidden_states=draft_rows(served, inputs.states).float(),
                       aux_layer_ids=tuple(ids))


def audit_deployment(inputs: RunInputs, served_dir: Path, launch_argv, plan, cand_run: EngineRun, dtype: torch.dtype) -> dict:
    """Trained versus served: tensors, the served vocab map, the launch settings."""
    from difftest.audit.deployment import check_launch, check_served_tensors, config_rows
    from difftest.audit.vocab import check_vocab

    served = load_checkpoint(served_dir, config_file=plan.served_config_file)
    tensor_rows, tensor_findings = check_served_tensors(inputs.checkpoint, served, cand_run.ledger)
    launch_rows, launch_findings = check_launch(plan, dtype, inputs.checkpoint, served)
    return {"served_dir": str(served_dir), "launch_argv": list(launch_argv), "plan": plan.as_dict(),
            "tensors": tensor_rows, "config": config_rows(inputs.checkpoint, served), "launch": launch_rows,
            "findings": tensor_findings + check_vocab(served) + launch_findings}


def target_capture_parity(inputs: RunInputs, candidate: EngineAdapter, options: RunOptions,
                          on_step: Callable[[str], None]):
    """The serving engine's own target forward against the training capture, in fp32 (the
    states are compared at the precision they were captured at; a bf16 target would bury
    the adjacent-layer differences that name an off-by-one)."""
    from difftest.audit.target_capture import draft_row_index, measure_capture
    from difftest.target import hf_layer_states

    # Naming a chunk needs few tokens: adjacent layers differ by orders of magnitude more than
    # the fp32 tolerance on every row. Two full target forwards (30 layers, a 49k-vocab head)
    # over all the states would cost more than both engines' drafts together.
    states = inputs.states.head(CAPTURE_TOKENS)
    sequences = states.sequences()
    if sequences is None:
        return None, []
    fp32 = RunOptions(dtype=torch.float32, device=options.device, serving=options.serving)
    on_step(f"{candidate.name}: target forward with aux capture")
    served = candidate.capture_target(inputs.checkpoint, inputs.target, sequences, fp32)
    on_step("target: transformers forward for every layer boundary")
    layers = hf_layer_states(inputs.target.path, sequences)[:, draft_row_index(states)]
    return measure_capture(states, served, layers, tolerance_for(torch.float32))


def checkpoint_findings(ckpt: Checkpoint) -> list:
    """What the checkpoint alone shows, before any engine: its vocab map, files no loader reads,
    tensors stored twice."""
    from difftest.audit.ledger import check_duplicate_copies, check_unread_files
    from difftest.audit.vocab import check_vocab

    return check_vocab(ckpt) + check_unread_files(ckpt) + check_duplicate_copies(ckpt)


def audit(inputs: RunInputs, reference: EngineAdapter, candidate: EngineAdapter, ref_run: EngineRun,
          cand_run: EngineRun, options: RunOptions, serving_plan=None) -> tuple[list, list[dict], dict]:
    """The checks settled before the first matmul: ledgers, vocab mapping, config translation, capture."""
    from difftest.audit.capture import check_capture
    from difftest.audit.findings import Finding, Severity
    from difftest.audit.conversion import check_conversion
    from difftest.audit.ledger import check_ledgers, check_shipped_embedding

    ckpt = inputs.checkpoint
    findings = (check_ledgers(ref_run, cand_run) + check_shipped_embedding(ckpt, inputs.target, ref_run, cand_run)
                + checkpoint_findings(ckpt))
    # The config the serving engine read, as its adapter reports it (SGLang: the converted
    # legacy config; vLLM: the checkpoint's own, as its config code parsed it).
    served_config = cand_run.details.get("served_config")
    conversion_rows, conversion_findings = check_conversion(ckpt, served_config) if served_config else ([], [])
    serving_plan = serving_plan or candidate.capture_plan(ckpt, inputs.target, options)
    training_plan = reference.capture_plan(ckpt, inputs.target, RunOptions(dtype=options.dtype, device=options.device))
    capture_findings = check_capture(serving_plan, training_plan, inputs.states)
    if "fc.output" in cand_run.missing and not capture_findings:
        # Capture is right, yet the serving engine skipped fc: the widths happen to match.
        width = len(inputs.states.aux_layer_ids) * ckpt.spec.target_hidden_size
        capture_findings.append(Finding("capture", "fc_skipped_by_width_check", Severity.ERROR,
                                        f"{len(inputs.states.aux_layer_ids)} aux layer(s) x target hidden "
                                        f"{ckpt.spec.target_hidden_size} = {width} equals the draft's hidden size, so "
                                        f"{cand_run.engine} skipped fc: {cand_run.missing['fc.output']}",
                                        {"aux_width": width, "hidden_size": ckpt.spec.hidden_size}))
    from difftest.known_divergences import check_known_divergences

    findings += conversion_findings + capture_findings + check_known_divergences(ckpt, candidate.name, reference.name)
    capture = {"serving": serving_plan.as_dict(), "training": training_plan.as_dict(),
               "states_hf_ids": list(inputs.states.aux_layer_ids)}
    return findings, conversion_rows, capture
