"""utils.text_data.LengthGroupedSampler: order from (seed, epoch) only, less padding, and through Accelerate's
own sharding and skipping: 2 processes see the 1-process batches split in two, a resumed epoch the same batches."""
import random

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from torch.utils.data import DataLoader

from utils.text_data import LengthGroupedSampler

BATCH = 8


@pytest.fixture(scope="module")
def lengths():
    rng = random.Random(0)
    return [rng.randint(4, 120) for _ in range(1003)]  # 1003: the last batch is short


def padded_tokens(batches, lengths):
    return sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)


def test_each_sample_once_in_batches_of_similar_length(lengths):
    sampler = LengthGroupedSampler(lengths, BATCH, seed=42)
    batches = sampler.batches()
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert [len(b) for b in batches] == [BATCH] * (len(lengths) // BATCH) + [len(lengths) % BATCH]
    shuffled = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).split(BATCH)
    random_padding = padded_tokens([b.tolist() for b in shuffled], lengths)
    assert padded_tokens(batches, lengths) < 0.75 * random_padding  # grouping really removes padding
    # the batches' order is shuffled, not longest-to-shortest within each megabatch
    longest = [max(lengths[i] for i in batch) for batch in batches[:50]]
    assert longest != sorted(longest, reverse=True)


def test_lengths_read_from_the_data_cache_are_copied_not_shared(lengths):
    """token_lengths() gives Arrow's read-only NumPy array; a tensor sharing it would make torch warn of undefined
    behaviour in the middle of the user's run."""
    cached = np.array(lengths)
    cached.setflags(write=False)
    sampler = LengthGroupedSampler(cached, BATCH, seed=42)
    assert not np.shares_memory(sampler.lengths.numpy(), cached)
    assert sampler.lengths.tolist() == lengths


def test_order_depends_on_seed_and_epoch_only(lengths):
    a, b = LengthGroupedSampler(lengths, BATCH, seed=42), LengthGroupedSampler(lengths, BATCH, seed=42)
    list(a)  # iterating advances nothing (a resumed process has not iterated): only set_epoch does
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    other_seed = LengthGroupedSampler(lengths, BATCH, seed=43)
    other_seed.set_epoch(3)
    assert list(a) != list(b) and list(a) != list(other_seed)


def prepared(lengths, num_processes, process_index):
    """The training loader as Accelerate prepares it: seedable sampler recipe, GLOBAL batch split over processes."""
    loader = DataLoader(list(range(len(lengths))), batch_size=BATCH,
                        sampler=LengthGroupedSampler(lengths, BATCH, seed=42))
    return prepare_data_loader(loader, num_processes=num_processes, process_index=process_index,
                               split_batches=True, put_on_device=False, use_seedable_sampler=True)


def epoch_batches(loader, epoch, skip=0):
    loader.set_epoch(epoch)
    return [batch.tolist() for batch in (skip_first_batches(loader, skip) if skip else loader)]


def test_two_processes_split_the_one_process_batches_and_resume_skips_exactly(lengths):
    single = prepared(lengths, 1, 0)
    ranks = [prepared(lengths, 2, rank) for rank in (0, 1)]
    for epoch in (0, 1):
        whole = epoch_batches(single, epoch)
        reference = LengthGroupedSampler(lengths, BATCH, seed=42)
        reference.set_epoch(epoch)
        assert whole == reference.batches()  # Accelerate's wrapping changes nothing on 1 process
        halves = [epoch_batches(loader, epoch) for loader in ranks]
        full = len(lengths) // BATCH
        # every full global batch is the same set of samples, rank 0 the first half, rank 1 the second
        assert [a + b for a, b in zip(*halves)][:full] == whole[:full]
        # a resumed epoch: the batches not yet trained, in the same order, on every rank
        assert epoch_batches(single, epoch, skip=37) == whole[37:]
        for rank, loader in enumerate(ranks):
            assert epoch_batches(loader, epoch, skip=37) == halves[rank][37:]
    assert epoch_batches(single, 0) != epoch_batches(single, 1)
