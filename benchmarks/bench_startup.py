"""Start-up against data size: time to the first optimizer step and peak memory (peak RSS of the training process),
fresh and repeated, ours beside the transformers way and torchvision's ImageFolder.

BERT, on real THUCNews headlines (thucnews_titles/train.txt) replicated to each --sizes count, a tiny randomly
initialised model (the cost measured is the data's, not the model's):
  ours          train_bert_cls.py --do_train --max_train_steps 1, a fresh --data_cache_dir ("fresh") and the same again
                ("repeated": a resume, a requeue, a second run read the tokenised cache)
  transformers  run_classification.py's way: load_dataset("csv") + map(tokenizer, batched=True) into a fresh
                cache_dir, a DataLoader and one step; "repeated": the same with datasets' cache filled
ResNet, on imagenette_112/train hard-linked --image_copies times (real JPEGs, more files):
  ours          train_resnet.py -a resnet18 until its first logged step
  torchvision   ImageFolder of train and val (as torchvision's references list both before training) + DataLoader
                + resnet18, one step
Growth per example: the peak memory's slope between the smallest and the largest size. Usage:
    python benchmarks/bench_startup.py                                   # 45k and 450k headlines, 1x and 10x images
    python benchmarks/bench_startup.py --sizes 45000,450000,2000000 --image_copies 1,10,100
    python benchmarks/bench_startup.py --quick                           # seconds: 2,000 headlines, 200 images
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)
from harness import REPO as ROOT  # noqa: E402

TINY_BERT = "num_hidden_layers=1,hidden_size=64,num_attention_heads=2,intermediate_size=128"
MAX_SEQ_LEN = 64  # tokens: a headline is about 20 characters
BATCH = 32  # samples per step, both ways

TRANSFORMERS_WAY = """
import sys, torch
from pathlib import Path
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding
train_file, model_dir, cache_dir, marker, tiny, max_len, batch = sys.argv[1:8]
raw = load_dataset("csv", data_files={"train": train_file}, delimiter="\\t", column_names=["label", "text"],
                   quoting=3, cache_dir=cache_dir)["train"]
labels = sorted(raw.unique("label"))
label2id = {label: i for i, label in enumerate(labels)}
tokenizer = AutoTokenizer.from_pretrained(model_dir)

def encode(batch):
    encoded = tokenizer(batch["text"], truncation=True, max_length=int(max_len))
    encoded["labels"] = [label2id[label] for label in batch["label"]]
    return encoded

