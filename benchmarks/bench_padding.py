"""Padding per device: what pad-to-8 costs on a CPU, and what a bound on the shapes saves under torch.compile.

(a) CPU, eager: training steps (forward, backward, fused AdamW) of a small BERT on headline-length text, the same
    batches padded to their longest text (the CPU default now) or to a multiple of 8 (the old default everywhere),
    in alternating rounds; plus the padded tokens of a whole epoch for each.
(b) torch.compile (inductor, Accelerate's dynamo defaults: dynamic=None, so automatic dynamic shapes): from a fresh
    compile, one pass over the epoch's first batches for each padding choice: to the longest text (no bound),
    a multiple of 32 (the default under compile) and --max_seq_len (one shape). Recorded: graphs compiled and
    recompilations (torch._dynamo counters), the first pass's time (compiling included), then the steady step time.
    The compile arms run one after the other (each needs a fresh compiler cache): compare their steady times with care.

    python benchmarks/bench_padding.py --quick                  # generated headlines, tiny model, eager backend
    python benchmarks/bench_padding.py                          # THUCNews headlines from --data_root, 4x256 BERT
"""
import copy
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_bert_cls  # noqa: E402
from utils.demo_data import write_text_classification_data  # noqa: E402
from utils.text_batching import COMPILE_PAD_MULTIPLE, build_collator, tokenize  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

MODEL = "num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024"  # issue 18's headline run
TINY = "num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=256"
SEED = 42


def parse_args():
    parser = common.base_parser(__doc__)
    parser.add_argument("--batch_size", type=int, default=64, help="samples per step (issue 18's global batch)")
    parser.add_argument("--max_seq_len", type=int, default=64, help="tokens")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per arm and round")
    parser.add_argument("--compile_batches", type=int, default=None, help="batches of the compiled pass")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; with --quick, eager: dynamo traces and "
                             "recompiles exactly as under inductor, without minutes of code generation)")
    parser.add_argument("--skip_compile", action="store_true", help="only part (a)")
    return parser.parse_args()


def load_data(args, workdir):
    """(examples, model directory, config overrides): THUCNews headlines from --data_root, generated with --quick."""
    if not args.quick:  # a missing data root is an error, not a silent switch to generated text
        common.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese/config.json")
        return (read_examples(Path(args.data_root) / "thucnews_titles" / "train.txt")[:20_000],
                Path(args.data_root) / "bert-base-chinese", MODEL)
    data = write_text_classification_data(workdir, n_train=640 if args.quick else 8000, n_val=1, n_test=1)
    return read_examples(data / "train.txt"), data / "model", TINY if args.quick else MODEL


def build(examples, model_dir, overrides, max_seq_len):
    labels = build_label_list(examples)
    script_args = train_bert_cls.parse_args(["--model_name_or_path", str(model_dir), "--from_scratch",
                                             "--config_overrides", overrides, "--do_train"])
    torch.manual_seed(SEED)
    tokenizer, model = train_bert_cls.build_model(script_args, labels)
    label2id = {label: i for i, label in enumerate(labels)}
    dataset = tokenize(tokenizer, [e.text for e in examples], [label2id[e.label] for e in examples], max_seq_len)
    return tokenizer, model, dataset


def epoch_batches(dataset, batch_size):
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED))
    return [dataset[b.tolist()] for b in order.split(batch_size) if len(b) == batch_size]


def collate_all(tokenizer, batches, max_seq_len, **padding):
    """Every batch padded one way, collated up front: the arms time the model step only."""
    collator = build_collator(tokenizer, max_seq_len, **padding)
    return [collator([{k: v[i] for k, v in b.items()} for i in range(len(b["input_ids"]))]) for b in batches]


