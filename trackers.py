"""Metrics beside the JSONL: TensorBoard and Weights & Biases (`--log-to tensorboard,wandb`).

What it does
    Trackers    rank 0 opens each tracker asked for and hands it every record the JSONL gets:
                each number but the step becomes a scalar at that step.
    missing     the trackers whose package is absent, for cli.validate to refuse before any work.

Core idea
    The JSONL stays the record; a tracker is a second view of the same numbers. Each package is
    imported only when its tracker opens: neither is a dependency of attotron, and no feature file
    imports them. TensorBoard writes `<metrics>.tensorboard/` beside `--metrics <metrics>.jsonl`.
    W&B writes under the metrics file's folder (`wandb/`), in the mode WANDB_MODE names: set
    WANDB_MODE=offline on a machine with no network, then `wandb sync` the run later.

Reference
    torch.utils.tensorboard.SummaryWriter (add_scalar, flush, close); wandb.init(project, dir,
    config) and run.log(values, step=step), as the W&B quickstart writes them.

Run
    torchrun --nproc_per_node 2 train.py --metrics out/run.jsonl --log-to tensorboard  # rank 0 logs
    tensorboard --logdir out                                                            # then look

Invariants
    - TensorBoard's scalars equal the JSONL's numbers, step for step (tests/test_small_sets.py).
    - A tracker whose package is missing is refused by name before any heavy work (same test).

Builds on: nothing in attotron (train.py calls it).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # --log-to name: the package it needs


def missing(names: list[str]) -> list[str]:
    """The trackers among `names` whose package cannot be imported here."""
    return [n for n in names if importlib.util.find_spec(PACKAGES[n]) is None]


def folder_of(metrics: str) -> Path:
    """`run.jsonl` → `run.tensorboard`: the event files beside the JSONL."""
    p = Path(metrics)
    return p.with_name(p.name.removesuffix(".jsonl") + ".tensorboard")


class Trackers:
    """The trackers `names` asks for, opened on rank 0. write() takes the JSONL's records."""

    def __init__(self, names: list[str], metrics: str, config: dict):
        self.writers: list = []
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self.tb = SummaryWriter(log_dir=str(folder_of(metrics)))
            self.writers.append(self._tensorboard)
        if "wandb" in names:
            import wandb
            mode = os.environ.get("WANDB_MODE")  # offline / online / disabled; None: wandb decides
            self.wb = wandb.init(project=os.environ.get("WANDB_PROJECT", "attotron"),
                                 dir=str(Path(metrics).resolve().parent), config=config, mode=mode)
            self.writers.append(self._wandb)

    def _tensorboard(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()  # a crash loses no step the JSONL kept

    def _wandb(self, step: int, values: dict[str, float]) -> None:
        self.wb.log(values, step=step)

    def write(self, record: dict) -> None:
        values = {k: float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for writer in self.writers:
            writer(record["step"], values)

    def close(self) -> None:
        if hasattr(self, "tb"):
            self.tb.close()
        if hasattr(self, "wb"):
            self.wb.finish()
