"""`difftest selftest`: run the clean fixture and every fault through the real pipeline.

A fault scores only if it is caught at the declared place (localization is part of the
score) with the declared diagnosis. A clean run that does not come out PARITY is a false
alarm. The runner knows no engine: it edits scratch copies and calls pipeline.run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from difftest.faults import FAULTS, Fault, Workspace, scratch_dir
from difftest.states import CapturedStates, load_states
from difftest.tolerances import DTYPES

CLEAN = "clean"
CLEAN_DEPLOYED = "clean (served copy and launch command)"


@dataclass(frozen=True)
class SelftestFixture:
    name: str
    checkpoint: Path
    target: Path
    states: Path
    # Edits that make the clean baseline a draft both engines can compute identically;
    # each says why. Applied to the scratch copy before any fault.
    baseline: tuple[tuple[str, Callable[[Workspace], None]], ...] = ()
    training_metrics: dict | None = None  # the training run's held-out full_acc_j, when known
    training_run: Path | None = None
    # Chain steps drafted on every run, so each fault's cost in acceptance is measured against
    # the clean run (0: not measured; a random-weight draft has no acceptance to lose).
    chain_steps: int = 0
    training: str = "speculators"  # the training engine that wrote the checkpoint and runs it


@dataclass
class Outcome:
    fixture: str
    dtype: str
    fault: str
    expected_at: str
    expected_cause: str | None
    found_at: str
    found_cause: str | None
    seconds: float
    # Predicted mean accept length per engine side, when chains were drafted.
    accept_length: dict | None = None
    # Measured cost in mean accept length: against the clean run, per engine side (filled by
    # run_selftest), or for a fault made after training, against training's own metric.
    cost: dict | None = None
    # Causes the fault declares beside its headline that the report did not name.
    unnamed_also: tuple[str, ...] = ()
    # The headline cause's own cost, as the report gives it: {cost, method} (see diagnosis.Diagnosis.ranked).
    headline_cost: dict | None = None
    serving: str = "sglang"  # the serving engine training was compared with
    training: str = "speculators"  # the training engine
    applies: bool = True  # False: that engine's code has no path that produces the fault (why says so)
    why: str = ""

    @property
    def passed(self) -> bool:
        if self.fault in (CLEAN, CLEAN_DEPLOYED):
            return self.found_cause is None
        return (self.found_at == self.expected_at and self.found_cause == self.expected_cause
                and not self.unnamed_also)

    def as_dict(self) -> dict:
        return self.__dict__ | {"passed": self.passed}


@dataclass
class Score:
    outcomes: list[Outcome]

    @property
    def faults(self) -> list[Outcome]:
        """The fault runs that count: those the serving engine's code can produce."""
        return [o for o in self.outcomes if o.fault not in (CLEAN, CLEAN_DEPLOYED) and o.applies]

    def by_engine(self) -> dict[str, "Score"]:
        engines = dict.fromkeys(o.serving for o in self.outcomes)
        return {e: Score([o for o in self.outcomes if o.serving == e]) for e in engines}

    @property
    def caught(self) -> int:
        return sum(o.passed for o in self.faults)

    @property
    def false_alarms(self) -> int:
        return sum(not o.passed for o in self.outcomes if o.fault in (CLEAN, CLEAN_DEPLOYED))

    @property
    def mutation_score(self) -> float:
        return self.caught / len(self.faults) if self.faults else 0.0

    @property
    def ok(self) -> bool:
        return bool(self.faults) and self.caught == len(self.faults) and self.false_alarms == 0


