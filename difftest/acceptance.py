"""Predicted acceptance: each engine's chained drafts scored against the target's greedy continuation.

Greedy verification of a chain accepts draft step j only if steps 1..j all equal the
target's own next tokens, and then emits one bonus token, so a verify round's accept
length is 1 + the accepted steps (SGLang's accept length counts the same way). Its
expectation over rows is 1 + sum_j P(steps 1..j all accepted): the predicted mean accept
length. speculators' training metric full_acc_j is the same cumulative rate at TTT step
j, which is why it is printed next to it.

Only rows where the prediction is about a response token and the recorded continuation is
the target's own greedy one are scored: there teacher forcing (speculators) and feeding back
the draft's own tokens (SGLang) see the same inputs on the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from difftest.engines.base import ChainRun
from difftest.states import CapturedStates
from difftest.target import TargetWeights

UNKNOWN = -1
# Two engines computing the same draft agree on every accepted path; what is left is
# rounding flipping a near-tie argmax. More than this gap in mean accept length is a finding.
ACCEPT_LENGTH_TOLERANCE = 0.05


@dataclass
class TargetContinuation:
    next_token: torch.Tensor  # [T]: the target's greedy token after row t's token, or UNKNOWN
    source: str
    recorded_matches: float  # share of known rows whose recorded next token is the target's greedy one
    # True: next_token is the recorded sequence itself, so a request's last row has no reference.
    from_recording: bool = False


@torch.no_grad()
def target_continuation(states: CapturedStates, target: TargetWeights) -> TargetContinuation:
    """From the verifier states when present (the target's own head over its pre-norm last
    state, through transformers' Llama norm), else the recorded sequence (a temperature-0
    server response is the target's greedy output)."""
    T = states.num_tokens
    nxt = torch.full((T,), UNKNOWN, dtype=torch.int64)
    ends = torch.cumsum(states.seq_lens, 0)
    has_next = torch.ones(T, dtype=torch.bool)
    has_next[ends - 1] = False
    recorded = torch.full((T,), UNKNOWN, dtype=torch.int64)
    recorded[has_next] = states.input_ids[1:][has_next[:-1]]
    if states.verifier_last_hidden_states is not None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm = LlamaRMSNorm(target.hidden_size, eps=float(target.config.get("rms_norm_eps", 1e-6)))
        norm.weight.data.copy_(target.norm.float())
        nxt = greedy_tokens(norm(states.verifier_last_hidden_states.float()), target.lm_head)
        source = "target head over the verifier states"
    else:
        nxt = recorded.clone()
        source = "recorded sequence (no verifier states: taken as the target's temperature-0 output)"
    known = (recorded != UNKNOWN) & (nxt != UNKNOWN)
    matches = float((recorded[known] == nxt[known]).float().mean()) if known.any() else 0.0
    return TargetContinuation(nxt, source, matches, states.verifier_last_hidden_states is None)


@torch.no_grad()
def greedy_tokens(hidden: torch.Tensor, head: torch.Tensor, rows_per_block: int = 8192) -> torch.Tensor:
    """argmax(hidden @ head.T) in fp32, the head converted one block of vocab rows at a time:
    a real target head in fp32 is 2 GiB (Llama-3.1-8B) to 4.7 GiB (Kimi-K2.5) more to hold."""
    best = torch.full((hidden.shape[0],), -float("inf"))
    arg = torch.zeros(hidden.shape[0], dtype=torch.int64)
    for start in range(0, head.shape[0], rows_per_block):
        logits = hidden @ head[start:start + rows_per_block].float().T
        value, index = logits.max(dim=-1)
        better = value > best  # strict: ties keep the lower id, as one argmax over the whole vocab does
        best = torch.where(better, value, best)
        arg = torch.where(better, index + start, arg)
    return arg


def greedy_share_on_responses(states: CapturedStates, cont: TargetContinuation) -> tuple[float, int]:
    """Share of response rows whose recorded next token is the target's greedy one (prompt
    rows are the user's text, never the target's), and how many rows that is."""
    T = states.num_tokens
    ends = torch.cumsum(states.seq_lens, 0)
    has_next = torch.ones(T, dtype=torch.bool)
    has_next[ends - 1] = False
    rows = has_next.clone()
    if states.loss_mask is not None:
        rows[:-1] &= states.loss_mask[1:].bool()
    rows &= cont.next_token != UNKNOWN
    if cont.from_recording or not rows.any():
        return 1.0, int(rows.sum())  # the recording is the reference itself
    idx = rows.nonzero().flatten()
    return float((states.input_ids[idx + 1] == cont.next_token[idx]).float().mean()), int(idx.numel())


def scored_rows(states: CapturedStates, cont: TargetContinuation, steps: int) -> torch.Tensor:
    """Rows whose k-step chain is fully checkable: the target's next tokens at rows t..t+k-1
    are known, the recorded tokens t+1..t+k-1 are those greedy tokens, and the first
    predicted token is a response token."""
    T = states.num_tokens
    ok = torch.zeros(T, dtype=torch.bool)
    nxt, ids = cont.next_token, states.input_ids
    mask = states.loss_mask.bool() if states.loss_mask is not None else torch.ones(T, dtype=torch.bool)
    start = 0
    for n in states.seq_lens.tolist():
        for t in range(start, start + n - steps + 1):
            if t + steps > start + n - 1 and cont.from_recording:
                continue
            window = nxt[t:t + steps]
            if (window == UNKNOWN).any() or not bool(mask[t + 1] if t + 1 < start + n else False):
                continue
            if steps > 1 and not torch.equal(ids[t + 1:t + steps], nxt[t:t + steps - 1]):
                continue
            ok[t] = True
        start += n
    return ok


@dataclass
class AcceptanceFigures:
    engine: str
    steps: int
    scored_rows: int
    # P(steps 1..j all accepted), j = 1..k: the chain's reach.
    reach: list[float]
    # P(step j accepted | steps < j accepted): per-position acceptance.
    conditional: list[float]
    mean_accept_length: float
    accepted_lengths: torch.Tensor = field(repr=False, default=None)  # [rows] per scored row

    def as_dict(self) -> dict:
        return {"engine": self.engine, "steps": self.steps, "scored_rows": self.scored_rows,
                "reach": self.reach, "conditional": self.conditional,
                "mean_accept_length": self.mean_accept_length}


def acceptance(chain: ChainRun, cont: TargetContinuation, rows: torch.Tensor) -> AcceptanceFigures:
    k = chain.target_tokens.shape[1]
    idx = rows.nonzero().flatten()
    if idx.numel() == 0:
        return AcceptanceFigures(chain.engine, k, 0, [0.0] * k, [0.0] * k, 1.0, torch.zeros(0))
    want = torch.stack([cont.next_token[idx + j] for j in range(k)], dim=1)
    hit = chain.target_tokens[idx] == want
    through = hit.cumprod(dim=1).bool()
    reach = through.float().mean(0).tolist()
    conditional = [reach[0]] + [reach[j] / reach[j - 1] if reach[j - 1] > 0 else 0.0 for j in range(1, k)]
    lengths = 1 + through.sum(dim=1)
    return AcceptanceFigures(chain.engine, k, int(idx.numel()), reach, conditional, float(lengths.float().mean()), lengths)


@dataclass
class AcceptanceComparison:
    reference: AcceptanceFigures
    candidate: AcceptanceFigures
    tolerance: float
    same_length_rows: float  # share of scored rows where both engines accept the same number of steps
    continuation_source: str
    recorded_matches: float
    training: dict | None  # speculators' held-out full_acc_j, when known
    continuation: TargetContinuation | None = field(default=None, repr=False)
    rows: torch.Tensor | None = field(default=None, repr=False)  # the scored rows

    @property
    def gap(self) -> float:
        return self.candidate.mean_accept_length - self.reference.mean_accept_length

    @property
    def agree(self) -> bool:
        return abs(self.gap) <= self.tolerance

    def as_dict(self) -> dict:
        return {"reference": self.reference.as_dict(), "candidate": self.candidate.as_dict(),
                "tolerance_accept_length": self.tolerance, "accept_length_gap": self.gap, "agree": self.agree,
                "same_length_rows": self.same_length_rows, "continuation_source": self.continuation_source,
                "recorded_matches_greedy": self.recorded_matches, "training": self.training}


def compare_acceptance(ref: ChainRun, cand: ChainRun, states: CapturedStates, target: TargetWeights,
                       training: dict | None = None, tolerance: float = ACCEPT_LENGTH_TOLERANCE) -> AcceptanceComparison:
    cont = target_continuation(states, target)
    rows = scored_rows(states, cont, ref.target_tokens.shape[1])
    a, b = acceptance(ref, cont, rows), acceptance(cand, cont, rows)
    same = float((a.accepted_lengths == b.accepted_lengths).float().mean()) if a.scored_rows else 1.0
    return AcceptanceComparison(a, b, tolerance, same, cont.source, cont.recorded_matches, training, cont, rows)


def explain(acc: AcceptanceComparison, diagnosis) -> list[str]:
    """Why the numbers differ, each gap tied to what the probes and the audit found."""
    ref, cand = acc.reference, acc.candidate
    n = ref.scored_rows
    lines = []
    if n == 0:
        return ["No row could be scored: no response rows whose recorded continuation is the target's greedy one."]
    if acc.agree:
        lines.append(f"{cand.engine} and {ref.engine} predict the same acceptance: mean accept length "
                     f"{cand.mean_accept_length:.3f} vs {ref.mean_accept_length:.3f} (gap {acc.gap:+.3f}, tolerance "
                     f"±{acc.tolerance}); {acc.same_length_rows:.1%} of rows accept exactly as many steps in both.")
        head = (getattr(diagnosis, "ranked", None) or [{}])[0]
        if head.get("cost_accept_length") is not None and head["cost_accept_length"] > acc.tolerance:
            # What both engines load alike costs acceptance all the same; only training's
            # metric, or undoing it, can show that.
            lines.append(f"Both engines carry {head['cause']} ({head['found_at']}) alike, so comparing them cannot show "
                         f"its cost: {head['cost_accept_length']:+.3f} accept length, {head['how']}.")
        serving = _serving_cause(diagnosis, skip=head.get("cause"))
        if serving is not None:
            lines.append(f"The divergence found between the engines ({serving}) changes some draft tokens, but not "
                         f"enough of the accepted ones to move acceptance beyond the tolerance: it costs nothing measurable.")
    else:
        lines.append(f"{cand.engine} predicts mean accept length {cand.mean_accept_length:.3f} against "
                     f"{ref.engine}'s {ref.mean_accept_length:.3f} (gap {acc.gap:+.3f}, tolerance ±{acc.tolerance}).")
        serving = _serving_cause(diagnosis)
        if serving is not None:
            lines.append(f"The gap is the serving draft computing something else: {serving}.")
        else:
            lines.append("No probe or audit finding explains it; near-tie argmax flips compound along the chain.")
    if acc.training:
        p0 = acc.training.get("full_acc_0")
        if p0 is not None:
            se = (p0 * (1 - p0) / n) ** 0.5
            lines.append(f"Training step-0 accuracy {p0:.3f} (speculators' full_acc_0 on its held-out split) is the "
                         f"first-step acceptance {ref.engine} should reproduce: here {ref.reach[0]:.3f} on {n} rows "
                         f"(±{2 * se:.3f} at 2σ for this many rows); {cand.engine}: {cand.reach[0]:.3f}.")
            if ref.reach[0] > p0 + 2 * se + 0.02:
                lines.append("The prediction lies above that band: these rows are easier than the held-out split.")
            elif ref.reach[0] < p0 - 2 * se - 0.02:
                lines.append("The prediction lies below that band: see the acceptance_below_training finding, which "
                             "tests each explanation with numbers.")
    return lines


def _serving_cause(diagnosis, skip: str | None = None) -> str | None:
    """The serving-side cause in a diagnosis (the headline, or a lower-ranked one), with its probe."""
    if diagnosis is None:
        return None
    for entry in getattr(diagnosis, "ranked", None) or [{"cause": diagnosis.cause, "found_at": diagnosis.found_at,
                                                          "side": "serving"}]:
        if entry.get("side") == "serving" and entry["cause"] != skip:
            return f"{entry['cause']}, at {entry['found_at']}"
    return None