train = raw.map(encode, batched=True, remove_columns=["label", "text"])
config = AutoConfig.from_pretrained(model_dir, num_labels=len(labels))
config.update_from_string(tiny)
model = AutoModelForSequenceClassification.from_config(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = DataLoader(train, batch_size=int(batch), shuffle=True, collate_fn=DataCollatorWithPadding(tokenizer))
model(**next(iter(loader))).loss.backward()
optimizer.step()
Path(marker).write_text("first step")
"""

IMAGEFOLDER_WAY = """
import sys, torch, torchvision
from pathlib import Path
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
root, marker, batch = sys.argv[1:4]
transform = transforms.Compose([transforms.RandomResizedCrop(112), transforms.ToTensor()])
train = datasets.ImageFolder(root + "/train", transform)
val = datasets.ImageFolder(root + "/val", transforms.Compose([transforms.Resize(128), transforms.CenterCrop(112),
                                                              transforms.ToTensor()]))
model = torchvision.models.resnet18(num_classes=len(train.classes))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
images, targets = next(iter(DataLoader(train, batch_size=int(batch), shuffle=True)))
torch.nn.functional.cross_entropy(model(images), targets).backward()
optimizer.step()
Path(marker).write_text("first step")
"""


def peak_rss_mib(pid):
    """VmHWM, the process's peak resident memory so far (MiB); None once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def first_step_seen(marker):
    """Whether `marker` (a file, or metrics.jsonl holding a train event) says the first step is done."""
    if not marker.exists():
        return False
    return marker.suffix != ".jsonl" or '"event": "train"' in marker.read_text()


def measure(command, marker, threads, timeout=3600):
    """(seconds to the first step, peak RSS in MiB) of `command`; the process is stopped once the step is done."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in command], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak, seconds = 0.0, None
    while seconds is None and proc.poll() is None and time.perf_counter() - start < timeout:
        peak = max(peak, peak_rss_mib(proc.pid) or 0.0)
        if first_step_seen(marker):
            seconds = time.perf_counter() - start
        time.sleep(0.05)
    seconds = seconds or (time.perf_counter() - start if first_step_seen(marker) else None)
    proc.kill()
    _, err = proc.communicate()
    if seconds is None:
        raise SystemExit(f"no first step: {' '.join(map(str, command))}\n{err[-2000:]}")
    return seconds, peak


def replicate_lines(source, count, path):
    """`count` lines of `source`, repeated as often as needed."""
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, count, len(lines)):
            f.writelines(lines[:count - start])
    return path


def hard_linked_copies(source, copies, target, limit=None):
    """An ImageFolder of `copies` hard links to each image of `source` per class (the first `limit` images)."""
    for class_dir in sorted(p for p in Path(source).iterdir() if p.is_dir()):
        (target / class_dir.name).mkdir(parents=True)
        for image in sorted(class_dir.iterdir())[:limit]:
            for copy in range(copies):
                os.link(image, target / class_dir.name / f"{copy}_{image.name}")
    return target


def median_of_rounds(rounds, measure_round):
    """{arm: (median seconds, median MiB)} over `rounds` calls of measure_round(index) -> {arm: (seconds, MiB)}."""
    runs = [measure_round(index) for index in range(rounds)]
    return {arm: tuple(statistics.median(run[arm][i] for run in runs) for i in (0, 1)) for arm in runs[0]}


def bert_arms(data_root, train_file, work, threads):
    """{arm: (seconds, MiB)} for both ways, fresh then repeated, in a fresh `work` directory."""
    model = Path(data_root) / "bert-base-chinese"
    ours_cache, theirs_cache = work / "ours_cache", work / "datasets_cache"
    results = {}
    for start in ("fresh", "repeated"):
        out = work / f"ours_{start}"
        results[f"ours, {start}"] = measure(
            [sys.executable, "train_bert_cls.py", "--cpu", "--train_file", train_file, "--model_name_or_path", model,
             "--from_scratch", "--config_overrides", TINY_BERT, "--max_seq_len", MAX_SEQ_LEN, "--train_batch_size",
             BATCH, "--max_train_steps", 1, "--logging_steps", 1, "--do_train", "--data_cache_dir", ours_cache,
             "--output_dir", out], out / "metrics.jsonl", threads)
        marker = work / f"transformers_{start}.done"
        results[f"transformers, {start}"] = measure(
            [sys.executable, "-c", TRANSFORMERS_WAY, train_file, model, theirs_cache, marker, TINY_BERT, MAX_SEQ_LEN,
             BATCH], marker, threads)
    return results


def image_arms(image_root, work, threads):
    out, marker = work / "resnet", work / "imagefolder.done"
    return {
        "ours": measure([sys.executable, "train_resnet.py", "--cpu", image_root, "-a", "resnet18", "--image_size",
                         112, "-b", BATCH, "-j", 0, "-p", 1, "--epochs", 1, "--output_dir", out],
                        out / "metrics.jsonl", threads),
        "torchvision ImageFolder": measure([sys.executable, "-c", IMAGEFOLDER_WAY, image_root, marker, BATCH], marker,
                                           threads)}


def growth_per_example(by_size, arm):
    """KiB of peak memory per example between the smallest and the largest size."""
    sizes = sorted(by_size)
    if len(sizes) < 2:
        return None
    return (by_size[sizes[-1]][arm][1] - by_size[sizes[0]][arm][1]) * 1024 / (sizes[-1] - sizes[0])


def table(by_size, what):
    arms = list(next(iter(by_size.values())))
    rows = [[f"{size:,} {what}", arm, seconds, mib] for size, results in by_size.items()
            for arm, (seconds, mib) in results.items()]
    rows += [["growth", arm, None, f"{growth_per_example(by_size, arm):.2f} KiB per example"] for arm in arms
             if growth_per_example(by_size, arm) is not None]
    return harness.format_table(["data", "arm", "s to first step", "peak RSS MiB"], rows)


def main(argv=None):
    parser = harness.base_parser(__doc__)
    parser.add_argument("--sizes", default="45000,450000", help="headline counts, comma-separated ('': no BERT arms)")
    parser.add_argument("--image_copies", default="1,10",
                        help="hard links per imagenette_112/train image, comma-separated ('': no ResNet arms)")
    args = parser.parse_args(argv)
    harness.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese/vocab.txt")
    sizes = [2000] if args.quick else [int(size) for size in args.sizes.split(",") if size]
    copies = [1] if args.quick else [int(copy) for copy in args.image_copies.split(",") if copy]
    rounds = args.rounds or 1  # each a fresh start and a repeated one; the median of each arm is reported
    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    headlines = {}
    for size in sizes:
        train_file = replicate_lines(args.data_root / "thucnews_titles" / "train.txt", size, work / f"{size}.txt")
        headlines[size] = median_of_rounds(rounds, lambda index: bert_arms(
            args.data_root, train_file, work / f"bert_{size}_round{index}", args.threads))
        print(table({size: headlines[size]}, "headlines"), flush=True)
    images = {}
    if (args.data_root / "imagenette_112" / "train").is_dir():
        for copy in copies:
            root = work / f"images_x{copy}"
            for split in ("train", "val"):
                hard_linked_copies(args.data_root / "imagenette_112" / split, copy, root / split,
                                   limit=20 if args.quick else None)
            count = sum(1 for _ in (root / "train").rglob("*.*"))
            images[count] = median_of_rounds(rounds, lambda index: image_arms(
                root, work / f"resnet_x{copy}_round{index}", args.threads))
    if headlines:
        print(table(headlines, "headlines"))
    if images:
        print(table(images, "images"))
    harness.write_results("bench_startup", {
        "provenance": harness.provenance(), "threads": args.threads, "rounds": rounds, "work_dir": str(work),
        "headlines": {size: {arm: {"seconds_to_first_step": s, "peak_rss_mib": m} for arm, (s, m) in arms.items()}
                      for size, arms in headlines.items()},
        "images": {count: {arm: {"seconds_to_first_step": s, "peak_rss_mib": m} for arm, (s, m) in arms.items()}
                   for count, arms in images.items()},
        "growth_kib_per_example": {what: {arm: growth_per_example(by_size, arm) for arm in next(iter(by_size.values()))}
                                   for what, by_size in (("headlines", headlines), ("images", images)) if by_size}},
        args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