def _embed_at_target_precision(ws: Workspace) -> None:
    """The checkpoint's embed_tokens is the frozen target embedding saved at lower precision;
    put the target's own back, so an fp32 run compares what training computed."""
    from difftest.target import load_target

    target = load_target(ws.target)

    def swap(t: dict) -> None:
        stored = t.get("embed_tokens.weight")
        if stored is None:
            return
        if not torch.equal(stored, target.embed.to(stored.dtype)):
            raise RuntimeError("embed_tokens is not the target's embedding rounded: cannot restore it")
        t["embed_tokens.weight"] = target.embed.clone()

    ws.edit_tensors(swap)
    # speculators loads at the config's dtype; left at bf16 it would round the restored copy again.
    ws.edit_config(lambda c: c.update(dtype="float32"))


def _norm_before_residual_off(ws: Workspace) -> None:
    """SGLang 0.5.23 has no norm_before_residual (difftest/known_divergences.py): with it on,
    every run diverges at layer0.post_attn_residual and would mask later faults."""
    ws.edit_config(lambda c: c.update(norm_before_residual=False))


def _aux_ids_vllm_reads_first(ws: Workspace) -> None:
    """vLLM 0.32.0 counts eagle_config's ids from a layer's input, SGLang and SpecForge from its
    output (the known aux_layers_off_by_one). A top-level eagle_aux_hidden_state_layer_ids, which
    vLLM reads first and the other two never read, names the trained layers in vLLM's numbering:
    without it every vLLM run of a SpecForge export shows that divergence and masks the fault."""
    ws.edit_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[
        i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]))


def fixtures(which: str, training: str = "speculators") -> list[SelftestFixture]:
    from difftest.fixturegen.default import TINY_DIR

    if training == "specforge":
        out = []
        vllm_numbering = (("aux ids in vLLM's numbering", _aux_ids_vllm_reads_first),)
        if which in ("tiny", "all"):
            out.append(SelftestFixture("tiny-specforge", TINY_DIR / "specforge", TINY_DIR / "target",
                                       TINY_DIR / "states.safetensors", training="specforge", baseline=vllm_numbering))
        if which in ("default", "all"):
            from difftest.fixturegen import specforge_smollm2

            sf = specforge_smollm2.build()
            out.append(SelftestFixture("smollm2-specforge", sf.draft, sf.fixture.target, sf.states, training="specforge",
                                       baseline=vllm_numbering, chain_steps=4))
        return out
    out = []
    if which in ("tiny", "all"):
        out.append(SelftestFixture("tiny", TINY_DIR / "speculators", TINY_DIR / "target", TINY_DIR / "states.safetensors"))
    if which in ("default", "all"):
        from difftest.fixturegen.default import default_fixture

        import json

        fx = default_fixture(progress=False)
        out.append(SelftestFixture("smollm2", fx.checkpoint, fx.target, fx.states, baseline=(
            ("norm_before_residual=false", _norm_before_residual_off),
            ("embed_tokens at the target's precision", _embed_at_target_precision),
        ), training_metrics=json.loads(fx.training.read_text()), training_run=fx.training_run, chain_steps=4))
    return out


