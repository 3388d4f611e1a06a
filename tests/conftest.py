from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

# The harness's own tests drive SGLang-specific behaviour through the CLI (deployments, launch
# flags, costs); a report there compares training with SGLang alone, unless a test asks for more.
# vLLM has its own tests (test_vllm_engine.py), the parity suite runs both, and the default of
# both engines is tested where the front door is (test_cli.py).
os.environ.setdefault("DIFFTEST_SERVING", "sglang")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "fixtures" / "tiny"


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny() -> Path:
    return TINY


@pytest.fixture()
def tiny_copy(tmp_path) -> Path:
    dest = tmp_path / "tiny"
    shutil.copytree(TINY, dest)
    return dest


@pytest.fixture(scope="session")
def tiny_inputs():
    from difftest.cli import quiet_engines
    from difftest.pipeline import prepare

    quiet_engines(False)
    return prepare(TINY / "speculators", TINY / "target", TINY / "states.safetensors")
