"""The engines difftest runs, by name. Each is one adapter behind `engines/base.py`; an engine
in a venv of its own is reached through `engines/venv_bridge.py`."""

from __future__ import annotations

import importlib

from difftest.errors import InputError

TRAINING_ENGINES = {"speculators": "difftest.engines.speculators_engine:SpeculatorsAdapter",
                    "specforge": "difftest.engines.specforge_engine:SpecForgeAdapter"}
SERVING_ENGINES = {"sglang": "difftest.engines.sglang_engine.adapter:SGLangAdapter",
                   "vllm": "difftest.engines.vllm_engine.adapter:VLLMAdapter"}


def adapter(name: str):
    """A fresh adapter for the engine called `name` (imported only when asked for)."""
    path = {**TRAINING_ENGINES, **SERVING_ENGINES}[name]
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)()


def launch_engine(argv: tuple[str, ...]) -> str | None:
    """The serving engine whose server a launch command starts, by the program it names (each
    adapter knows its own launchers); None when no engine claims it."""
    claims = [name for name in SERVING_ENGINES if adapter(name).claims_launch(argv)]
    return claims[0] if len(claims) == 1 else None


def training_engine_for(checkpoint) -> str:
    """The training engine that wrote `checkpoint`, where the directory itself says so (each
    training adapter knows its own engine's signs). A directory that several trainers write
    alike is refused: guessing would compare the draft with a forward it was not trained by."""
    claims = {name: sign for name in TRAINING_ENGINES if (sign := adapter(name).recognizes(checkpoint))}
    if len(claims) == 1:
        return next(iter(claims))
    others = " or ".join(f"--training {name}" for name in TRAINING_ENGINES)
    raise InputError(f"{checkpoint.path}: SGLang's layout (`midlayer.*`) with nothing that says which trainer wrote it "
                     f"(SpecForge's export writes this layout, and so does a converted speculators draft); pass {others}")
