"""Acceptance below training: the checkpoint may no longer do what was trained.

Both engines load the same checkpoint, so a change made to it after training (weights
edited, a vocab map regenerated, head rows out of step with the map) moves both alike and
no probe can see it. The training run's own held-out metric can: speculators' full_acc_0
is the step-1 acceptance the reference engine should reproduce on these rows. When it
falls below that band, each explanation that can be measured here is measured, and the
finding names the one the numbers support, or says none does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.audit.findings import Finding, Severity

CHECK = "acceptance"
# Predictions mapped through d2t land on tokens the target emits here far more often than a
# uniform draw over the draft vocab would; a map out of step with the head is near that draw.
LANDING_OVER_CHANCE = 2.0
RECORDED_GREEDY_MIN = 0.9  # below this share the states' tokens are not the target's greedy ones


@dataclass
class Explanation:
    cause: str
    supported: bool | None  # None: could not be tested here
    evidence: str
    numbers: dict

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def band(p0: float, rows: int) -> float:
    """Two standard errors of a rate over this many rows, plus 0.02 for the split's content."""
    return 2 * (p0 * (1 - p0) / max(rows, 1)) ** 0.5 + 0.02


def expected_accept_length(training: dict, steps: int) -> tuple[float, int]:
    """1 + sum of full_acc_j over the steps training reports (and the chain drafts)."""
    known = [float(training[f"full_acc_{j}"]) for j in range(steps) if f"full_acc_{j}" in training]
    return 1.0 + sum(known), len(known)


def final_training_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint a speculators training run saved (its output directory, or one
    checkpoint directory itself)."""
    from difftest.errors import InputError

    run_dir = Path(run_dir)
    if (run_dir / "model.safetensors").is_file() or any(run_dir.glob("model*.safetensors")):
        return run_dir
    found = [d.parent for d in run_dir.rglob("config.json") if any(d.parent.glob("*.safetensors"))]
    if not found:
        raise InputError(f"training run {run_dir}: no saved checkpoint (config.json with safetensors) under it")

    def epoch_of(d: Path) -> int:
        digits = "".join(ch for ch in d.name if ch.isdigit())
        return int(digits) if digits else -1

    return max((d for d in found if not d.is_symlink()), key=lambda d: (epoch_of(d), d.stat().st_mtime))


def _changed_tensors(checkpoint, run_dir: Path) -> tuple[list[str], int, list[list[str]]]:
    """What differs from the run's saved checkpoint, how many tensors were compared, and the
    changed ones that can be put back as trained ([checkpoint name, training-run name])."""
    from difftest.checkpoint import load_checkpoint
    from difftest.convert import speculators_name

    trained = load_checkpoint(final_training_checkpoint(run_dir))
    trained_names = {speculators_name(n): n for n in trained.tensor_names()}
    changed, compared, restorable = [], 0, []
    for name in checkpoint.tensor_names():
        key = speculators_name(name)
        if key not in trained_names:
            changed.append(f"{name} (not in the training run)")
            continue
        a, b = checkpoint.get(name), trained.get(trained_names[key])
        compared += 1
        if a.shape != b.shape:
            changed.append(f"{name} (shape {tuple(b.shape)} -> {tuple(a.shape)})")
        elif a.is_floating_point() and a.dtype != b.dtype:
            # Within a cast is the same tensor: compare at the narrower dtype.
            narrow = a.dtype if a.element_size() <= b.element_size() else b.dtype
            if not torch.equal(a.to(narrow), b.to(narrow)):
                changed.append(name)
                restorable.append([name, trained_names[key]])
        elif not torch.equal(a, b):
            changed.append(name)
            restorable.append([name, trained_names[key]])
    return changed, compared, restorable


# Capture-audit causes that say the states' chunks are not the layers the draft was trained on,
# most specific first: both engines read those same states, so they explain a shortfall that
# no engine comparison can see.
STATES_CAUSES = ("aux_layers_wrong_order", "aux_layers_off_by_one", "states_not_from_this_config", "aux_layers_mismatch")


def check_training_shortfall(acc, reference_chain, checkpoint, states, training_run: Path | None = None,
                             findings: list[Finding] = (), capture_measured: bool = False) -> list[Finding]:
    """An ERROR finding when the reference engine's predicted step-1 acceptance is below
    training's full_acc_0 band, with every explanation that can be tested, tested."""
    training = acc.training or {}
    p0 = training.get("full_acc_0")
    ref = acc.reference
    if p0 is None or ref.scored_rows == 0:
        return []
    p0 = float(p0)
    width = band(p0, ref.scored_rows)
    got = ref.reach[0]
    if got >= p0 - width:
        return []
    trained_length, known = expected_accept_length(training, ref.steps)
    predicted_length = 1.0 + sum(ref.reach[:known])
    measured = {"training_full_acc_0": p0, "predicted_step1": got, "band": width, "scored_rows": ref.scored_rows,
                "training_accept_length": trained_length, "predicted_accept_length": predicted_length,
                "steps_compared": known, "cost_accept_length": trained_length - predicted_length}
    continuation, rows = acc.continuation, acc.rows
    changed = _changed_after_training(checkpoint, training_run)
    explanations = [
        # Most specific first: a map out of step is also a changed checkpoint, and says more.
        _states_not_trained_layers(findings, capture_measured),
        _tokens_not_greedy(states, continuation),
        _vocab_map_out_of_step(reference_chain, checkpoint, continuation, rows),
        changed,
        Explanation("states_differ_from_training_data", None,
                    "not tested: the training data's states were not given, so their per-layer statistics "
                    "cannot be set against these", {}),
    ]
    measured["explanations"] = [e.as_dict() for e in explanations]
    restorable = changed.numbers.get("restorable") if changed.supported else None
    if restorable:
        # Whatever the most specific explanation, putting the changed tensors back as the run
        # saved them undoes the change alone: drafting again on that copy costs it.
        measured["undo"] = {"repair": "restored_from_training_run", "args": {"tensors": restorable}}
    supported = [e for e in explanations if e.supported]
    cause = supported[0].cause if supported else "acceptance_below_training"
    why = (f"; the numbers support: {supported[0].evidence}" if supported else
           "; none of the explanations tested here is supported by the numbers")
    message = (f"{ref.engine} predicts step-1 acceptance {got:.3f} on {ref.scored_rows} rows against training's "
               f"held-out full_acc_0 {p0:.3f} (band ±{width:.3f}): this checkpoint, on these states, no longer "
               f"does what was trained (accept length {predicted_length:.2f} vs training's {trained_length:.2f})"
               + why)
    return [Finding(CHECK, cause, Severity.ERROR, message, measured)]


