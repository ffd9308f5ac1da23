"""BERT input pipeline: this project's data path vs the reference one, training samples/s on 1 thread.

Arms (same small randomly initialised BERT, same global batch 32, same AdamW + clipping step, same batches):
  reference  raw texts; collate_fn tokenises the batch on EVERY step with padding="max_length", max_length=512
             (the original cnews scripts' encode_plus per sample; transformers 5 has no encode_plus)
  project    train_bert_cls.build_dataloaders: tokenised once (datasets.map, fast tokenizer),
             DataCollatorWithPadding pads each batch to its longest sample, rounded up to a multiple of 8
Both train on the project loader's shuffled epoch, so they differ only in tokenising and padding. The timed
batches are evenly spaced quantiles of the epoch's batch lengths (stratified_schedule), so that a few rounds
represent a whole epoch; the token counts of a whole epoch are exact. (The length-grouped arm was measured once
and removed: RESULTS.md section 1.)

    python benchmarks/bench_bert_input.py            # THUCNews headlines and cnews articles, ~2 min
    python benchmarks/bench_bert_input.py --quick    # seconds
"""
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from train_bert_cls import build_dataloaders, build_model, optimizer_groups  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
MAX_SEQ_LEN = 512
BATCH_SIZE = 32
SEED = 42
REFERENCE = "reference (tokenise per step, pad 512)"
PROJECT = "project (tokenise once, dynamic pad)"


def stratified_schedule(batches, lengths, rounds, per_round):
    """Warm-up batch + rounds x per_round batches that sample the epoch's batch lengths evenly, every round alike.

    A batch costs what its longest sample costs, and a few random batches of a length-grouped epoch can all be
    long or all short; taking evenly spaced quantiles of the epoch's batch lengths, spread over the rounds, makes
    every round (and the total) represent the whole epoch.
    """
    by_length = sorted(batches, key=lambda batch: max(lengths[i] for i in batch))
    total = rounds * per_round
    picks = [by_length[min(len(by_length) - 1, int((i + 0.5) * len(by_length) / total))] for i in range(total)]
    return [by_length[-1]] + [picks[r + j * rounds] for r in range(rounds) for j in range(per_round)]


def reference_collate(tokenizer):
    """The reference approach: tokenise raw texts inside collate_fn on every step, always 512 tokens."""
    def collate(items):
        texts, labels = zip(*items)
        batch = tokenizer(list(texts), padding="max_length", truncation=True, max_length=MAX_SEQ_LEN,
                          return_tensors="pt")
        batch["labels"] = torch.tensor(labels)
        return dict(batch)
    return collate


class Arm:
    """One way of feeding the model: its own loader, model copy, optimizer and running padding counts."""

    def __init__(self, loader, model, steps_per_round):
        self.loader, self.model, self.steps_per_round = loader, model, steps_per_round
        self.optimizer = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=3e-5)
        self.batches = common.Cycle(loader)
        self.real_tokens = self.padded_tokens = 0

    def train_step(self, count_tokens=True):
        batch = next(self.batches)
        if count_tokens:
            self.real_tokens += int(batch["attention_mask"].sum())
            self.padded_tokens += batch["input_ids"].numel()
        loss = self.model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return batch["labels"].shape[0]

    def __call__(self):
        """One timed round: steps_per_round training steps including loading, tokenising and collating."""
        with common.Timer() as timer:
            samples = sum(self.train_step() for _ in range(self.steps_per_round))
        return timer.wall, samples, {"cpu_seconds": timer.cpu}


def epoch_padding(loader):
    """(real tokens, computed tokens) over one full epoch of a loader, without the model."""
    batches = list(loader)
    return sum(int(b["attention_mask"].sum()) for b in batches), sum(b["input_ids"].numel() for b in batches)


