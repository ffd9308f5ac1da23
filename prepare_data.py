"""Turn the published downloads of the real datasets into the layout the README's commands and the benchmarks read.

Nothing is downloaded here: fetch the files by hand (the URLs below, also in docs/data.md), then
    python prepare_data.py thucnews  DIR      # DIR = THUCNews/data of 649453932/Chinese-Text-Classification-Pytorch
    python prepare_data.py cnews     DIR      # DIR holds cnews.train.txt, cnews.val.txt, cnews.test.txt
    python prepare_data.py imagenette FILE    # imagenette2-160.tgz or imagenette2.tgz (or its extracted folder)
    python prepare_data.py bert      DIR      # a downloaded bert-base-chinese (config.json, vocab.txt)
Each writes under data/ (--out to choose), refuses to overwrite what is there, and checks what it wrote with
the readers the scripts use.
"""
import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

from utils.runtime import run_cli, UserError
from utils.text_data import find_split_file, read_examples

SOURCES = """Where the data comes from (download by hand, then run the matching command):
  thucnews    THUCNews headlines, 10 classes, text<TAB>label_id lines plus class.txt, in the folder THUCNews/data of
              https://github.com/649453932/Chinese-Text-Classification-Pytorch
              (e.g. https://github.com/649453932/Chinese-Text-Classification-Pytorch/archive/refs/heads/master.zip)
  cnews       THUCNews articles, 10 classes, label<TAB>text: cnews.train.txt / cnews.val.txt / cnews.test.txt as linked
              from https://github.com/gaussic/text-classification-cnn-rnn (its README: a Baidu pan share)
  imagenette  https://s3.amazonaws.com/fast-ai-imageclas/imagenette2-160.tgz (or imagenette2.tgz, full size),
              from https://github.com/fastai/imagenette
  bert        config.json and vocab.txt of https://huggingface.co/google-bert/bert-base-chinese, e.g.
              hf download google-bert/bert-base-chinese config.json vocab.txt --local-dir DIR"""
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}


def lines_of(path):
    """The file's lines, split at newlines only: str.splitlines would also split at characters such as U+2028 or
    U+001C, which occur inside headlines and in BERT vocabularies."""
    return [line.rstrip("\r") for line in path.read_text(encoding="utf-8").split("\n")]


def fresh_dir(out):
    """The output folder, which must not hold anything yet: nothing is overwritten."""
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: already exists and is not empty; remove it or pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def thucnews(source, out, train_samples=None):
    """text<TAB>label_id (ids index class.txt) -> label<TAB>text; dev.txt becomes val.txt."""
    classes_file = source / "class.txt"
    if not classes_file.is_file():
        raise UserError(f"{classes_file}: not found; pass the THUCNews/data folder (train.txt, dev.txt, test.txt, class.txt)")
    classes = [line.strip() for line in lines_of(classes_file) if line.strip()]
    converted = {}
    for name, target in (("train.txt", "train.txt"), ("dev.txt", "val.txt"), ("test.txt", "test.txt")):
        path, lines = source / name, []
        if not path.is_file():
            raise UserError(f"{path}: not found")
        for number, line in enumerate(lines_of(path), 1):
            if not line.strip():
                continue
            text, tab, label_id = line.rpartition("\t")  # headlines may hold spaces, never a TAB
            if not tab or not label_id.strip().isdigit() or int(label_id) >= len(classes) or not text.strip():
                raise UserError(f"{path}:{number}: expected 'text<TAB>label id' with an id below {len(classes)} "
                                f"(class.txt), found {line[:60]!r}")
            lines.append(f"{classes[int(label_id)]}\t{text.strip()}")
        converted[target] = lines[:train_samples] if target == "train.txt" and train_samples else lines
    out = fresh_dir(out)
    for target, lines in converted.items():
        (out / target).write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"{out / target}: {len(read_examples(out / target)):,} examples")


