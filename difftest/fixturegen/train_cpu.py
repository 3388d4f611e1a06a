"""Run speculators' own trainer (`python -m speculators.train`) on a CPU-only machine.

Only what CPU forces is changed, each found by running the trainer here:
- the trainer moves the model to `get_local_rank()` (an int: a CUDA ordinal); on CPU it is "cpu";
- `_StepTimer` calls `torch.accelerator.synchronize()`, which raises with no accelerator.
The attention implementation (sdpa) and loss kernel (eager) are ordinary trainer flags.
"""

from __future__ import annotations

import sys

import torch


def patch_for_cpu() -> None:
    import speculators.train.trainer as trainer

    if not torch.cuda.is_available():
        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None


def main(argv: list[str]) -> None:
    patch_for_cpu()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    sys.argv = ["speculators.train", *argv]
    train_main(TrainConfig.resolve())


if __name__ == "__main__":
    main(sys.argv[1:])
