"""Load-ledger findings: tensors the serving engine dropped, parameters it left at init."""

from __future__ import annotations

from difftest.audit.findings import Finding, Severity
from difftest.engines.base import EngineRun, ParamFate, TensorFate

CHECK = "ledger"


def _is_head(name: str) -> bool:
    return name.endswith("lm_head.weight")


def _is_embed(name: str) -> bool:
    return name.endswith("embed_tokens.weight")


def check_ledgers(reference: EngineRun, candidate: EngineRun) -> list[Finding]:
    out: list[Finding] = []
    cand, ref = candidate.ledger, reference.ledger
    dropped, ref_dropped = cand.names(TensorFate.DROPPED), ref.names(TensorFate.DROPPED)
    # A tensor neither engine has a parameter for, while every parameter of both was written or
    # shared, fed nothing: an optimizer state or a stray buffer is information, not a divergence.
    unused = sorted(set(dropped) & set(ref_dropped))
    if unused and not cand.names(ParamFate.INIT) and not ref.names(ParamFate.INIT):
        out.append(Finding(CHECK, "tensor_unused_by_both", Severity.INFO,
                           f"{len(unused)} checkpoint tensor(s) that neither engine has a parameter for, while every "
                           f"parameter of both was loaded: {unused[:6]}; they take no part in the draft",
                           {"unused": unused}))
        dropped = [n for n in dropped if n not in unused]
        ref_dropped = [n for n in ref_dropped if n not in unused]
    token_map = cand.token_map_writers
    if token_map and token_map != ["d2t"]:
        final = token_map[-1]
        out.append(Finding(CHECK, "token_map_from_other_tensor", Severity.ERROR,
                           f"{candidate.engine}'s load_weights turns every name containing 'd2t' into its token map: "
                           f"{token_map} all wrote hot_token_id, and {final} (the last) is the map it serves with",
                           {"writers": token_map, "served_map": final}))
    if dropped:
        out.append(Finding(CHECK, "keys_dropped", Severity.ERROR,
                           f"{candidate.engine} silently dropped {len(dropped)} checkpoint tensors: {dropped[:6]}",
                           {"dropped": dropped}))
    at_init = cand.names(ParamFate.INIT)
    head_init = [n for n in at_init if _is_head(n)]
    if head_init:
        ref_head = [n for n, (f, _) in ref.params.items() if _is_head(n) and not n.startswith("verifier_")]
        ref_fate = ref.params[ref_head[0]][0] if ref_head else None
        # Putting the trained head back into a copy undoes this cause alone (difftest/repairs.py),
        # measured in the engine that lost it: the serving one, or the reference too when
        # neither found a head (training's metric then shows the loss).
        undo = {"undo": {"repair": "lm_head_restored",
                         "engine": "reference" if ref_fate is ParamFate.INIT else "candidate"}}
        out.append(Finding(CHECK, "lm_head_missing", Severity.ERROR,
                           f"{candidate.engine} left {head_init[0]} at random init (no lm_head in the checkpoint); "
                           f"{reference.engine}'s lm_head is {ref_fate.value if ref_fate else '?'}", undo))
    embed_init = [n for n in at_init if _is_embed(n)]
    if embed_init:
        out.append(Finding(CHECK, "embedding_not_shared", Severity.ERROR,
                           f"{candidate.engine} left {embed_init[0]} at init: the target's embedding was never shared"))
    others = [n for n in at_init if not _is_head(n) and not _is_embed(n)]
    if others:
        out.append(Finding(CHECK, "param_left_at_init", Severity.ERROR,
                           f"{candidate.engine} parameters left at init: {others[:6]}", {"params": others}))
    shared_head = [n for n in cand.names(ParamFate.SHARED) if _is_head(n)]
    if shared_head:
        out.append(Finding(CHECK, "lm_head_from_target", Severity.ERROR,
                           f"{candidate.engine} replaced its lm_head with the target's full-vocab head "
                           f"({candidate.details.get('lm_head_path', 'set_embed_and_head')})"))
    if ref_dropped:
        out.append(Finding(CHECK, "keys_dropped", Severity.ERROR,
                           f"{reference.engine} has no parameter for {ref_dropped[:6]}", {"dropped": ref_dropped}))
    return out