def run_dataset(name, path, args, rounds, steps):
    """All arms on one dataset; returns the results dict and prints its table."""
    print(f"\n== {name}: {path}")
    examples = read_examples(path)
    if args.quick:
        examples = examples[:args.quick_samples]
    labels = build_label_list(examples, None)
    script_args = common.bert_script_args(args.data_root, path, SMALL_BERT, max_seq_len=MAX_SEQ_LEN,
                                          train_batch_size=BATCH_SIZE, num_workers=0, seed=SEED)
    torch.manual_seed(SEED)
    tokenizer, model = build_model(script_args, labels)
    start = time.perf_counter()
    loaders, _ = build_dataloaders(script_args, tokenizer, labels, {"train": examples}, None)
    tokenize_seconds = time.perf_counter() - start  # one-off, before the first epoch
    project_loader = loaders["train"]
    dataset = project_loader.dataset
    lengths = [len(ids) for ids in dataset["input_ids"]]

    label2id = {label: i for i, label in enumerate(labels)}
    raw = [(e.text, label2id[e.label]) for e in examples]
    collate = project_loader.collate_fn
    # The epoch's batches as the project's loader draws them (same seed as utils.runtime.loader_generator); the
    # timed batches are an even sample of the epoch's batch lengths.
    epoch_batches = [list(b) for b in project_loader.batch_sampler]
    arms = {
        REFERENCE: Arm(DataLoader(raw, batch_sampler=stratified_schedule(epoch_batches, lengths, rounds, steps[0]),
                                  collate_fn=reference_collate(tokenizer)), copy.deepcopy(model), steps[0]),
        PROJECT: Arm(DataLoader(dataset, batch_sampler=stratified_schedule(epoch_batches, lengths, rounds, steps[1]),
                                collate_fn=collate), copy.deepcopy(model), steps[1]),
    }
    for arm in arms.values():  # warm-up step, untimed and not counted
        arm.train_step(count_tokens=False)
    samples = common.run_rounds(arms, rounds)
    summary = common.summarize(samples, REFERENCE)

    # Padding over a full epoch (no model: cheap). The reference always computes N x 512 tokens.
    epoch = {REFERENCE: (sum(lengths), len(lengths) * MAX_SEQ_LEN),
             PROJECT: epoch_padding(DataLoader(dataset, batch_sampler=epoch_batches, collate_fn=collate))}
    assert all(r == sum(lengths) for r, _ in epoch.values()), "every arm must see every token once per epoch"

    rows = []
    for arm_name, arm in arms.items():
        s = summary[arm_name]
        real_epoch, computed_epoch = epoch[arm_name]
        vs_project = common.summarize(samples, PROJECT)[arm_name]
        rows.append([arm_name, s["median_rate"], f"{s['min_rate']:.1f}-{s['max_rate']:.1f}",
                     f"{s['ratio_to_baseline']:.2f}x", f"{vs_project['ratio_to_baseline']:.3f}x",
                     s["median_cpu_rate"], f"{s['cpu_ratio_to_baseline']:.2f}x",
                     f"{vs_project['cpu_ratio_to_baseline']:.3f}x",
                     f"{arm.real_tokens / arm.padded_tokens:.1%}", computed_epoch / real_epoch,
                     common.cpu_share(samples[arm_name])])
        s.update(ratio_to_project=vs_project["ratio_to_baseline"],
                 cpu_ratio_to_project=vs_project["cpu_ratio_to_baseline"], timed_real_tokens=arm.real_tokens, timed_computed_tokens=arm.padded_tokens,
                 epoch_real_tokens=real_epoch, epoch_computed_tokens=computed_epoch,
                 steps_per_round=arm.steps_per_round)
    headers = ["arm", "samples/s (median)", "range", "vs reference", "vs project", "samples per CPU-second",
               "vs reference, CPU time", "vs project, CPU time",
               "real/computed tokens (timed batches)", "computed/real tokens (full epoch)",
               "CPU share"]
    table = common.format_table(headers, rows)
    print(table)
    token_lengths = sorted(lengths)
    info = {"samples": len(examples), "tokenize_once_seconds": tokenize_seconds,
            "mean_tokens": sum(lengths) / len(lengths), "median_tokens": token_lengths[len(lengths) // 2],
            "max_tokens": token_lengths[-1],
            "fraction_truncated_at_512": sum(l >= MAX_SEQ_LEN for l in lengths) / len(lengths),
            "rounds": rounds}
    print(f"{len(examples)} samples, tokens per sample (with [CLS]/[SEP], truncated at 512): mean "
          f"{info['mean_tokens']:.1f}, median {info['median_tokens']}, max {info['max_tokens']}, "
          f"{info['fraction_truncated_at_512']:.0%} truncated; tokenise-once took {tokenize_seconds:.1f} s")
    return {"dataset": str(path), **info, "arms": summary, "rounds_raw": samples, "table": table}


def main(argv=None):
    parser = common.base_parser(__doc__)
    parser.add_argument("--quick_samples", type=int, default=600, help="--quick: samples read per dataset")
    args = parser.parse_args(argv)
    common.require_data(args.data_root, "thucnews_titles/train.txt", "cnews_sample/cnews_1000.txt", "bert-base-chinese")
    common.set_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 5)
    results = {"benchmark": "bench_bert_input", "provenance": common.provenance(),
               "setup": {"model": SMALL_BERT + " (random init, bert-base-chinese config, vocab 21,128)",
                         "batch_size": BATCH_SIZE, "max_seq_len": MAX_SEQ_LEN, "optimizer": "AdamW lr 3e-5, clip 1.0",
                         "threads": args.threads, "workers": 0}}
    # (reference, project) steps per round: a few seconds each (reference steps cost ~1.4 s, headline steps ~0.06 s).
    results["headlines"] = run_dataset("THUCNews headlines", args.data_root / "thucnews_titles" / "train.txt", args,
                                       rounds, (1, 4) if args.quick else (3, 40))
    results["cnews"] = run_dataset("cnews articles", args.data_root / "cnews_sample" / "cnews_1000.txt", args,
                                   rounds, (1, 1) if args.quick else (3, 3))
    common.write_results("bench_bert_input", results, args.output)


if __name__ == "__main__":
    common.run_cli(main, sys.argv[1:])
