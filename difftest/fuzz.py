"""Hypothesis fuzzing of draft configs and vocab mappings through both real engines.

A case is a small JSON-able dict: the draft's layer shape and flags, the target's width
and vocab, the vocab mapping's shape, the packed batch and the dtype. `build_case` turns
it into a real speculators checkpoint (built by Eagle3DraftModel itself, random weights
drawn from the case's seed), a real HF target directory and a states file; the pipeline
then runs both engines on it. The property: the engines agree, or the harness explains
why (an audit finding, or a known upstream divergence). A case that breaks it is shrunk
by Hypothesis (`find`) and kept in fixtures/regressions/ as a replayable JSON file.

Draws stay away from numeric discontinuities: weights have a wide spread so argmax
margins are clear, norms stay near 1, rope thetas are ordinary, eps is not tiny.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from hypothesis import strategies as st

from difftest.known_divergences import KNOWN_UPSTREAM_DIVERGENCES

REGRESSIONS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "regressions"
TARGET_LAYERS = 6
# Causes the harness explains without a finding: differences it knows the origin of.
EXPLAINED_WITHOUT_FINDING = set(KNOWN_UPSTREAM_DIVERGENCES) | {"embedding_precision"}


# Head sizes drawn when the serving engine's CPU attention runs any (small ones are fast).
SMALL_HEAD_DIMS = (8, 16)


def head_dims_for(serving: str) -> tuple[int, ...]:
    """The two smallest head sizes the serving engine's CPU attention runs (its adapter says)."""
    from difftest.pipeline import candidate_adapter

    supported = getattr(candidate_adapter(serving), "cpu_head_dims", None)
    return tuple(supported[:2]) if supported else SMALL_HEAD_DIMS


AUX_COUNTS = (1, 2, 3, 4)


def aux_counts_for(serving: str) -> tuple[int, ...]:
    """Aux-layer counts to draw from. An engine that loads only some counts (its adapter's
    `served_aux_counts`: a known divergence, already a regression) gets those three times as
    often, so most draws reach its forward and can find a silent divergence; the others stay
    in, so the refusal itself is still drawn."""
    from difftest.pipeline import candidate_adapter

    served = getattr(candidate_adapter(serving), "served_aux_counts", None)
    return AUX_COUNTS if not served else tuple(served) * 3 + tuple(c for c in AUX_COUNTS if c not in served)


@st.composite
def cases(draw, serving: str = "sglang", head_dims: tuple[int, ...] = SMALL_HEAD_DIMS,
          aux_counts: tuple[int, ...] = AUX_COUNTS) -> dict:
    heads = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    head_dim = draw(st.sampled_from(list(head_dims)))
    hidden = draw(st.sampled_from([32, 64]))
    vocab = draw(st.sampled_from([128, 256]))
    num_aux = draw(st.integers(1, 4) if aux_counts == AUX_COUNTS else st.sampled_from(list(aux_counts)))
    aux_ids = sorted(draw(st.sets(st.integers(0, TARGET_LAYERS), min_size=num_aux, max_size=num_aux)))
    norm_before_fc = draw(st.booleans())
    return {
        "seed": draw(st.integers(0, 2**16)),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": draw(st.sampled_from([64, 96, 128])),
        "num_layers": draw(st.sampled_from([1, 1, 1, 2])),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
        "rope_scaling": draw(st.sampled_from([None, None, {"rope_type": "linear", "factor": 2.0},
                                              {"rope_type": "dynamic", "factor": 2.0}])),
        "norm_before_residual": draw(st.booleans()),
        "norm_before_fc": norm_before_fc,
        "fc_norm": False if norm_before_fc else draw(st.booleans()),
        "norm_output": draw(st.booleans()),
        "tie_word_embeddings": draw(st.booleans()),
        "aux_layer_ids": aux_ids,
        "target_hidden_size": draw(st.sampled_from([hidden, hidden, 2 * hidden])),
        "target_vocab_size": vocab,
        "draft_vocab": draw(st.sampled_from(["full", "tiny", "half"])),
        "mapping": draw(st.sampled_from(["spread", "low", "high"])),
        "seq_lens": draw(st.lists(st.integers(1, 24), min_size=1, max_size=3)),
        "dtype": draw(st.sampled_from(["fp32", "bf16"])),
        "serving": serving,
    }


