"""Injectable faults: one per known way an EAGLE-3 draft goes silent at serving time.

Each fault is declared once: its name, the public bug class it reproduces, where it must
be caught (a probe, or `audit:<check>` when no probe can see it because both engines read
the same broken input), and the root cause the diagnosis must name. It is applied to a
scratch Workspace (a copy of the checkpoint and states, and the serving setup), never to
the originals.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from difftest.checkpoint import Checkpoint, CheckpointFormat, detect_format, load_checkpoint
from difftest.convert import speculators_to_legacy
from difftest.engines.base import DROP, ServingSetup
from difftest.states import CapturedStates, save_states


@dataclass
class Workspace:
    """Scratch copies a fault may edit: checkpoint dir, states and the serving setup."""

    root: Path
    checkpoint: Path
    states: CapturedStates
    target: Path
    serving: ServingSetup = field(default_factory=ServingSetup)
    run_dtype: torch.dtype = torch.float32
    served: Path | None = None  # the served copy, for deployment faults
    launch: list[str] = field(default_factory=list)

    @classmethod
    def copy_of(cls, checkpoint: Path, states: CapturedStates, target: Path, root: Path, dtype: torch.dtype) -> "Workspace":
        dest = root / "checkpoint"
        shutil.copytree(checkpoint, dest, symlinks=False)
        return cls(root, dest, states, target, run_dtype=dtype)

    def ckpt(self) -> Checkpoint:
        return load_checkpoint(self.checkpoint)

    def config(self) -> dict:
        return json.loads((self.checkpoint / "config.json").read_text())

    def edit_config(self, edit: Callable[[dict], None]) -> None:
        cfg = self.config()
        edit(cfg)
        (self.checkpoint / "config.json").write_text(json.dumps(cfg, indent=2))

    def edit_layer_config(self, edit: Callable[[dict], None]) -> None:
        """The transformer fields (rope, sizes): speculators nests them in transformer_layer_config,
        SGLang's layout keeps them at the top."""
        self.edit_config(lambda c: edit(c["transformer_layer_config"] if detect_format(c) is CheckpointFormat.SPECULATORS
                                        else c))

    @staticmethod
    def _aux_ids_holder(cfg: dict) -> dict:
        """Where the config keeps the trained aux ids (each format in its own numbering)."""
        return cfg if detect_format(cfg) is CheckpointFormat.SPECULATORS else cfg["eagle_config"]

    def aux_ids(self) -> list[int]:
        return list(self._aux_ids_holder(self.config())["eagle_aux_hidden_state_layer_ids"])

    def set_aux_ids(self, ids: list[int]) -> None:
        self.edit_config(lambda c: self._aux_ids_holder(c).__setitem__("eagle_aux_hidden_state_layer_ids", list(ids)))

    def edit_tensors(self, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
        tensors = dict(self.ckpt().tensors())
        edit(tensors)
        for f in self.checkpoint.glob("*.safetensors"):
            f.unlink()
        (self.checkpoint / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.checkpoint / "model.safetensors"))

    def to_legacy(self) -> None:
        out = self.root / "legacy"
        speculators_to_legacy(self.checkpoint, out)
        shutil.rmtree(self.checkpoint)
        out.rename(self.checkpoint)

    def serve(self, **changes) -> None:
        self.serving = replace(self.serving, **changes)

    def serve_config_edit(self, path: str, value) -> None:
        self.serving = replace(self.serving, config_edits=self.serving.config_edits + ((path, value),))

    def deploy(self) -> None:
        """A served copy made the way `difftest convert` makes one, and the launch command it
        prints; deployment faults then edit these, never the training checkpoint."""
        from difftest.convert import launch_command, served_copy

        self.served = self.root / "served"
        served_copy(self.ckpt(), self.served)
        self.launch = launch_command(str(self.served), str(self.target), self.run_dtype)

    def deployment(self) -> ServingSetup:
        from difftest.engines.base import Deployment

        return replace(self.serving, deployment=Deployment(self.served, tuple(self.launch), self.root, "fault launch"))

    def edit_served_config(self, edit: Callable[[dict], None]) -> None:
        cfg = json.loads((self.served / "config.json").read_text())
        edit(cfg)
        (self.served / "config.json").write_text(json.dumps(cfg, indent=2))

    def edit_served_tensors(self, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
        tensors = dict(load_checkpoint(self.served).tensors())
        edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.served / "model.safetensors"))

    def set_launch_flag(self, flag: str, value: str) -> None:
        if flag in self.launch:
            self.launch[self.launch.index(flag) + 1] = value
        else:
            self.launch += [flag, value]

    def states_file(self) -> Path:
        path = self.root / "states.safetensors"
        save_states(self.states, path)
        return path


