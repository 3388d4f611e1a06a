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
    if served == trained:
        return out
    if len(served) == len(trained) and sorted(served) == sorted(trained):
        return out + [Finding(CHECK, "aux_layers_wrong_order", Severity.ERROR,
                              f"{serving.engine} concatenates hidden_states{served}, the draft was trained on "
                              f"hidden_states{trained}: same layers, different order", measured)]
    if len(served) == len(trained):
        shift = {s - t for s, t in zip(served, sorted(trained))}
        if len(shift) == 1 and abs(next(iter(shift))) == 1:
            d = next(iter(shift))
            return out + [Finding(CHECK, "aux_layers_off_by_one", Severity.ERROR,
                                  f"{serving.engine} would capture hidden_states{served}, the draft was trained on "
                                  f"hidden_states{trained}: every layer {d:+d}", measured | {"shift": d})]
    return out + [Finding(CHECK, "aux_layers_mismatch", Severity.ERROR,
                          f"{serving.engine} would capture hidden_states{served}, the draft was trained on "
                          f"hidden_states{trained}", measured)]