def _draft_vocab_size(case: dict) -> int:
    V = case["target_vocab_size"]
    return {"full": V, "tiny": 8, "half": V // 2}[case["draft_vocab"]]


def _mapping(case: dict, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    V, N = case["target_vocab_size"], _draft_vocab_size(case)
    if case["mapping"] == "low" or N == V:
        ids = torch.arange(N)
    elif case["mapping"] == "high":
        ids = torch.arange(V - N, V)
    else:
        ids = torch.randperm(V, generator=gen)[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(N), t2d


def _spread(model: torch.nn.Module, gen: torch.Generator, std: float, skip: tuple[str, ...] = ()) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(skip):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def build_case(case: dict, root: Path) -> tuple[Path, Path, Path]:
    """Checkpoint dir, target dir and states file for one case, under root."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    from difftest.states import CapturedStates, save_states

    gen = torch.Generator().manual_seed(case["seed"])
    torch.manual_seed(case["seed"])
    Ht, V = case["target_hidden_size"], case["target_vocab_size"]
    target_dir = root / "target"
    target = LlamaForCausalLM(LlamaConfig(
        hidden_size=Ht, intermediate_size=2 * Ht, num_hidden_layers=TARGET_LAYERS, num_attention_heads=2,
        num_key_value_heads=2, head_dim=Ht // 2, vocab_size=V, max_position_embeddings=256, tie_word_embeddings=False))
    _spread(target, gen, 0.08)
    target.save_pretrained(target_dir, safe_serialization=True)

    layer = LlamaConfig(
        hidden_size=case["hidden_size"], intermediate_size=case["intermediate_size"], num_hidden_layers=case["num_layers"],
        num_attention_heads=case["num_attention_heads"], num_key_value_heads=case["num_key_value_heads"],
        head_dim=case["head_dim"], vocab_size=V, rms_norm_eps=case["rms_norm_eps"], max_position_embeddings=256,
        rope_theta=case["rope_theta"], tie_word_embeddings=case.get("tie_word_embeddings", False),
        rope_scaling=dict(case["rope_scaling"]) if case["rope_scaling"] else None)
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=_draft_vocab_size(case),
        norm_before_residual=case["norm_before_residual"], norm_before_fc=case["norm_before_fc"], fc_norm=case["fc_norm"],
        norm_output=case.get("norm_output", False),
        target_hidden_size=None if Ht == case["hidden_size"] else Ht,
        eagle_aux_hidden_state_layer_ids=list(case["aux_layer_ids"]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=1)],
            verifier=VerifierConfig.from_pretrained(str(target_dir))),
    )
    draft = Eagle3DraftModel(config=config)
    d2t, t2d = _mapping(case, gen)
    draft.load_vocab_mappings(t2d, d2t)
    _spread(draft, gen, 0.15, skip=("verifier_", "embed_tokens"))
    if Ht == case["hidden_size"]:
        draft.load_verifier_weights()
    else:
        # No verifier embedding fits a narrower draft: the draft ships its own.
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(0.5 * torch.randn(draft.embed_tokens.weight.shape, generator=gen))
    ckpt_dir = root / "draft"
    draft.save_pretrained(ckpt_dir, safe_serialization=True)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(target_dir)
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))

    T = sum(case["seq_lens"])
    states = CapturedStates(
        input_ids=torch.randint(0, V, (T,), generator=gen),
        seq_lens=torch.tensor(case["seq_lens"], dtype=torch.int64),
        aux_hidden_states=torch.randn(T, len(case["aux_layer_ids"]) * Ht, generator=gen),
        verifier_last_hidden_states=torch.randn(T, Ht, generator=gen),
        aux_layer_ids=tuple(case["aux_layer_ids"]),
    )
    states_file = root / "states.safetensors"
    save_states(states, states_file)
    return ckpt_dir, target_dir, states_file


@dataclass
class Outcome:
    case: dict
    verdict: str  # PARITY | DIVERGED | REFUSED (an engine raised: loud, not silent)
    cause: str | None = None
    first_divergence: str | None = None
    explained: bool = True
    detail: str = ""
    seconds: float = 0.0

    @property
    def signature(self) -> tuple:
        return (self.verdict, self.cause, self.first_divergence)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def run_case(case: dict) -> Outcome:
    from difftest import pipeline
    from difftest.errors import InputError
    from difftest.tolerances import DTYPES

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="difftest-fuzz-") as tmp:
        ckpt, target, states = build_case(case, Path(tmp))
        try:
            inputs = pipeline.prepare(ckpt, target, states)
            result = pipeline.run(inputs, dtype=DTYPES[case["dtype"]], measure_noise=False,
                                  candidate=pipeline.candidate_adapter(case.get("serving", "sglang")))
        except InputError as exc:
            return Outcome(case, "REFUSED", "input_error", None, True, str(exc)[:200], time.perf_counter() - t0)
        except Exception as exc:  # an engine refusing the config is loud, which is not the bug class hunted here
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            return Outcome(case, "REFUSED", "engine_raised", None, True, msg, time.perf_counter() - t0)
    diag = result.diagnosis
    if diag is None:
        return Outcome(case, "PARITY", seconds=time.perf_counter() - t0)
    explained = diag.cause != "unexplained_divergence" and bool(diag.evidence or diag.cause in EXPLAINED_WITHOUT_FINDING)
    # A serving engine that refused the draft computed no probe: the place is where the refusal was found.
    first = None if result.candidate.details.get("refused") else result.comparison.first_divergence
    return Outcome(case, "DIVERGED", diag.cause, first.probe if first else diag.found_at, explained,
                   "; ".join(diag.evidence)[:300], time.perf_counter() - t0)


@dataclass
class FuzzSummary:
    outcomes: list[Outcome] = field(default_factory=list)
    minimal: dict[tuple, Outcome] = field(default_factory=dict)  # signature -> shrunk case
    seconds: float = 0.0

    @property
    def signatures(self) -> dict[tuple, int]:
        out: dict[tuple, int] = {}
        for o in self.outcomes:
            out[o.signature] = out.get(o.signature, 0) + 1
        return out

    @property
    def unexplained(self) -> list[tuple]:
        return sorted({o.signature for o in self.outcomes if not o.explained}, key=str)

    @property
    def examples_per_minute(self) -> float:
        return 60 * len(self.outcomes) / self.seconds if self.seconds else 0.0


def strategy_for(serving: str = "sglang", dtype: str | None = None):
    drawn = cases(serving, head_dims_for(serving), aux_counts_for(serving))
    return drawn if dtype is None else drawn.map(lambda c: c | {"dtype": dtype})


def explore(examples: int, seed: int = 0, dtype: str | None = None,
            on_outcome: Callable[[Outcome], None] | None = None, serving: str = "sglang") -> FuzzSummary:
    """Run `examples` drawn cases through training and the serving engine (Hypothesis draws them)."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    summary = FuzzSummary()
    strategy = strategy_for(serving, dtype)
    t0 = time.perf_counter()

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def explore_one(case):
        outcome = run_case(case)
        summary.outcomes.append(outcome)
        if on_outcome:
            on_outcome(outcome)

    explore_one()
    summary.seconds = time.perf_counter() - t0
    return summary


def shrink(signature: tuple, budget: int = 60, seed: int = 0, dtype: str | None = None,
           serving: str = "sglang") -> Outcome | None:
    """The minimal case Hypothesis finds with this signature (None if it finds none in budget)."""
    from hypothesis import HealthCheck, find, seed as hseed, settings
    from hypothesis.errors import NoSuchExample

    strategy = strategy_for(serving, dtype)
    seen: dict[str, Outcome] = {}

    def has_signature(case) -> bool:
        outcome = run_case(case)
        seen[json.dumps(case, sort_keys=True)] = outcome
        return outcome.signature == signature

    try:
        case = find(strategy, has_signature, settings=settings(max_examples=budget, deadline=None, database=None,
                                                               suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return None
    return seen.get(json.dumps(case, sort_keys=True)) or run_case(case)


def regression_name(outcome: Outcome) -> str:
    serving = outcome.case.get("serving", "sglang")
    prefix = "" if serving == "sglang" else f"{serving}--"  # the catalog began with SGLang's
    return f"{prefix}{outcome.cause}--{outcome.first_divergence or 'audit'}".replace("/", "_").replace(":", "_")


def write_regression(outcome: Outcome, directory: Path = REGRESSIONS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{regression_name(outcome)}.json"
    doc = {"case": outcome.case, "expected": {"verdict": outcome.verdict, "cause": outcome.cause,
                                              "first_divergence": outcome.first_divergence},
           "explained": outcome.explained, "detail": outcome.detail,
           "known_upstream": KNOWN_UPSTREAM_DIVERGENCES.get(outcome.cause)}
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def load_regressions(directory: Path = REGRESSIONS_DIR) -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(directory.glob("*.json"))]
