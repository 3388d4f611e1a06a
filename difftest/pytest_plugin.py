"""pytest plugin: `pytest difftest/` runs the parity suite on a checkpoint.

Options: --difftest-ckpt DIR (default: the embedded fixture), --difftest-target DIR,
--difftest-states FILE, --difftest-dtype fp32|bf16, --difftest-device cpu|cuda,
--difftest-chain-steps K, --difftest-training speculators|specforge, --difftest-serving sglang,vllm.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("difftest", "EAGLE-3 draft parity between training and serving engines")
    group.addoption("--difftest-ckpt", default=None, help="draft checkpoint dir (default: embedded fixture)")
    group.addoption("--difftest-target", default=None, help="HF target dir")
    group.addoption("--difftest-states", default=None, help="captured hidden-states file")
    group.addoption("--difftest-dtype", default="auto", help="auto (checkpoint's stored dtype) | fp32 | bf16 | fp16")
    group.addoption("--difftest-device", default="cpu", help="cpu | cuda")
    group.addoption("--difftest-max-tokens", default=None, type=int, help="limit the states to this many tokens")
    group.addoption("--difftest-chain-steps", default=3, type=int,
                    help="draft steps per chain for the predicted-acceptance test (0: skip it)")
    group.addoption("--difftest-training", default=None,
                    help="the engine that trained the checkpoint: speculators | specforge (default: what the "
                    "directory shows)")
    group.addoption("--difftest-serving", default="sglang,vllm",
                    help="comma-separated serving engines to compare with training (each gets every test)")


def pytest_configure(config):
    from difftest.engines import TRAINING_ENGINES

    training = config.getoption("--difftest-training")
    if training is not None and training not in TRAINING_ENGINES:
        raise pytest.UsageError(f"--difftest-training: unknown engine {training!r}; known: {list(TRAINING_ENGINES)}")
    config.addinivalue_line("markers", "serving_engines(*names): only these serving engines run this test")


def pytest_generate_tests(metafunc):
    """Every test that reads a result runs once per serving engine: a CI log names the engine
    and the probe that broke."""
    if "serving_engine" not in metafunc.fixturenames:
        return
    from difftest.engines import SERVING_ENGINES

    asked = [e.strip() for e in metafunc.config.getoption("--difftest-serving").split(",") if e.strip()]
    unknown = [e for e in asked if e not in SERVING_ENGINES]
    if unknown:
        raise pytest.UsageError(f"--difftest-serving: unknown engine(s) {unknown}; known: {list(SERVING_ENGINES)}")
    only = metafunc.definition.get_closest_marker("serving_engines")
    engines = [e for e in asked if only is None or e in only.args]
    metafunc.parametrize("serving_engine", engines, scope="session")


@pytest.fixture(scope="session")
def difftest_on_embedded_fixture(request) -> bool:
    return request.config.getoption("--difftest-ckpt") is None


@pytest.fixture(scope="session")
def difftest_result(request, serving_engine):
    from difftest.cli import quiet_engines
    from difftest.engines import training_engine_for
    from difftest.errors import InputError
    from difftest.pipeline import candidate_adapter, prepare, reference_adapter, run
    from difftest.tolerances import DTYPES

    quiet_engines(False)
    opt = request.config.getoption
    ckpt, target, states = opt("--difftest-ckpt"), opt("--difftest-target"), opt("--difftest-states")
    if ckpt is None:
        from difftest.fixturegen.default import default_fixture

        fx = default_fixture(progress=False)
        ckpt, target, states = fx.checkpoint, target or fx.target, states or fx.states
    try:
        inputs = prepare(ckpt, target, states, max_tokens=opt("--difftest-max-tokens"), device=opt("--difftest-device"))
        training = opt("--difftest-training") or training_engine_for(inputs.checkpoint)
    except InputError as exc:
        pytest.fail(f"difftest: {exc}", pytrace=False)
    name = opt("--difftest-dtype")
    dtype = inputs.checkpoint.stored_dtype() if name == "auto" else DTYPES[name]
    return run(inputs, dtype=dtype, device=opt("--difftest-device"), chain_steps=opt("--difftest-chain-steps"),
               measure_target_capture=True, candidate=candidate_adapter(serving_engine),
               reference=reference_adapter(training))
