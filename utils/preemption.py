"""SIGTERM (what Slurm and cloud preemption send) becomes "checkpoint at the next step boundary, then exit".

The signal may reach only some ranks; `should_stop` turns it into a decision all ranks share
(one tiny all-reduce per optimizer step, and a device sync with it: skipped when there is a single process), so
every rank saves the same checkpoint and none hangs.
"""
import signal


class PreemptionGuard:
    def __init__(self, accelerator, signals=(signal.SIGTERM,)):
        self.accelerator = accelerator
        self.received = None
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.received = signal.Signals(signum).name

    def should_stop(self):
        """True on every rank once any rank has received the signal. Call on all ranks at the same points."""
        if self.accelerator.num_processes == 1:  # nothing to agree on: no all-reduce, no `.item()` device sync
            return self.received is not None
        if self.received:
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()