def run_one(fx: SelftestFixture, states: CapturedStates, dtype_name: str, fault: Fault | None,
            deployed: bool = False, serving: str = "sglang") -> Outcome:
    """One run on a scratch copy, training against the `serving` engine. deployed: through
    --serve, on a served copy and its launch command (made as `difftest convert` makes them),
    which a deployment fault then edits."""
    from difftest import pipeline

    t0 = time.perf_counter()
    dtype = DTYPES[dtype_name]
    deployed = deployed or (fault is not None and fault.deployed)
    expected = fault.on_engine(serving, fx.training) if fault is not None else None
    if expected is not None and not expected.applies:
        return Outcome(fixture=fx.name, dtype=dtype_name, fault=fault.name, expected_at="-", expected_cause=None,
                       found_at="-", found_cause=None, seconds=0.0, serving=serving, training=fx.training,
                       applies=False, why=expected.why)
    with scratch_dir() as tmp:
        ws = Workspace.copy_of(fx.checkpoint, states, fx.target, Path(tmp), dtype)
        after_training = fault is not None and fault.after_training
        for _, edit in () if after_training else fx.baseline:
            edit(ws)
        if deployed:
            ws.deploy()
        if fault is not None:
            fault.inject(ws)
        inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
        # Every run is read against training's own metrics where the fixture has them: a fault must
        # headline its own cause over the shortfall it causes, and a clean run raise no shortfall.
        reads_training = fx.training_metrics and not (fault is not None and fault.rewrites_training)
        extra = dict(training_metrics=fx.training_metrics, training_run=fx.training_run) if reads_training else {}
        result = pipeline.run(inputs, dtype=dtype, serving=ws.deployment() if deployed else ws.serving,
                              measure_noise=False, chain_steps=fx.chain_steps or (4 if after_training else 0),
                              measure_target_capture=deployed, candidate=pipeline.candidate_adapter(serving),
                              reference=pipeline.reference_adapter(fx.training), **extra)
    diag = result.diagnosis
    found_at, found_cause = (diag.found_at, diag.cause) if diag else ("-", None)
    if fault is not None and fault.notice_only and diag is None:
        # Harmless to the computation: caught when the report says so and gives no false verdict.
        notice = next((f for f in result.findings if f.cause == fault.diagnosis), None)
        if notice is not None:
            found_at, found_cause = f"audit:{notice.check}", notice.cause
    accept = cost = None
    if result.acceptance is not None:
        accept = {"reference": result.acceptance.reference.mean_accept_length,
                  "serving": result.acceptance.candidate.mean_accept_length}
    if after_training and diag is not None and diag.ranked:
        cost = {"against": "training", "training": diag.ranked[0]["cost_accept_length"]}
    return Outcome(
        fixture=fx.name, dtype=dtype_name, fault=fault.name if fault else (CLEAN_DEPLOYED if deployed else CLEAN),
        expected_at=expected.caught_at if fault else "-", expected_cause=expected.diagnosis if fault else None,
        serving=serving, training=fx.training, why=expected.why if fault else "",
        found_at=found_at, found_cause=found_cause,
        seconds=time.perf_counter() - t0, accept_length=accept, cost=cost,
        unnamed_also=tuple(c for c in (fault.also if fault else ()) if diag is None or c not in diag.also),
        headline_cost={"cost": diag.ranked[0]["cost_accept_length"], "method": diag.ranked[0]["method"]}
        if diag is not None and diag.ranked else None,
    )


def run_selftest(which: str = "all", dtypes: Iterable[str] = ("fp32", "bf16"), only: Iterable[str] | None = None,
                 on_outcome: Callable[[Outcome], None] | None = None, max_tokens: int | None = None,
                 serving: Iterable[str] = ("sglang",), training: str = "speculators") -> Score:
    chosen = [f for f in FAULTS if only is None or f.name in set(only)]
    outcomes = []
    for fx in fixtures(which, training):
        states = load_states(fx.states)
        if max_tokens:
            states = states.head(max_tokens)
        for engine, dtype_name in ((e, d) for e in serving for d in dtypes):
            applicable = [f for f in chosen if dtype_name in f.dtypes and (fx.training_metrics or not f.after_training)]
            clean = None
            runs = [(None, False), *[(f, False) for f in applicable]]
            if any(f.deployed and f.on_engine(engine, fx.training).applies for f in applicable):
                runs.insert(1, (None, True))  # a correct served copy and command: no false alarm
            for fault, deployed in runs:
                outcome = run_one(fx, states, dtype_name, fault, deployed, serving=engine)
                if fault is None:
                    clean = outcome
                elif outcome.cost is None and outcome.accept_length and clean and clean.accept_length:
                    # With and without the fault, in each engine: what it costs there.
                    outcome.cost = {"against": "clean run", **{side: clean.accept_length[side] - outcome.accept_length[side]
                                                                for side in ("reference", "serving")}}
                outcomes.append(outcome)
                if on_outcome:
                    on_outcome(outcome)
    return Score(outcomes)


