"""A training loss that is the mean over exactly the real samples of each optimizer step, on any number of processes.

Two things accelerate does would otherwise make N processes train differently from 1:
- an epoch's last, short GLOBAL batch is completed with samples from the epoch's start (`even_batches`), so that
  every process gets a share: on 2 processes 200 samples at a batch of 16 train 208;
- `backward` divides every micro-batch's loss by the full accumulation count, also in an epoch's last, shorter
  window: a window of 1 batch out of 4 would take a quarter-strength step.
Here each real sample weighs 1 / (real samples in its optimizer step) and a padded one 0, so the step's gradient
is the mean over the samples it really saw, as on 1 process. (`even_batches=False` instead would leave a process
without a last batch: the others would wait for its gradients in the all-reduce.)
"""
import torch


class StepWeights:
    def __init__(self, accelerator, dataset_size, global_batch_size, accumulation_steps, drop_last=False):
        self.accelerator = accelerator
        self.global_batch = global_batch_size
        self.accumulation = accumulation_steps
        full, rest = divmod(dataset_size, global_batch_size)
        self.batches_per_epoch = full if drop_last or rest == 0 else full + 1
        self.last_batch_real = global_batch_size if drop_last or rest == 0 else rest

    def real_in_batch(self, index):
        """Real samples in the epoch's batch `index` (0-based), over all processes."""
        return self.last_batch_real if index == self.batches_per_epoch - 1 else self.global_batch

    def window_real(self, index):
        """Real samples in the optimizer step that batch `index` belongs to (windows restart every epoch)."""
        start = index - index % self.accumulation
        end = min(start + self.accumulation, self.batches_per_epoch)
        return sum(self.real_in_batch(i) for i in range(start, end))

    def local_real(self, index, local_batch_size):
        """How many of this process's samples of batch `index` are real: its share is the global positions
        [rank * b, rank * b + b) and the padding comes after the real samples."""
        share = self.global_batch // self.accelerator.num_processes
        first = self.accelerator.process_index * share
        return max(0, min(local_batch_size, self.real_in_batch(index) - first))

    def loss(self, per_sample_losses, index):
        """(loss to backward, mean over this process's real samples, their count) for batch `index`.

        DDP averages the gradient over the P processes and accelerate divides by the accumulation count N, so
        the sum of the real losses is scaled by P * N / (real samples in the step)."""
        real = self.local_real(index, per_sample_losses.shape[0])
        mask = torch.arange(per_sample_losses.shape[0], device=per_sample_losses.device) < real
        total = (per_sample_losses * mask).sum()
        scale = self.accelerator.num_processes * self.accumulation / self.window_real(index)
        return total * scale, total.detach() / max(real, 1), real

    def window_batches(self, index):
        """Loader batches in the optimizer step that batch `index` belongs to: N, or fewer at an epoch's end."""
        start = index - index % self.accumulation
        return min(start + self.accumulation, self.batches_per_epoch) - start

    def window_scale(self, index):
        """For a loss that is already a mean over full batches (drop_last): N / (batches in this window)."""
        return self.accumulation / self.window_batches(index)

