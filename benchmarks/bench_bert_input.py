"""BERT input pipeline: this project's data path vs the reference one, training samples/s on 1 thread.

Arms (same small randomly initialised BERT, same global batch 32, same AdamW + clipping step, same batches):
  reference  raw texts; collate_fn tokenises the batch on EVERY step with padding="max_length", max_length=512
             (the original cnews scripts' encode_plus per sample; transformers 5 has no encode_plus)
  project    train_bert_cls.build_dataloaders: tokenised once (datasets.map, fast tokenizer), each batch padded
             to its longest sample (the script's CPU default)
Both train on the project loader's shuffled epoch, so they differ only in tokenising and padding. The timed
batches are evenly spaced quantiles of the epoch's batch lengths (stratified_schedule), so that a few rounds
represent a whole epoch; the token counts of a whole epoch are exact. (The length-grouped arm, the "vs project"
columns and the timed batches' token counts were measured once and removed: RESULTS.md section 1.)

    python benchmarks/bench_bert_input.py            # THUCNews headlines and cnews articles, ~2 min
    python benchmarks/bench_bert_input.py --quick    # seconds
"""
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from utils.text_model import optimizer_groups  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
MAX_SEQ_LEN = 512
BATCH_SIZE = 32
REFERENCE = "reference (tokenise per step, pad 512)"
PROJECT = "project (tokenise once, dynamic pad)"


def stratified_schedule(batches, lengths, rounds, per_round):
    """Warm-up batch + rounds x per_round batches that sample the epoch's batch lengths evenly, every round alike.

    A batch costs what its longest sample costs, and a few random batches can all be long or all short; taking
    evenly spaced quantiles of the epoch's batch lengths, spread over the rounds, makes every round (and the
    total) represent the whole epoch.
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
        return {**batch, "labels": torch.tensor(labels)}
    return collate


def arm(loader, model, steps):
    """One way of feeding the model: its own loader and model copy; one untimed warm-up step."""
    model = copy.deepcopy(model)
    optimizer, batches = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=3e-5), harness.forever(loader)

    def step():  # loading, tokenising and collating included
        return harness.train_step(model, optimizer, next(batches), clip=1.0)
    step()
    return harness.timed(step, steps)


def run_dataset(name, path, args, rounds, steps):
    """Both arms on one dataset; returns the results dict and prints its table."""
    print(f"\n== {name}: {path}")
    examples = read_examples(path)[:args.quick_samples if args.quick else None]
    labels = build_label_list(examples, None)
    script_args = harness.bert_script_args(args.data_root, path, SMALL_BERT, max_seq_len=MAX_SEQ_LEN,
                                          train_batch_size=BATCH_SIZE, num_workers=0, seed=harness.SEED)
    torch.manual_seed(harness.SEED)
    tokenizer, model = harness.bert_model(script_args, labels)
    start = time.perf_counter()
    project_loader = harness.bert_train_loader(script_args, tokenizer, labels, examples)
    tokenize_seconds = time.perf_counter() - start  # one-off, before the first epoch
    dataset, collate = project_loader.dataset, project_loader.collate_fn
    lengths = [len(ids) for ids in dataset["input_ids"]]
    label2id = {label: i for i, label in enumerate(labels)}
    raw = [(e.text, label2id[e.label]) for e in examples]
    # The epoch's batches as the project's loader draws them (same seed as utils.runtime.loader_generator)
    epoch_batches = [list(b) for b in project_loader.batch_sampler]

    def loader(data, steps_per_round, collate_fn):
        schedule = stratified_schedule(epoch_batches, lengths, rounds, steps_per_round)
        return DataLoader(data, batch_sampler=schedule, collate_fn=collate_fn)
    arms = {REFERENCE: arm(loader(raw, steps[0], reference_collate(tokenizer)), model, steps[0]),
            PROJECT: arm(loader(dataset, steps[1], collate), model, steps[1])}
    samples = harness.run_rounds(arms, rounds)
    summary = harness.summarize(samples, REFERENCE)

    # Tokens computed per real token over a full epoch (no model: cheap). The reference always computes N x 512.
    project_epoch = [collate([dataset[i] for i in b]) for b in epoch_batches]
    computed = {REFERENCE: len(lengths) * MAX_SEQ_LEN, PROJECT: sum(b["input_ids"].numel() for b in project_epoch)}
    assert sum(int(b["attention_mask"].sum()) for b in project_epoch) == sum(lengths), "every token once per epoch"
    rows = []
    for arm_name, s in summary.items():
        s.update(epoch_real_tokens=sum(lengths), epoch_computed_tokens=computed[arm_name])
        rows.append([arm_name, s["median_rate"], f"{s['ratio_to_baseline']:.2f}x", s["median_cpu_rate"],
                     f"{s['cpu_ratio_to_baseline']:.2f}x", computed[arm_name] / sum(lengths), s["cpu_share"]])
    table = harness.format_table(["arm", "samples/s (median)", "vs reference", "samples per CPU-second",
                                 "vs reference, CPU time", "computed/real tokens (full epoch)", "CPU share"], rows)
    print(table)
    ordered = sorted(lengths)
    info = {"samples": len(examples), "tokenize_once_seconds": tokenize_seconds, "rounds": rounds,
            "mean_tokens": sum(lengths) / len(lengths), "median_tokens": ordered[len(lengths) // 2],
            "max_tokens": ordered[-1],
            "fraction_truncated_at_512": sum(n >= MAX_SEQ_LEN for n in lengths) / len(lengths)}
    print(f"{len(examples)} samples, tokens per sample (with [CLS]/[SEP], truncated at 512): mean "
          f"{info['mean_tokens']:.1f}, median {info['median_tokens']}, max {info['max_tokens']}, "
          f"{info['fraction_truncated_at_512']:.0%} truncated; tokenise-once took {tokenize_seconds:.1f} s")
    return {"dataset": str(path), **info, "arms": summary, "rounds_raw": samples, "table": table}


def main(argv=None):
    parser = harness.base_parser(__doc__)
    parser.add_argument("--quick_samples", type=int, default=600, help="--quick: samples read per dataset")
    args = parser.parse_args(argv)
    harness.require_data(args.data_root, "thucnews_titles/train.txt", "cnews_sample/cnews_1000.txt", "bert-base-chinese")
    harness.set_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 5)
    results = {"provenance": harness.provenance(),
               "setup": {"model": SMALL_BERT + " (random init, bert-base-chinese config, vocab 21,128)",
                         "batch_size": BATCH_SIZE, "max_seq_len": MAX_SEQ_LEN, "optimizer": "AdamW lr 3e-5, clip 1.0",
                         "threads": args.threads, "workers": 0}}
    # (reference, project) steps per round: a few seconds each (reference steps cost ~1.4 s, headline steps ~0.06 s).
    results["headlines"] = run_dataset("THUCNews headlines", args.data_root / "thucnews_titles" / "train.txt", args,
                                       rounds, (1, 4) if args.quick else (3, 40))
    results["cnews"] = run_dataset("cnews articles", args.data_root / "cnews_sample" / "cnews_1000.txt", args,
                                   rounds, (1, 1) if args.quick else (3, 3))
    harness.write_results("bench_bert_input", results, args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
