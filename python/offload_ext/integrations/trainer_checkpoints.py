"""Which of Trainer's checkpoints OffloadTrainer resumes from: one whose save finished, or a refusal that names the
one to use. Trainer writes a checkpoint's files one after another into checkpoint-N and trainer_state.json last;
a run killed in between leaves a directory Trainer's own resume would pick (the highest N) and then fail on, or
load half of."""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from offload_ext.engine.persistence import STATE_FILE

logger = logging.getLogger(__name__)
_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def cut_short(checkpoint: str) -> str | None:
    """Why `checkpoint` is not a whole OffloadTrainer checkpoint, None when it is: its trainer_state.json (Trainer's
    last file) reads as JSON and the Offloader's state is beside it."""
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME}, the file Trainer writes last: its save was interrupted"
    try:
        with open(state) as f:
            json.load(f)
    except json.JSONDecodeError:
        return f"its {TRAINER_STATE_NAME} is cut short: its save was interrupted"
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        return (f"it has no {STATE_FILE}, the Offloader's state (a checkpoint of another Trainer, or one saved with "
                "save_only_model=True)")
    return None


def resume_target(output_dir: str, resume: str | bool | None) -> str | None:
    """What Trainer.train(resume_from_checkpoint=resume) should resume from: None for a fresh start, a named
    checkpoint if it is whole (else ValueError naming the newest whole one), and for True the newest whole one in
    `output_dir` (each newer one cut short is named in a warning and left as it is)."""
    if resume is None or resume is False:
        return None
    if resume is not True:
        why = cut_short(str(resume))
        if why is not None:
            parent = os.path.dirname(os.path.abspath(str(resume)))
            previous = next((path for path, cut in _by_step(parent) if cut is None), None)
            fix = (f"use resume_from_checkpoint={previous!r}, the newest whole one" if previous else
                   "no whole checkpoint is beside it: start without resume_from_checkpoint")
            raise ValueError(f"OffloadTrainer: resume_from_checkpoint={str(resume)!r}: {why}; {fix}")
        return str(resume)
    for path, why in _by_step(output_dir):
        if why is None:
            return path
        logger.warning("OffloadTrainer: not resuming from %s: %s", path, why)
    raise ValueError(f"OffloadTrainer: resume_from_checkpoint=True: no whole checkpoint in {output_dir!r}; "
                     "start without resume_from_checkpoint")


def _by_step(output_dir: str) -> Iterator[tuple[str, str | None]]:
    """Each checkpoint-N directory in `output_dir`, newest first, with why it is cut short (None: whole), each
    looked into only when the caller gets that far."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted(((int(m.group(1)), os.path.join(output_dir, n)) for n in names if (m := _STEP.match(n))),
                   reverse=True)
    return ((path, cut_short(path)) for _, path in steps if os.path.isdir(path))
