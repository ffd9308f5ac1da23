"""DataLoader settings that keep a GPU fed, and the batches each epoch trains on, the same in both scripts.

- pin_memory on CUDA: batches land in page-locked memory, so the copy to the GPU can run asynchronously
  (DataLoaderConfiguration(non_blocking=True) in utils/runtime.py makes accelerate's copy non-blocking; without
  pinned memory that flag does nothing).
- persistent_workers with workers: they are started once per loader, not again at every epoch (and every
  evaluation), which put worker start-up into the training time of each epoch. A dataset whose samples depend on
  the epoch must then carry the epoch to the workers itself (see utils/image_data.py EpochValue): each worker holds
  its own copy of the dataset, made when the workers started.
"""
import torch
from accelerate import PartialState


def loader_settings(num_workers):
    """DataLoader keyword arguments for `num_workers` worker processes on the device this run trains on."""
    return {"num_workers": num_workers, "pin_memory": PartialState().device.type == "cuda",
            "persistent_workers": num_workers > 0}


class EpochValue:
    """An epoch number that DataLoader workers see change: kept in shared memory, so `set` in the main process
    reaches the dataset copies of persistent workers (a plain attribute would stay at its value when they started).
    The loader hands out the next epoch's indices only when its iterator is (re)started, after `set`."""

    def __init__(self, epoch=0):
        self.value = torch.tensor(epoch, dtype=torch.long).share_memory_()

    def set(self, epoch):
        self.value.fill_(epoch)

    def get(self):
        return int(self.value)


def epoch_batches(accelerator, loader, epoch, state):
    """The batches of `epoch` still to train, and the index of the first: all of them, or, in the epoch a run resumed
    in, those after the checkpoint's position (`state`'s epoch and batches_in_epoch).

    accelerate's exact-resume recipe: set_epoch explicitly every epoch (the seedable sampler's order depends on
    seed + epoch only), and skip_first_batches for the resumed epoch alone."""
    loader.set_epoch(epoch)
    skip = state["batches_in_epoch"] if epoch == state["epoch"] else 0
    return (accelerator.skip_first_batches(loader, skip) if skip else loader), skip
