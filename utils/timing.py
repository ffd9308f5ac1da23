"""Where a run's wall time goes: start-up until the first step, training steps, and the pauses between them.

The samples/s of a log line is the speed of training alone: time spent evaluating or checkpointing, and the wait for
an epoch's first batch (DataLoader workers starting and filling their queues), is kept out of it and reported on its
own (`eval_seconds`, `epoch_start_seconds`, ...). Counted in, an evaluation made the window around it look several
times slower than the steps in it were (issue 19: 65-250 samples/s against a steady 813-1,028 on one H100).
"""
import time
from contextlib import contextmanager

import psutil

_END = object()  # an exhausted iterator (a batch may be anything, None included)


def seconds_since_process_start():
    """Wall seconds since this process was started (the interpreter itself, imports and all)."""
    return time.time() - psutil.Process().create_time()


class Pause:
    """How long one excluded block took (`seconds`, set when it ends)."""
    seconds = 0.0


class ThroughputWindow:
    """Steps and samples between two log lines, and the time they took without the pauses.

    `clock` is injectable so the bookkeeping can be tested without sleeping. With `data_wait`, read() also gives
    `data_ms_per_step`: the wait for the batches after an epoch's first (main.py's "Data" time), a part of the
    training time.
    """

    def __init__(self, clock=time.perf_counter, process_clock=seconds_since_process_start, data_wait=False):
        self.clock, self.process_clock, self.data_wait = clock, process_clock, data_wait
        self.startup_seconds = None  # process start to the end of the first training step of this process
        self.first_step_in_window = False
        self.reset()

    def reset(self):
        self.start, self.steps, self.samples, self.paused, self.waited = self.clock(), 0, 0, {}, 0.0

    def step(self, samples):
        """One optimizer step of `samples` samples (over all processes) has been taken."""
        if self.startup_seconds is None:
            self.startup_seconds = self.process_clock()
            self.first_step_in_window = True
        self.steps += 1
        self.samples += samples

    @contextmanager
    def pause(self, name):
        """Time spent inside is not training time; it is reported as `{name}_seconds` with the next read()."""
        pause, start = Pause(), self.clock()
        try:
            yield pause
        finally:
            pause.seconds = self.clock() - start
            self.paused[name] = self.paused.get(name, 0.0) + pause.seconds

    def epoch(self, batches):
        """Iterate `batches`; the wait for the first one (worker start-up, first fetch) is an `epoch_start` pause,
        the wait for each later one is data time."""
        with self.pause("epoch_start"):
            iterator = iter(batches)
            batch = next(iterator, _END)
        while batch is not _END:
            yield batch
            start = self.clock()
            batch = next(iterator, _END)
            self.waited += self.clock() - start

    def read(self):
        """ms/step and samples/s of the window's training time, the pauses apart; then start a new window."""
        elapsed = self.clock() - self.start
        training = max(elapsed - sum(self.paused.values()), 1e-9)
        values = {"ms_per_step": 1000 * training / max(1, self.steps), "samples_per_second": self.samples / training,
                  **({"data_ms_per_step": 1000 * self.waited / max(1, self.steps)} if self.data_wait else {}),
                  **{f"{name}_seconds": seconds for name, seconds in self.paused.items()}}
        if self.first_step_in_window:
            values["startup_seconds"] = self.startup_seconds
            self.first_step_in_window = False
        self.reset()
        return values
