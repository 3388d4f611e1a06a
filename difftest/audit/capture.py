"""Target capture check: do the aux layers a server would feed match the ones trained on?

Both sides come as CapturePlans in HF's convention, so nothing here knows either
engine's own numbering. The training side is the states file's recorded ids (what the
data really is), cross-checked against what speculators resolves from the draft config.
"""

from __future__ import annotations

from difftest.audit.findings import Finding, Severity
from difftest.engines.base import CapturePlan
from difftest.states import CapturedStates

CHECK = "capture"


def check_capture(serving: CapturePlan, training: CapturePlan, states: CapturedStates) -> list[Finding]:
    trained = list(states.aux_layer_ids)
    out: list[Finding] = []
    if training.hf_layer_ids is not None and list(training.hf_layer_ids) != trained:
        out.append(Finding(CHECK, "states_not_from_this_config", Severity.ERROR,
                           f"the states were captured at hidden_states{trained}, but speculators resolves this draft's "
                           f"config to hidden_states{training.hf_layer_ids}",
                           {"states": trained, "speculators": training.hf_layer_ids}))
    served = serving.hf_layer_ids
    measured = {"trained_hf_ids": trained, "served_hf_ids": served, "configured_ids": serving.configured_ids,
                "target_class": serving.target_class}
    if not serving.supports_aux_capture:
        return out + [Finding(CHECK, "aux_capture_unsupported", Severity.ERROR,
                              f"{serving.target_class} cannot capture EAGLE-3 aux hidden states "
                              "(no set_eagle3_layers_to_capture): the draft gets one layer and fc is skipped", measured)]
    if served is None:
        return out + [Finding(CHECK, "aux_capture_off", Severity.ERROR,
                              f"{serving.engine} would capture no aux layers ({serving.steps[-1]}): the draft gets the "
                              "target's single last state and fc is skipped", measured)]
    found = classify_layers(serving.engine, served, trained, measured, "would capture")
    return out + ([found] if found else [])


def classify_layers(engine: str, served: list[int], trained: list[int], measured: dict, verb: str,
                    check: str = CHECK) -> Finding | None:
    """Name how the served layers differ from the trained ones (None: they don't)."""
    if served == trained:
        return None
    if len(served) == len(trained) and sorted(served) == sorted(trained):
        return Finding(check, "aux_layers_wrong_order", Severity.ERROR,
                       f"{engine} concatenates hidden_states{served}, the draft was trained on "
                       f"hidden_states{trained}: same layers, different order", measured)
    if len(served) == len(trained):
        shift = {s - t for s, t in zip(served, sorted(trained))}
        if len(shift) == 1 and abs(next(iter(shift))) == 1:
            d = next(iter(shift))
            return Finding(check, "aux_layers_off_by_one", Severity.ERROR,
                           f"{engine} {verb} hidden_states{served}, the draft was trained on "
                           f"hidden_states{trained}: every layer {d:+d}", measured | {"shift": d})
    return Finding(check, "aux_layers_mismatch", Severity.ERROR,
                   f"{engine} {verb} hidden_states{served}, the draft was trained on hidden_states{trained}", measured)