def render_table(score: Score):
    from rich.table import Table

    table = Table(title="difftest selftest")
    for col in ("serving", "fixture", "dtype", "fault", "expected place", "found place", "diagnosis", "cost", "result"):
        table.add_column(col, overflow="fold")
    for o in score.outcomes:
        diag = o.found_cause or "-"
        if o.fault not in (CLEAN, CLEAN_DEPLOYED) and o.found_cause != o.expected_cause:
            diag = f"{diag} (expected {o.expected_cause})"
        table.add_row(o.serving, o.fixture, o.dtype, o.fault, o.expected_at, o.found_at, diag, format_cost(o.cost),
                      result_label(o))
    return table


def result_label(o: Outcome) -> str:
    if not o.applies:
        return f"n/a: {o.why}"
    return "pass" if o.passed else "FAIL"


def score_line(score: Score) -> str:
    """Mutation score and false alarms, per serving engine when there are several."""
    def one(s: Score) -> str:
        clean = sum(o.fault in (CLEAN, CLEAN_DEPLOYED) for o in s.outcomes)
        return (f"mutation score {s.caught}/{len(s.faults)} ({s.mutation_score:.0%}), "
                f"false alarms {s.false_alarms}/{clean} clean runs")

    engines = score.by_engine()
    if len(engines) == 1:
        return one(score)
    return "; ".join(f"{engine}: {one(s)}" for engine, s in engines.items())


def format_cost(cost: dict | None) -> str:
    if not cost:
        return "-"
    if cost.get("against") == "training":
        c = cost.get("training")
        return "-" if c is None else f"{c:+.2f} vs training"
    return f"serving {cost['serving']:+.2f}, reference {cost['reference']:+.2f}"


def format_headline_cost(headline: dict | None) -> str:
    if not headline:
        return "-"
    cost = "not measured" if headline["cost"] is None else f"{headline['cost']:+.2f}"
    return f"{cost} ({headline['method'].replace('_', ' ')})"


def render_markdown(score: Score) -> str:
    trainers = ", ".join(dict.fromkeys(o.training for o in score.outcomes))
    lines = ["# difftest selftest", "", f"Trained with {trainers}; each serving engine compared with it.", "",
             f"{score_line(score)}.", "",
             "| serving | fixture | dtype | fault | expected place | found place | diagnosis | cost in accept length "
             "| the headline's own cost (how measured) | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in score.outcomes:
        result = result_label(o)
        lines.append(f"| {o.serving} | {o.fixture} | {o.dtype} | {o.fault} | {o.expected_at} | {o.found_at} | "
                     f"{o.found_cause or '-'} | {format_cost(o.cost)} | {format_headline_cost(o.headline_cost)} | "
                     f"{'**FAIL**' if result == 'FAIL' else result} |")
    return "\n".join(lines) + "\n"


def write_selftest(score: Score, out_dir: str | Path) -> dict[str, Path]:
    import json

    from difftest.report.build import atomic_write

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "selftest.json", "md": out / "selftest.md"}
    doc = {"mutation_score": score.mutation_score, "caught": score.caught, "faults": len(score.faults),
           "false_alarms": score.false_alarms, "ok": score.ok,
           "by_engine": {e: {"mutation_score": s.mutation_score, "caught": s.caught, "faults": len(s.faults),
                             "false_alarms": s.false_alarms, "ok": s.ok} for e, s in score.by_engine().items()},
           "catalog": [{"name": f.name, "bug_class": f.bug_class, "caught_at": f.caught_at, "diagnosis": f.diagnosis,
                        "dtypes": list(f.dtypes),
                        "on": {e: asdict(o) for e, o in f.on},
                        "by_training": {t: asdict(o) for t, o in f.by_training}} for f in FAULTS],
           "outcomes": [o.as_dict() for o in score.outcomes]}
    atomic_write(paths["json"], json.dumps(doc, indent=2) + "\n")
    atomic_write(paths["md"], render_markdown(score))
    return paths
