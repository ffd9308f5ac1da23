"""Length-grouped training order (`--group_by_length`): batches of texts of similar length, so less padding.

transformers' LengthGroupedSampler idea (megabatches of 50 batches, each sorted by length), made to fit this
project's exactness rules:
- The order is a pure function of (seed, epoch): `set_epoch` is called by the prepared loader (Accelerate's
  seedable-sampler recipe), every process computes the same order, and `skip_first_batches` on resume skips
  exactly the batches already trained.
- It is a sampler of indices, batched by the DataLoader with the GLOBAL batch size (split_batches=True): a global
  batch is the same set of samples on any number of processes; each process then takes its consecutive slice of
  that batch (the longer half on rank 0), so per-process padding stays tight.
What it changes: a batch holds samples of similar length drawn from one megabatch (50 global batches of the shuffled
data) instead of a uniform random draw; the batches' order is shuffled again, so long and short batches alternate.
"""
import torch
from torch.utils.data import Sampler

MEGABATCH_BATCHES = 50  # transformers' choice: large enough to group well, small enough to stay random


class LengthGroupedSampler(Sampler):
    def __init__(self, lengths, batch_size, seed, megabatch_batches=MEGABATCH_BATCHES):
        self.lengths = torch.as_tensor(lengths)
        self.batch_size = batch_size  # the GLOBAL batch size of the DataLoader that batches these indices
        self.seed = seed
        self.megabatch = batch_size * megabatch_batches
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.lengths)

    def batches(self):
        """The epoch's batches of indices; only the last one may be short, as in an unshuffled DataLoader."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator)
        grouped = []
        for megabatch in order.split(self.megabatch):
            # stable sort, longest first: ties keep the shuffled order
            by_length = torch.sort(self.lengths[megabatch], descending=True, stable=True).indices
            grouped.append(megabatch[by_length])
        batches = list(torch.cat(grouped).split(self.batch_size))
        short = batches.pop() if len(batches[-1]) < self.batch_size else None
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        return [b.tolist() for b in batches] + ([short.tolist()] if short is not None else [])

    def __iter__(self):
        for batch in self.batches():
            yield from batch