class Trainer:
    """A model copy with its own fused AdamW, stepping through its own padded batches."""

    def __init__(self, model, batches, compile_backend=None):
        self.model = copy.deepcopy(model).train()
        self.optimizer = torch.optim.AdamW(train_bert_cls.optimizer_groups(self.model, 0.01), lr=1e-4, fused=True)
        self.forward = torch.compile(self.model, backend=compile_backend) if compile_backend else self.model
        self.batches, self.position = batches, 0

    def step(self):
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        logits = self.forward(**{k: v for k, v in batch.items() if k != "labels"}).logits
        F.cross_entropy(logits.float(), batch["labels"]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def padded_tokens(batches):
    return sum(b["input_ids"].numel() for b in batches), sum(int(b["attention_mask"].sum()) for b in batches)


def cpu_padding(args, tokenizer, model, batches, rounds, steps):
    arms = {"pad to longest (CPU default)": {"pad_to_multiple_of": None},
            "pad to multiple of 8": {"pad_to_multiple_of": 8}}
    padded = {name: collate_all(tokenizer, batches, args.max_seq_len, **p) for name, p in arms.items()}
    trainers = {name: Trainer(model, padded[name]) for name in arms}
    for trainer in trainers.values():
        trainer.step()  # warm-up, untimed
    samples = common.run_rounds({name: common.timed(t.step, steps, args.batch_size) for name, t in trainers.items()},
                                rounds)
    baseline = next(iter(arms))
    summary = common.summarize(samples, baseline)
    rows = []
    for name in arms:
        computed, real = padded_tokens(padded[name])
        s = summary[name]
        rows.append([name, computed / len(batches), computed / real, 1000 * args.batch_size / s["median_rate"],
                     s["median_rate"], s["ratio_to_baseline"], s.get("cpu_ratio_to_baseline")])
        summary[name].update(tokens_per_batch=computed / len(batches), padding_overhead=computed / real)
    print(common.format_table(["arm", "tokens/batch", "computed/real tokens", "ms/step", "samples/s",
                               "x baseline", "x baseline (CPU time)"], rows))
    return summary


def graphs_compiled():
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def compiled_padding(args, tokenizer, model, batches, steps):
    import torch._dynamo

    arms = {"pad to longest (no bound)": {"pad_to_multiple_of": None},
            f"multiple of {COMPILE_PAD_MULTIPLE} (compile default)": {"pad_to_multiple_of": COMPILE_PAD_MULTIPLE},
            "pad to max_seq_len": {"pad_to_max_length": True}}
    results, rows = {}, []
    for name, padding in arms.items():
        padded = collate_all(tokenizer, batches, args.max_seq_len, **padding)
        torch._dynamo.reset()  # a fresh compiler: each arm pays for its own shapes
        from torch._dynamo.utils import counters
        counters.clear()
        trainer = Trainer(model, padded, compile_backend=args.backend)
        compiling_steps, stall_seconds = 0, 0.0  # steps that compiled a new graph (the first step, then recompiles)
        for _ in padded:
            graphs, start = graphs_compiled(), time.perf_counter()
            trainer.step()
            if graphs_compiled() > graphs:
                compiling_steps += 1
                stall_seconds += time.perf_counter() - start
        graphs = graphs_compiled()
        with common.Timer() as timer:  # every shape seen: no compiling any more (checked below)
            for _ in range(steps):
                trainer.step()
        assert graphs_compiled() == graphs, "the steady pass compiled again"
        lengths = sorted({b["input_ids"].shape[1] for b in padded})
        results[name] = {"distinct_lengths": len(lengths), "graphs": graphs, "recompiles": compiling_steps - 1,
                         "compiling_steps_seconds": stall_seconds, "steady_ms_per_step": 1000 * timer.wall / steps,
                         "batches": len(padded)}
        rows.append([name, len(lengths), graphs, compiling_steps - 1, stall_seconds,
                     results[name]["steady_ms_per_step"]])
        print(f"  {name}: {results[name]}")
    print(common.format_table(["arm", "distinct lengths", "graphs", "recompiles", "s in compiling steps",
                               "steady ms/step"], rows))
    return results


def main():
    args = parse_args()
    common.set_threads(args.threads)
    args.backend = args.backend or ("eager" if args.quick else "inductor")
    rounds = args.rounds or (2 if args.quick else 6)
    steps = args.steps or (3 if args.quick else 20)
    with tempfile.TemporaryDirectory() as workdir:
        examples, model_dir, overrides = load_data(args, workdir)
        tokenizer, model, dataset = build(examples, model_dir, overrides, args.max_seq_len)
    batches = epoch_batches(dataset, args.batch_size)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    print(f"{len(dataset)} texts, mean {sum(lengths) / len(lengths):.1f} tokens (max {max(lengths)}); "
          f"{len(batches)} batches of {args.batch_size}; model {overrides}")
    print("\n== (a) CPU, eager: pad to the longest text vs to a multiple of 8")
    payload = {"provenance": common.provenance(), "args": vars(args), "texts": len(dataset),
               "mean_tokens": sum(lengths) / len(lengths), "cpu": cpu_padding(args, tokenizer, model, batches,
                                                                            rounds, steps)}
    if not args.skip_compile:
        compile_batches = args.compile_batches or (6 if args.quick else min(len(batches), 60))
        print(f"\n== (b) torch.compile ({args.backend}): shapes compiled over {compile_batches} batches")
        payload["compile"] = compiled_padding(args, tokenizer, model, batches[:compile_batches],
                                              max(1, math.ceil(steps / 2)))
    common.write_results("bench_padding", payload, args.output)


if __name__ == "__main__":
    common.run_cli(lambda _: main(), None)
