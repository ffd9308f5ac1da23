"""utils/loop.py: after which optimizer steps both scripts log, validate, checkpoint and stop. No training."""
import pytest

from utils.loop import Cadence


def walk(cadence, accumulation=1):
    """The scripts' loop without the training: after each optimizer step, the steps at which each thing was due."""
    seen = {"log": [], "evaluate": [], "checkpoint": [], "finished": []}
    step = 0
    for _ in range(cadence.epochs):
        for batch in range(1, cadence.batches_per_epoch + 1):
            if batch % accumulation and batch != cadence.batches_per_epoch:  # accelerate syncs at the loader's end
                continue
            step += 1
            due = cadence.after_step(step, batch)
            for name, now in due._asdict().items():
                if now:
                    seen[name].append(step)
            if due.finished:
                return step, seen
    return step, seen


def test_epoch_ends_and_a_run_that_stops_inside_an_epoch():
    """--max_train_steps 25 with 10 steps per epoch and --logging_steps 4: the run stops 5 steps into epoch 3."""
    cadence = Cadence(total_steps=25, steps_per_epoch=10, batches_per_epoch=10, log_every=4)
    assert cadence.epochs == 3
    steps, seen = walk(cadence)
    assert steps == 25
    assert seen["log"] == [4, 8, 10, 12, 16, 20, 24, 25]  # every 4 steps, and no window across an epoch's end
    assert seen["evaluate"] == [10, 20, 25]  # each epoch's end, the last step's included
    assert seen["checkpoint"] == [10, 20]  # a finished run needs no resumable checkpoint
    assert seen["finished"] == [25]


def test_steps_between_evaluations_and_checkpoints():
    cadence = Cadence(total_steps=25, steps_per_epoch=10, batches_per_epoch=10, log_every=50, eval_every=6,
                      checkpoint_every=7)
    _, seen = walk(cadence)
    assert seen["log"] == [10, 20, 25]  # a window longer than an epoch still ends with it
    assert seen["evaluate"] == [6, 12, 18, 24, 25]  # and always after the last step
    assert seen["checkpoint"] == [7, 14, 21]  # only where asked: not at the epoch ends, not at the end


def test_checkpointing_steps_may_ask_for_the_last_step():
    cadence = Cadence(total_steps=20, steps_per_epoch=10, batches_per_epoch=10, log_every=5, checkpoint_every=10)
    assert walk(cadence)[1]["checkpoint"] == [10, 20]


def test_accumulation_with_a_short_last_window():
    """The ResNet demo's shape: 21 batches per epoch, 2 per optimizer step, so every epoch's 11th step has 1 batch."""
    cadence = Cadence(total_steps=33, steps_per_epoch=11, batches_per_epoch=21, log_every=5)
    steps, seen = walk(cadence, accumulation=2)
    assert steps == 33 and cadence.epochs == 3
    assert seen["log"] == [5, 10, 11, 15, 20, 22, 25, 30, 33]
    assert seen["evaluate"] == [11, 22, 33]
    assert seen["checkpoint"] == [11, 22]
    assert seen["finished"] == [33]


@pytest.mark.parametrize("completed_steps, batches_in_epoch, expected", [
    (36, 6, (True, False, False, False)),  # a resumed run asks afresh at any step: nothing is remembered
    (40, 10, (True, True, True, False)),
    (41, 1, (False, False, False, False)),
    (100, 10, (True, True, False, True)),
])
def test_after_step_depends_on_the_position_alone(completed_steps, batches_in_epoch, expected):
    cadence = Cadence(total_steps=100, steps_per_epoch=10, batches_per_epoch=10, log_every=12)
    assert tuple(cadence.after_step(completed_steps, batches_in_epoch)) == expected
    assert cadence.finished(completed_steps) == expected[3]