@dataclass(frozen=True)
class OnEngine:
    """How a serving engine other than SGLang meets a fault, where it differs: data about that
    engine, measured by the selftest, never papered over."""

    caught_at: str = "-"  # a probe, "audit:<check>", or "-": the engine computes what training does
    diagnosis: str | None = None
    why: str = ""  # what the engine's own code does with it
    applies: bool = True  # False: the engine's code has no path that produces the fault


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str  # the public bug it reproduces
    caught_at: str  # a probe name, or "audit:<check>" (on SGLang, the engine the catalog was first built on)
    diagnosis: str  # a cause in difftest.diagnosis.CAUSES
    inject: Callable[[Workspace], None]
    # Run dtypes the fault means something at (e.g. a downcast is a no-op at bf16).
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    # A change made to the checkpoint after training, which both engines load alike: only the
    # training run's own metric can expose it, so it runs on a fixture that has one, with
    # chains drafted, on the draft as trained (no baseline edits).
    after_training: bool = False
    # Applied to a served copy (what `difftest convert` writes) or to its launch command, and
    # run through --serve: the training checkpoint stays as trained.
    deployed: bool = False
    # Caught by an informational finding: what the fault does is harmless to the draft's
    # computation, and the report must say so without a false verdict.
    notice_only: bool = False
    # Other causes the report must name beside the headline (a fault with two parts).
    also: tuple[str, ...] = ()
    # The fault stands for a draft trained otherwise (its config and states rewritten as if
    # trained in another order): the training run's metrics do not describe it.
    rewrites_training: bool = False
    # (serving engine, how it meets the fault) where that differs from SGLang's place and cause.
    on: tuple[tuple[str, OnEngine], ...] = ()
    # (training engine, how a draft its trainer wrote meets the fault) where that differs from a
    # speculators draft's: not at all (applies=False: its draft has no such field, or its loader
    # refuses the checkpoint), or at another place on SGLang (a serving engine's `on` still wins).
    by_training: tuple[tuple[str, OnEngine], ...] = ()

    def on_engine(self, engine: str, training: str = "speculators") -> OnEngine:
        """What the selftest expects from this serving engine, for a draft `training` wrote."""
        trained = dict(self.by_training).get(training)
        if trained is not None and not trained.applies:
            return trained
        own = dict(self.on)
        if engine in own:
            return own[engine]
        if engine != "sglang" and self.deployed:
            return OnEngine(applies=False, why="an edit to the directory SGLang serves or to SGLang's launch command")
        return trained or OnEngine(self.caught_at, self.diagnosis)


def _d2t(edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Workspace], None]:
    return lambda ws: ws.edit_tensors(lambda t: t.__setitem__("d2t", edit(t["d2t"])))


def _absolute(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), dtype=d2t.dtype)


def _arange_subtracted(d2t: torch.Tensor) -> torch.Tensor:
    return d2t - torch.arange(d2t.numel(), dtype=d2t.dtype)


def _head_from_target(ws: Workspace) -> None:
    # With an lm_head present SGLang's loader asserts on its shape (loud, not silent), so
    # the silent form is a head-less checkpoint whose serving config has draft_vocab_size null.
    ws.edit_tensors(lambda t: t.pop("lm_head.weight"))
    ws.serve_config_edit("draft_vocab_size", None)


def _random_embedding(ws: Workspace) -> None:
    ws.edit_tensors(lambda t: t.pop("embed_tokens.weight", None))
    ws.serve(share_target_embed=False)


def _verbatim_aux_ids(ws: Workspace) -> None:
    ids = ws.config()["eagle_aux_hidden_state_layer_ids"]
    # What a converter that copies speculators' ids into eagle_config writes.
    ws.serve_config_edit("eagle_config.eagle_aux_hidden_state_layer_ids", list(ids))