def cnews(source, out, sample_out, sample=1000):
    """cnews is already label<TAB>text: check each file with the scripts' reader and copy it; also write an evenly
    spaced sample of the training file (the benchmarks' cnews_sample/cnews_1000.txt)."""
    files = {split: find_split_file(source, split) for split in ("train", "validation", "test")}
    if files["train"] is None:
        raise UserError(f"{source}: no cnews.train.txt (or train.txt) there")
    for path in files.values():
        if path is not None:
            read_examples(path)  # a bad line stops here, named by file and line, before anything is written
    out = fresh_dir(out)
    for path in files.values():
        if path is not None:
            shutil.copyfile(path, out / path.name)
            print(f"{out / path.name}: copied")
    if sample:
        lines = [line for line in lines_of(files["train"]) if line.strip()]
        # cnews.train.txt is sorted by class: every k-th line keeps the classes balanced
        picked = lines[::max(1, len(lines) // sample)][:sample]
        fresh_dir(sample_out.parent)
        sample_out.write_text("\n".join(picked) + "\n", encoding="utf-8")
        print(f"{sample_out}: {len(read_examples(sample_out)):,} examples")


def imagenette(source, out, size=112, quality=90):
    """ImageFolder train/ and val/ with wnid folders, every image resized to size x size (aspect not kept, as in the
    shared imagenette_112), JPEG; grayscale images stay grayscale."""
    from PIL import Image

    def images():
        """(split, wnid, name, file object) for each image of the archive or folder."""
        if source.is_dir():
            for path in sorted(source.rglob("*")):
                if path.suffix.lower() in IMAGE_SUFFIXES and path.parent.parent.name in ("train", "val"):
                    yield path.parent.parent.name, path.parent.name, path.stem, path.open("rb")
            return
        try:
            with tarfile.open(source) as archive:
                for member in archive:
                    parts = Path(member.name).parts
                    if member.isfile() and Path(member.name).suffix.lower() in IMAGE_SUFFIXES and \
                            len(parts) >= 3 and parts[-3] in ("train", "val"):
                        yield parts[-3], parts[-2], Path(parts[-1]).stem, archive.extractfile(member)
        except (tarfile.TarError, OSError) as err:
            raise UserError(f"{source}: not a readable .tgz ({err})") from None

    if not source.exists():
        raise UserError(f"{source}: not found; pass imagenette2-160.tgz (or imagenette2.tgz, or its extracted folder)")
    out, count = fresh_dir(out), 0
    for split, wnid, stem, handle in images():
        with handle, Image.open(handle) as image:
            image = image if image.mode in ("L", "RGB") else image.convert("RGB")  # a few ImageNet JPEGs are CMYK
            (out / split / wnid).mkdir(parents=True, exist_ok=True)
            image.resize((size, size), Image.BICUBIC).save(out / split / wnid / f"{stem}.jpg", quality=quality)
        count += 1
    if not (out / "train").is_dir() or not (out / "val").is_dir():
        raise UserError(f"{source}: no train/<wnid>/ and val/<wnid>/ images found")
    print(f"{out}: {count:,} images, {size}x{size}")


def bert(source, out):
    """config.json + vocab.txt of a downloaded bert-base-chinese (a hub snapshot folder or a clone)."""
    for name in ("config.json", "vocab.txt"):
        if not (source / name).is_file():
            raise UserError(f"{source / name}: not found; pass the folder of a downloaded bert-base-chinese")
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{source / 'config.json'}:{err.lineno}: invalid JSON ({err.msg})") from None
    vocab = lines_of(source / "vocab.txt")
    vocab = vocab[:-1] if vocab and not vocab[-1] else vocab  # the final newline ends the last token
    if config.get("vocab_size") != len(vocab):
        raise UserError(f"{source / 'vocab.txt'}: {len(vocab):,} tokens, but config.json says vocab_size "
                        f"{config.get('vocab_size')}")
    out = fresh_dir(out)
    for name in ("config.json", "vocab.txt"):
        shutil.copyfile(source / name, out / name)
    print(f"{out}: config.json, vocab.txt ({len(vocab):,} tokens)")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=SOURCES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="dataset", required=True)
    for name, default, what in (("thucnews", "data/thucnews_titles", "the THUCNews/data folder"),
                                ("cnews", "data/cnews", "the folder with cnews.train.txt, cnews.val.txt, cnews.test.txt"),
                                ("imagenette", "data/imagenette_112", "imagenette2-160.tgz, imagenette2.tgz or its folder"),
                                ("bert", "data/bert-base-chinese", "a downloaded bert-base-chinese folder")):
        command = commands.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        command.add_argument("source", type=Path, help=what)
        command.add_argument("--out", type=Path, default=Path(default), help="folder to write (absent or empty: nothing is overwritten)")
    commands.choices["thucnews"].add_argument(
        "--train_samples", type=int, default=None,
        help="keep only the first N training lines (the README's timings used a 45,000-line training file)")
    commands.choices["cnews"].add_argument("--sample", type=int, default=1000,
                                           help="size of the evenly spaced training sample (0: none)")
    commands.choices["cnews"].add_argument("--sample_out", type=Path, default=Path("data/cnews_sample/cnews_1000.txt"),
                                           help="where the sample goes (the benchmarks read this path)")
    commands.choices["imagenette"].add_argument("--size", type=int, default=112, help="pixels, square")
    if not argv:
        parser.print_help()
        sys.exit(2)
    return parser.parse_args(argv)


def main(args):
    if args.dataset == "thucnews":
        thucnews(args.source, args.out, args.train_samples)
    elif args.dataset == "cnews":
        cnews(args.source, args.out, args.sample_out, args.sample)
    elif args.dataset == "imagenette":
        imagenette(args.source, args.out, args.size)
    else:
        bert(args.source, args.out)


if __name__ == "__main__":
    run_cli(main, parse_args(sys.argv[1:]))