def _states_not_trained_layers(findings, capture_measured: bool) -> Explanation:
    """The target-capture audit measures which layer each of the states' chunks is; chunks that
    are not the layers the states record were not what training saw."""
    if not capture_measured:
        return Explanation("states_not_from_this_config", None, "not tested: the target capture was not measured", {})
    named = [f for f in findings if f.check == "target_capture" and f.cause in STATES_CAUSES]
    if not named:
        return Explanation("states_not_from_this_config", False,
                           "the states' chunks measure as the layers they are recorded as", {})
    best = min(named, key=lambda f: STATES_CAUSES.index(f.cause))
    return Explanation(best.cause, True, f"the states are not the layers the draft was trained on: {best.message}",
                       best.measured)


def _tokens_not_greedy(states, continuation) -> Explanation:
    from difftest.acceptance import greedy_share_on_responses

    share, n = greedy_share_on_responses(states, continuation)
    supported = n > 0 and share < RECORDED_GREEDY_MIN
    return Explanation("states_not_target_greedy", supported,
                       f"{share:.1%} of the {n} response rows' recorded next tokens are the target's own greedy token"
                       + (" (training data is the target's greedy output)" if supported else ""),
                       {"recorded_matches_greedy_on_responses": share, "response_rows": n})


def _changed_after_training(checkpoint, training_run: Path | None) -> Explanation:
    if training_run is None:
        return Explanation("checkpoint_changed_after_training", None,
                           "not tested: no training run given (--training-run DIR, speculators' output directory)", {})
    changed, compared, restorable = _changed_tensors(checkpoint, Path(training_run))
    return Explanation("checkpoint_changed_after_training", bool(changed),
                       (f"{len(changed)} of the checkpoint's tensors differ from the training run's saved checkpoint: "
                        + ", ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")) if changed else
                       f"all {compared} tensors equal the training run's saved checkpoint",
                       {"changed": changed, "compared": compared, "training_run": str(training_run),
                        "restorable": restorable})


def _vocab_map_out_of_step(chain, checkpoint, continuation, rows: torch.Tensor) -> Explanation:
    """Do the draft's step-1 predictions, mapped through d2t, land on tokens the target
    emits here? A map regenerated after training, or head rows out of step with it, sends
    them to tokens about as often as a uniform draw over the draft vocab would."""
    idx = rows.nonzero().flatten()
    if not checkpoint.has("d2t") or idx.numel() == 0:
        return Explanation("vocab_map_out_of_step", None, "not tested: no d2t, or no scored rows", {})
    emitted = torch.unique(continuation.next_token[idx])
    predicted = chain.target_tokens[idx, 0]
    landing = float(torch.isin(predicted, emitted).float().mean())
    d2t = checkpoint.get("d2t").to(torch.int64)
    reachable = torch.arange(d2t.numel()) + d2t
    chance = float(torch.isin(reachable, emitted).float().mean())
    ratio = landing / chance if chance > 0 else float("inf")
    supported = ratio < LANDING_OVER_CHANCE
    return Explanation("vocab_map_out_of_step", supported,
                       f"{landing:.1%} of the draft's predictions, mapped through d2t, are tokens the target emits on "
                       f"these rows, against {chance:.1%} for a uniform draw over the draft vocab ({ratio:.1f}x)"
                       + ("; the map and the head disagree on what the ids mean" if supported else ""),
                       {"landing": landing, "chance": chance, "landing_over_chance": ratio,
                        "emitted_tokens": int(emitted.numel())})
