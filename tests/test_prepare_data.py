"""prepare_data.py on tiny copies of the published formats: what it writes is what the scripts' readers accept."""
import io
import json
import tarfile

import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from conftest import ROOT, run
from prepare_data import main, parse_args
from utils.runtime import UserError
from utils.text_data import read_examples

CLASSES = ["财经", "房产", "股票"]


def prepare(*argv):
    main(parse_args([str(a) for a in argv]))


def write_thucnews(folder):
    """THUCNews/data as 649453932/Chinese-Text-Classification-Pytorch publishes it: text<TAB>label_id, class.txt."""
    folder.mkdir(parents=True)
    (folder / "class.txt").write_text("\n".join(CLASSES), encoding="utf-8")
    for name, n in (("train.txt", 6), ("dev.txt", 3), ("test.txt", 3)):
        # a headline may hold spaces; the label id is after the last TAB
        lines = [f"同步A股首秀 港股缩量回调{i}\t{i % 3}" for i in range(n)]
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def test_thucnews_becomes_label_tab_text(tmp_path):
    source, out = write_thucnews(tmp_path / "THUCNews" / "data"), tmp_path / "data" / "thucnews_titles"
    prepare("thucnews", source, "--out", out, "--train_samples", 4)
    assert sorted(p.name for p in out.iterdir()) == ["test.txt", "train.txt", "val.txt"]
    train = read_examples(out / "train.txt")
    assert [(e.label, e.text) for e in train[:2]] == [("财经", "同步A股首秀 港股缩量回调0"), ("房产", "同步A股首秀 港股缩量回调1")]
    assert len(train) == 4 and len(read_examples(out / "val.txt")) == 3
    with pytest.raises(UserError, match="already exists"):  # nothing is overwritten
        prepare("thucnews", source, "--out", out)


def test_thucnews_bad_label_id_names_file_and_line(tmp_path):
    source = write_thucnews(tmp_path / "data")
    (source / "dev.txt").write_text("好标题\t1\n坏标题\t7\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"dev\.txt:2: expected 'text<TAB>label id' with an id below 3"):
        prepare("thucnews", source, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cnews_is_checked_copied_and_sampled(tmp_path):
    source = tmp_path / "cnews"
    source.mkdir()
    for name, n in (("cnews.train.txt", 30), ("cnews.val.txt", 3), ("cnews.test.txt", 3)):
        # sorted by class, as published
        (source / name).write_text("".join(f"{CLASSES[i * 3 // n]}\t第{i}篇文章，正文。\n" for i in range(n)),
                                   encoding="utf-8")
    out, sample = tmp_path / "data" / "cnews", tmp_path / "data" / "cnews_sample" / "cnews_1000.txt"
    prepare("cnews", source, "--out", out, "--sample", 6, "--sample_out", sample)
    assert len(read_examples(out / "cnews.train.txt")) == 30 and (out / "cnews.test.txt").exists()
    assert [e.label for e in read_examples(sample)] == [c for c in CLASSES for _ in range(2)]


def test_imagenette_tgz_becomes_resized_imagefolder(tmp_path):
    archive = tmp_path / "imagenette2-160.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for split, wnid, name, mode in (("train", "n01440764", "n01440764_1.JPEG", "RGB"),
                                        ("train", "n02102040", "n02102040_7.JPEG", "L"),
                                        ("val", "n01440764", "ILSVRC2012_val_00000293.JPEG", "CMYK"),
                                        ("val", "n02102040", "n02102040_9.JPEG", "RGB")):
            data = io.BytesIO()
            Image.new(mode, (160, 213)).save(data, format="JPEG")
            info = tarfile.TarInfo(f"imagenette2-160/{split}/{wnid}/{name}")
            info.size = len(data.getvalue())
            tar.addfile(info, io.BytesIO(data.getvalue()))
        tar.addfile(tarfile.TarInfo("imagenette2-160/noisy_imagenette.csv"), io.BytesIO(b""))
    out = tmp_path / "data" / "imagenette_112"
    prepare("imagenette", archive, "--out", out, "--size", 24)
    for split in ("train", "val"):
        folder = ImageFolder(str(out / split))
        assert folder.classes == ["n01440764", "n02102040"] and len(folder) == 2
        assert all(folder[i][0].size == (24, 24) for i in range(2))
    assert Image.open(out / "train" / "n02102040" / "n02102040_7.jpg").mode == "L"  # grayscale stays grayscale
    with tarfile.open(archive) as tar:  # the unpacked folder gives the same
        tar.extractall(tmp_path / "unpacked", filter="data")
    prepare("imagenette", tmp_path / "unpacked" / "imagenette2-160", "--out", tmp_path / "from_folder", "--size", 24)
    assert sorted(p.relative_to(out) for p in out.rglob("*.jpg")) == \
        sorted(p.relative_to(tmp_path / "from_folder") for p in (tmp_path / "from_folder").rglob("*.jpg"))


def test_bert_files_are_checked_and_copied(tmp_path):
    source = tmp_path / "snapshot"
    source.mkdir()
    # bert-base-chinese's vocabulary holds tokens with characters str.splitlines would split at (U+2028, U+001C)
    (source / "vocab.txt").write_text("[PAD]\n[UNK]\n##\u2028\n\x1c\n", encoding="utf-8")
    (source / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 5}))
    with pytest.raises(UserError, match="4 tokens, but config.json says vocab_size 5"):
        prepare("bert", source, "--out", tmp_path / "bad")
    (source / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 4}))
    prepare("bert", source, "--out", tmp_path / "bert-base-chinese")
    assert sorted(p.name for p in (tmp_path / "bert-base-chinese").iterdir()) == ["config.json", "vocab.txt"]


def test_command_line_error_is_one_line(tmp_path):
    proc = run(["python", ROOT / "prepare_data.py", "imagenette", tmp_path / "missing.tgz"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {tmp_path / 'missing.tgz'}: not found; pass imagenette2-160.tgz " \
                                  "(or imagenette2.tgz, or its extracted folder)"
