"""`specforge` (its CLI, `specforge.cli:main`) with what a CPU needs and nothing else: the Triton loss
replaced by the same math in plain torch, and its torch.compile'd helpers run eager.

    python -m difftest.fixturegen.specforge_train_cpu train --config RUN.yaml [overrides]
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from difftest.engines.specforge_engine import trainer_on

    with trainer_on("cpu"):
        from specforge.cli import main as specforge_main

        return int(specforge_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