def _trained_in_reverse_order(ws: Workspace) -> None:
    st = ws.states
    H = st.target_hidden_size
    ws.states = replace(st, aux_layer_ids=tuple(reversed(st.aux_layer_ids)),
                        aux_hidden_states=torch.cat(st.aux_hidden_states.split(H, dim=-1)[::-1], dim=-1))
    ws.set_aux_ids(ws.aux_ids()[::-1])


def _norm_flag_dropped(ws: Workspace) -> None:
    # The flag must be on for dropping it to matter.
    ws.edit_config(lambda c: c.update(norm_before_fc=True, fc_norm=False))
    ws.serve_config_edit("norm_before_fc", DROP)
    ws.serve_config_edit("eagle_config.norm_before_fc", DROP)


def _rope_dropped(ws: Workspace) -> None:
    # Train-side theta well away from the library default, so dropping it changes positions.
    def far_theta(layer: dict) -> None:
        theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta", 10000.0))
        new = float(theta) * 16
        if "rope_parameters" in layer and layer["rope_parameters"]:
            layer["rope_parameters"]["rope_theta"] = new
        layer["rope_theta"] = new

    ws.edit_layer_config(far_theta)
    ws.serve_config_edit("rope_parameters", DROP)
    ws.serve_config_edit("rope_theta", DROP)


def _downcast_weights(ws: Workspace) -> None:
    ws.edit_tensors(lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if v.is_floating_point()}))


def _shuffled_head_rows(ws: Workspace) -> None:
    def shuffle(t: dict) -> None:
        g = torch.Generator().manual_seed(0)
        t["lm_head.weight"] = t["lm_head.weight"][torch.randperm(t["lm_head.weight"].shape[0], generator=g)]

    ws.edit_tensors(shuffle)


def _regenerated_vocab_map(ws: Workspace) -> None:
    """A valid map (offsets, unique, t2d agreeing) for another draft vocab, as if rebuilt from
    other data after training: the vocab audit passes it."""
    def remap(t: dict) -> None:
        n, vocab = t["d2t"].numel(), t["t2d"].numel()
        ids = torch.arange(vocab, dtype=torch.int64)[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:n]].sort().values
        t["d2t"] = (ids - torch.arange(n)).to(t["d2t"].dtype)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d

    ws.edit_tensors(remap)


def _fc_sign_flipped(ws: Workspace) -> None:
    ws.edit_tensors(lambda t: t.__setitem__("fc.weight", -t["fc.weight"]))


def _served_keys_renamed(ws: Workspace) -> None:
    ws.edit_served_tensors(lambda t: t.update({k.replace("midlayer.", "layers.1."): t.pop(k) for k in list(t)
                                              if k.startswith("midlayer.")}))


def _served_d2t_arange_subtracted(ws: Workspace) -> None:
    ws.edit_served_tensors(lambda t: t.__setitem__("d2t", _arange_subtracted(t["d2t"])))


