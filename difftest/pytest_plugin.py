"""pytest plugin: `pytest difftest/` runs the parity suite on a checkpoint.

Options: --difftest-ckpt DIR (default: the embedded fixture), --difftest-target DIR,
--difftest-states FILE, --difftest-dtype fp32|bf16, --difftest-device cpu|cuda,
--difftest-chain-steps K.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("difftest", "EAGLE-3 draft parity between speculators and SGLang")
    group.addoption("--difftest-ckpt", default=None, help="draft checkpoint dir (default: embedded fixture)")
    group.addoption("--difftest-target", default=None, help="HF target dir")
    group.addoption("--difftest-states", default=None, help="captured hidden-states file")
    group.addoption("--difftest-dtype", default="auto", help="auto (checkpoint's stored dtype) | fp32 | bf16 | fp16")
    group.addoption("--difftest-device", default="cpu", help="cpu | cuda")
    group.addoption("--difftest-max-tokens", default=None, type=int, help="limit the states to this many tokens")
    group.addoption("--difftest-chain-steps", default=3, type=int,
                    help="draft steps per chain for the predicted-acceptance test (0: skip it)")


@pytest.fixture(scope="session")
def difftest_on_embedded_fixture(request) -> bool:
    return request.config.getoption("--difftest-ckpt") is None


@pytest.fixture(scope="session")
def difftest_result(request):
    from difftest.cli import quiet_engines
    from difftest.errors import InputError
    from difftest.pipeline import prepare, run
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
    except InputError as exc:
        pytest.fail(f"difftest: {exc}", pytrace=False)
    name = opt("--difftest-dtype")
    dtype = inputs.checkpoint.stored_dtype() if name == "auto" else DTYPES[name]
    return run(inputs, dtype=dtype, device=opt("--difftest-device"), chain_steps=opt("--difftest-chain-steps"),
               measure_target_capture=True)
