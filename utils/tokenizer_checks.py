"""Start-up check that the tokenizer fits the text: the share of real tokens it maps to [UNK].

It caught a real failure (transformers 5 ignoring `vocab_file=` and mapping every Chinese character to [UNK]), so it
stays, at the cost it should have: one vectorised pass over the tokenised column, on the main process only, while the
other processes wait for its verdict and stop with it. The per-token Python version evaluated
`tokenizer.all_special_ids` again for every token: 3-4 s for 9,000 headlines, about 165 s for the cnews training set.
"""
import time

import numpy as np
import pyarrow.compute as pc
import torch
from accelerate.utils import broadcast

from .errors import UserError

MAX_UNK_RATE = 0.5  # above this the vocabulary does not fit the text (cnews_1000 with bert-base-chinese: 1.0%)


def unk_rate(tokenizer, dataset, column="input_ids"):
    """[UNK] tokens / all tokens that are not special tokens ([CLS], [SEP], [PAD], ...), over a tokenised dataset."""
    rows = dataset.with_format("arrow")[column]  # the arrow column, in the dataset's row order and selection
    ids = pc.list_flatten(rows).to_numpy(zero_copy_only=False)  # every row's ids, end to end
    special = np.fromiter(set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}, dtype=np.int64)
    real = ids[~np.isin(ids, special)]  # [UNK] is a special token too, but it is what is counted
    return float(np.count_nonzero(real == tokenizer.unk_token_id)) / max(1, real.size)


def check_unk_rate(accelerator, tokenizer, dataset, source, limit=MAX_UNK_RATE):
    """The training text's [UNK] rate, counted on the main process and shared with every rank; above `limit`, a
    UserError on every rank at once (so all stop cleanly, none waits in a collective for a rank that has left)."""
    rate = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process:
        start = time.perf_counter()
        rate[0] = unk_rate(tokenizer, dataset)
        seconds = time.perf_counter() - start
        if seconds > 1.0:
            print(f"[UNK] check: {seconds:.1f} s for {len(dataset):,} texts", flush=True)
    rate = broadcast(rate, from_process=0).item()
    if rate > limit:
        raise UserError(f"{source}: the tokenizer maps {rate:.0%} of the training text to [UNK]; "
                        "its vocab.txt does not fit this text")
    return rate