def _served_aux_ids_verbatim(ws: Workspace) -> None:
    trained = ws.config()["eagle_aux_hidden_state_layer_ids"]
    ws.edit_served_config(lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", list(trained)))


def _served_norm_flag_missing(ws: Workspace) -> None:
    ws.edit_config(lambda c: c.update(norm_before_fc=True, fc_norm=False))
    ws.deploy()  # the served copy of the draft as trained, then the flag lost by hand
    ws.edit_served_config(lambda c: (c.pop("norm_before_fc", None), c.get("eagle_config", {}).pop("norm_before_fc", None)))


def _served_token_map(ws: Workspace) -> None:
    """A token map built from other data: valid target ids, not the trained draft vocab."""
    d2t = load_checkpoint(ws.served).get("d2t").long()
    hot = (d2t + torch.arange(d2t.numel())).flip(0)
    path = ws.root / "token_map.pt"
    torch.save(hot.tolist(), path)
    ws.set_launch_flag("--speculative-token-map", str(path))


def _served_other_dtype(ws: Workspace) -> None:
    ws.set_launch_flag("--dtype", "bfloat16" if ws.run_dtype == torch.float32 else "float32")


def _served_rope_theta_changed(ws: Workspace) -> None:
    def edit(c: dict) -> None:
        params = c.setdefault("rope_parameters", {"rope_type": "default"})
        params["rope_theta"] = 10 * float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
        c.pop("rope_theta", None)
    ws.edit_served_config(edit)


def _served_speculators_directory(ws: Workspace) -> None:
    """The training checkpoint's own speculators-format directory served as it is."""
    from difftest.checkpoint import CheckpointFormat
    from difftest.convert import legacy_to_speculators

    shutil.rmtree(ws.served)
    ckpt = ws.ckpt()
    if ckpt.format is CheckpointFormat.SPECULATORS:
        shutil.copytree(ws.checkpoint, ws.served)
    else:
        legacy_to_speculators(ckpt, ws.served)


def _launch_without_dtype(ws: Workspace) -> None:
    ws.edit_served_config(lambda c: (c.pop("torch_dtype", None), c.pop("dtype", None)))
    i = ws.launch.index("--dtype")
    del ws.launch[i:i + 2]


def _not_in(training: str, why: str) -> tuple[str, OnEngine]:
    return training, OnEngine(applies=False, why=why)


SPECFORGE_LOADS_ALL = _not_in("specforge", "SpecForge's exporter requires fc, norm, lm_head, t2d and d2t, and its warm "
                              "start refuses a checkpoint missing any but the embedding")
SPECFORGE_NO_NORM_FLAGS = _not_in("specforge", "SpecForge's LlamaForCausalLMEagle3 has no norm_before_fc, and no config "
                                  "it writes carries the flag")
SPECFORGE_OWN_NUMBERING = _not_in("specforge", "SpecForge writes SGLang's layout and aux numbering itself: there are no "
                                  "speculators ids to copy")


FAULTS: tuple[Fault, ...] = (
    # sglang 0.5.23 maps both midlayer.* and layers.0.* itself; a name it has no rule for
    # (here a 1-based layer index from a converter) is what it still drops without a word.
    Fault("decoder_keys_renamed", "checkpoint keys the engine doesn't know are skipped (layers.0.* vs midlayer.*)",
          "layer0.embed_norm", "keys_dropped",
          # speculators' names and SGLang's layout's (a SpecForge export) alike.
          lambda ws: ws.serve(key_renames=(("layers.0.", "layers.1."), ("midlayer.", "layers.1."))),
          on=(("vllm", OnEngine("audit:launch", "served_weights_refused",
                                "vLLM's AutoWeightsLoader raises on a name no parameter has: a server would not start "
                                "(SGLang's load_weights skips it without a word)")),)),
    Fault("d2t_absolute_ids", "d2t stored as absolute target ids where offsets belong",
          "audit:vocab", "d2t_absolute_ids", _d2t(_absolute)),
    Fault("d2t_arange_subtracted", "a 'fix' that subtracts arange from correct d2t offsets",
          "audit:vocab", "d2t_arange_subtracted", _d2t(_arange_subtracted),
          on=(("vllm", OnEngine("target_token", "d2t_arange_subtracted",
                                "vLLM scatters the draft logits into the target vocab at arange + d2t; the scrambled "
                                "map repeats ids, one logit per target id survives, and its argmax leaves the draft's "
                                "mapped argmax, so the target_token probe itself diverges")),)),
    Fault("d2t_missing", "no d2t in the checkpoint: draft ids read as target ids",
          "target_token", "d2t_missing", lambda ws: ws.edit_tensors(lambda t: t.pop("d2t")),
          by_training=(SPECFORGE_LOADS_ALL,)),
    Fault("lm_head_missing", "a missing lm_head left at random init",
          "logits", "lm_head_missing", lambda ws: ws.edit_tensors(lambda t: t.pop("lm_head.weight")),
          on=(("vllm", OnEngine("logits", "lm_head_replaced_by_target",
                                "vLLM's proposer shares the target's head when the checkpoint has none "
                                "(_maybe_share_lm_head), where SGLang leaves it uninitialised")),),
          by_training=(SPECFORGE_LOADS_ALL,)),
    Fault("lm_head_from_target", "a missing lm_head replaced by the target's full-vocab head (set_embed_and_head, "
          "taken when draft_vocab_size is null in the serving config)",
          "logits", "lm_head_replaced_by_target", _head_from_target,
          on=(("vllm", OnEngine("audit:launch", "served_weights_refused",
                                "with draft_vocab_size null vLLM builds no draft_id_to_target_id, and its loader refuses "
                                "the d2t tensor: a server would not start")),),
          by_training=(SPECFORGE_LOADS_ALL,)),
    Fault("draft_embedding_not_shared", "the draft's own random embedding used instead of the target's",
          "embed", "embedding_not_shared", _random_embedding,
          on=(("vllm", OnEngine(applies=False, why="vLLM's proposer shares the target's embedding whenever the "
                                "checkpoint has none (_maybe_share_embeddings)")),)),
    Fault("aux_capture_off", "the target not set up to capture aux hidden states: one layer, fc skipped by the shape check",
          "fc.input", "aux_capture_off_fc_skipped", lambda ws: ws.serve(aux_capture=False),
          on=(("vllm", OnEngine(applies=False, why="vLLM's runner captures aux states exactly when the draft's "
                                "config asks (eagle_config.use_aux_hidden_state, read by proposer and draft alike)")),)),
    Fault("aux_ids_off_by_one", "aux layer ids off by one between engines (speculators' ids copied verbatim)",
          "audit:capture", "aux_layers_off_by_one", _verbatim_aux_ids,
          on=(("vllm", OnEngine(why="vLLM's runner reads the draft config's own eagle_aux_hidden_state_layer_ids "
                                "(speculators' ids, as trained) before eagle_config's")),),
          by_training=(SPECFORGE_OWN_NUMBERING,)),
    Fault("aux_layers_wrong_order", "aux layers concatenated in a different order than trained",
          "audit:capture", "aux_layers_wrong_order", _trained_in_reverse_order, rewrites_training=True),
    Fault("norm_flag_dropped", "the converter drops a norm flag (norm_before_fc)",
          "fc.input", "config_flag_not_carried", _norm_flag_dropped, by_training=(SPECFORGE_NO_NORM_FLAGS,)),
    Fault("rope_theta_dropped", "the converter drops rope theta / scaling",
          "layer0.attn_output", "rope_mismatch", _rope_dropped,
          on=(("vllm", OnEngine(applies=False, why="a fault of the conversion to SGLang's config; vLLM serves the "
                                "checkpoint's own config, rope in its transformer_layer_config")),)),
    Fault("tie_word_embeddings_set", "tie_word_embeddings wrongly set: the target-vocab embedding used as the head",
          "logits", "tied_embeddings", lambda ws: ws.serve_config_edit("tie_word_embeddings", True),
          on=(("vllm", OnEngine(why="Eagle3LlamaForCausalLM always builds its own draft-vocab head and never reads "
                                "tie_word_embeddings")),)),
    Fault("weights_downcast", "weights in a different dtype (bf16) from the target states (fp32)",
          "embed", "embedding_precision", _downcast_weights, dtypes=("fp32",),
          on=(("vllm", OnEngine(why="vLLM's proposer shares the target's embedding only if it equals the checkpoint's; "
                                "the bf16-rounded copy differs, so vLLM keeps it, as speculators does")),),
          by_training=(_not_in("specforge", "SpecForge's exporter always writes bf16 (materialize_draft): there is "
                                            "no wider checkpoint to downcast"),)),
    # After training: both engines agree, acceptance collapses, and the draft's own
    # norm_before_residual divergence (which costs nothing) must not take the headline.
    Fault("head_rows_shuffled_after_training", "lm_head rows reordered after training: the head out of step with d2t",
          "audit:acceptance", "vocab_map_out_of_step", _shuffled_head_rows, dtypes=("bf16",), after_training=True),
    Fault("vocab_map_regenerated_after_training", "d2t/t2d rebuilt from other data after training (a valid map, the wrong one)",
          "audit:acceptance", "vocab_map_out_of_step", _regenerated_vocab_map, dtypes=("bf16",), after_training=True),
    Fault("fc_edited_after_training", "a weight edited after training (fc's sign flipped by a bad conversion)",
          "audit:acceptance", "checkpoint_changed_after_training", _fc_sign_flipped, dtypes=("bf16",), after_training=True),
    # Deployment: a served copy or a launch command gone wrong, the training checkpoint as trained.
    Fault("served_keys_renamed_by_hand", "served keys renamed by hand to names SGLang has no rule for (midlayer. -> layers.1.)",
          "layer0.embed_norm", "keys_dropped", _served_keys_renamed, deployed=True),
    Fault("served_d2t_arange_subtracted", "the served d2t 'fixed' by subtracting arange",
          "target_token", "d2t_arange_subtracted", _served_d2t_arange_subtracted, deployed=True),
    Fault("launched_as_eagle", "--speculative-algorithm EAGLE for an EAGLE-3 draft: no aux capture, the target's head",
          "fc.input", "speculative_algorithm_not_eagle3",
          lambda ws: ws.set_launch_flag("--speculative-algorithm", "EAGLE"), deployed=True),
    Fault("served_aux_ids_verbatim", "speculators' aux ids copied verbatim into the served eagle_config",
          "audit:capture", "aux_layers_off_by_one", _served_aux_ids_verbatim, deployed=True,
          by_training=(SPECFORGE_OWN_NUMBERING,)),
    Fault("served_norm_flag_missing", "norm_before_fc missing from a hand-written served config",
          "fc.input", "config_flag_not_carried", _served_norm_flag_missing, deployed=True,
          by_training=(SPECFORGE_NO_NORM_FLAGS,)),
    Fault("served_config_field_changed", "a config field changed in the served copy only (rope theta x10)",
          "layer0.attn_output", "rope_mismatch", _served_rope_theta_changed, deployed=True),
    Fault("launch_override_reaches_draft", "--json-model-override-args meant for the target (linear rope scaling "
          "for a longer context) reaches the draft", "layer0.attn_output", "launch_override_reaches_draft",
          lambda ws: ws.set_launch_flag("--json-model-override-args",
                                        '{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}'), deployed=True),
    Fault("launch_without_dtype", "no --dtype in the launch, and a served config that names no dtype: SGLang "
          "serves it in fp16", "audit:launch", "served_dtype_differs", _launch_without_dtype, deployed=True),
    Fault("served_draft_vocab_size_missing", "draft_vocab_size missing from a hand-written served config: SGLang "
          "cannot build the draft, a server would not start", "audit:launch", "served_config_not_servable",
          lambda ws: ws.edit_served_config(lambda c: c.pop("draft_vocab_size")), deployed=True),
    Fault("served_tie_word_embeddings_set", "tie_word_embeddings switched on in the served config: the target's "
          "embedding served as the head", "logits", "tied_embeddings",
          lambda ws: ws.edit_served_config(lambda c: c.__setitem__("tie_word_embeddings", True)), deployed=True),
    Fault("served_speculators_directory", "a speculators-format directory handed to SGLang as it is: its config code "
          "refuses it, a server would not start", "audit:launch", "served_format_not_servable",
          _served_speculators_directory, deployed=True),
    Fault("served_lm_head_missing", "lm_head.weight missing from the served directory",
          "logits", "lm_head_missing", lambda ws: ws.edit_served_tensors(lambda t: t.pop("lm_head.weight")), deployed=True),
    Fault("launch_token_map_disagrees", "a --speculative-token-map that disagrees with the trained d2t "
          "(SGLang ignores it for EAGLE3: reported, no false verdict)",
          "audit:launch", "speculative_token_map_ignored", _served_token_map, deployed=True, notice_only=True),
    Fault("launch_dtype_differs", "the launch serves the draft in another dtype than training's",
          "audit:launch", "served_dtype_differs", _served_other_dtype, deployed=True),
    Fault("launch_eagle_token_map_disagrees", "--speculative-algorithm EAGLE with a --speculative-token-map that "
          "disagrees with the trained d2t: the worker reads draft ids through the wrong map",
          "fc.input", "speculative_algorithm_not_eagle3",
          lambda ws: (_served_token_map(ws), ws.set_launch_flag("--speculative-algorithm", "EAGLE")), deployed=True,
          also=("speculative_token_map_differs",)),
    Fault("launch_draft_load_format_dummy", "--speculative-draft-load-format dummy left in the launch (a benchmark "
          "setting): the draft serves random weights", "fc.input", "draft_weights_random",
          lambda ws: ws.set_launch_flag("--speculative-draft-load-format", "dummy"), deployed=True,
          by_training=(("specforge", OnEngine("fc.output", "draft_weights_random", "SpecForge's draft has no norm "
                                              "before fc: fc's input is the target's states, its output the first "
                                              "random weights")),)),
    Fault("launch_draft_window", "--speculative-draft-window-size shorter than the prompts, for a draft trained "
          "with full attention over them", "layer0.attn_output", "draft_window_differs",
          lambda ws: ws.set_launch_flag("--speculative-draft-window-size", "4"), deployed=True),
)

FAULTS_BY_NAME = {f.name: f for f in FAULTS}


def scratch_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="difftest-fault-")