def check_shipped_embedding(checkpoint, target, reference: EngineRun, candidate: EngineRun) -> list[Finding]:
    """A draft that ships an embedding of its own (not the target's, even after rounding):
    an engine that shares the target's in its place computes from other inputs than one that
    uses the shipped tensor, and neither says so."""
    import torch

    from difftest.convert import speculators_name

    name = next((n for n in checkpoint.tensor_names() if speculators_name(n) == "embed_tokens.weight"), None)
    if name is None:
        return []
    shipped = checkpoint.get(name)
    own = target.embed
    if shipped.shape != own.shape:
        return []
    low = shipped.dtype if shipped.element_size() <= own.element_size() else own.dtype
    if torch.equal(shipped.to(low), own.to(low)):
        return []  # the target's embedding, at some precision: embedding_precision covers it
    fates = {}
    for run in (reference, candidate):
        embeds = [f for n, (f, _) in run.ledger.params.items() if _is_embed(n) and not n.startswith("verifier_")]
        fates[run.engine] = embeds[0] if embeds else None
    if len({f for f in fates.values()}) < 2:
        return []
    uses = ", ".join(f"{engine} {'the target embedding (shared)' if f is ParamFate.SHARED else 'the shipped one'}"
                     for engine, f in fates.items())
    diff = float((shipped.float() - own.float()).abs().max())
    return [Finding(CHECK, "shipped_embedding_replaced", Severity.ERROR,
                    f"the checkpoint ships its own embed_tokens ({name}, max |diff| {diff:.3g} from the target's): {uses}",
                    {"max_abs_diff_from_target": diff, "fates": {k: v.value if v else None for k, v in fates.items()}})]


def check_unread_files(checkpoint) -> list[Finding]:
    """Weight files in the directory that no engine reads: shown, never treated as input."""
    if not checkpoint.ignored_files:
        return []
    from difftest.checkpoint import INDEX_FILE, SINGLE_FILE

    why = f"not named by {INDEX_FILE}" if (checkpoint.path / INDEX_FILE).is_file() else f"beside {SINGLE_FILE}, with no index"
    return [Finding("ledger", "weight_file_not_read", Severity.INFO,
                    f"{', '.join(checkpoint.ignored_files)}: {why}; neither engine reads it, so it is not part of this run",
                    {"files": list(checkpoint.ignored_files)})]


def check_duplicate_copies(checkpoint) -> list[Finding]:
    """One parameter stored twice, under both formats' names (`midlayer.x` and `layers.0.x`): each
    engine maps both onto the same parameter, and which copy wins depends on the key order."""
    import torch

    from difftest.convert import speculators_name

    groups: dict[str, list[str]] = {}
    for name in checkpoint.tensor_names():
        groups.setdefault(speculators_name(name), []).append(name)
    twice = {k: v for k, v in groups.items() if len(v) > 1}
    if not twice:
        return []
    differ = [k for k, names in twice.items() if not all(torch.equal(checkpoint.get(names[0]), checkpoint.get(n)) for n in names[1:])]
    pairs = [" and ".join(twice[k]) for k in (differ or list(twice))][:4]
    if differ:
        return [Finding(CHECK, "duplicate_tensor_copies", Severity.ERROR,
                        f"{len(twice)} parameter(s) stored under both formats' names, {len(differ)} with different "
                        f"values ({'; '.join(pairs)}): which copy an engine loads depends on the key order",
                        {"differ": differ, "duplicated": sorted(twice)})]
    return [Finding(CHECK, "duplicate_tensor_copies", Severity.INFO,
                    f"{len(twice)} parameter(s) stored under both formats' names with equal values ({'; '.join(pairs)}); "
                    "harmless here, but which copy an engine loads depends on the key order: keep one",
                    {"duplicated": sorted(twice)})]
