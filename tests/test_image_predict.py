"""train_resnet.py --predict: predictions.jsonl for folders and lists of unlabelled images, on 1 and 2 processes,
against the exported model's own forward pass."""
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import read_jsonl, run_here, run_on

from utils.export import load_torch_checkpoint
from train_resnet import val_transform
from utils.image_data import decode_rgb

SCRIPT = "train_resnet.py"
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def model_best(digits_model):
    """model_best.pth of a 2-epoch run on the 16x16 digits (its sizes: 16 pixels, not torchvision's 224), shared with
    tests/test_onnx_export.py (tests/shared_image_runs.py)."""
    return digits_model / "model_best.pth"


@pytest.fixture(scope="module")
def inputs(digits_data, tmp_path_factory):
    """(the --predict arguments, the files in input order, the unreadable ones): the val/ folder (449 images in
    class folders), a list file naming an image, a missing file, a broken PNG and a text file, and one image."""
    here = tmp_path_factory.mktemp("to_predict")
    broken = here / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    notes = here / "notes.md"
    notes.write_text("not an image\n")
    folder = Path(digits_data) / "val"
    images = sorted(str(p) for p in folder.rglob("*.png"))
    listed = [images[7], str(here / "missing.png"), str(broken), str(notes)]
    listing = here / "list.txt"
    listing.write_text("\n".join([listed[0], "", *listed[1:]]) + "\n")  # a blank line is no entry
    single = images[3]
    return [folder, listing, single], [*images, *listed, single], set(listed[1:])


def reference_predictions(model_best, files, topk):
    """Each readable file's top-k (labels, probabilities) from a plain torchvision model loaded from the export, with
    the validation transform at the sizes the export records."""
    export = load_torch_checkpoint(model_best)
    model = torchvision.models.get_model(export["arch"], num_classes=len(export["class_to_idx"]))
    model.load_state_dict(export["state_dict"])
    model.eval()
    settings = {key: export[key] for key in ("val_resize", "val_crop_size", "interpolation")}
    transform = val_transform(type("Args", (), settings))
    labels = sorted(export["class_to_idx"], key=export["class_to_idx"].get)
    with torch.no_grad():
        batch = torch.stack([transform(decode_rgb(f)) for f in files])
        top = model(batch).softmax(dim=-1).topk(topk, dim=-1)
    return {f: ([labels[c] for c in classes], scores)
            for f, classes, scores in zip(files, top.indices.tolist(), top.values.tolist())}


@pytest.mark.parametrize("n", [1, 2])
def test_predict_rows_in_input_order_match_the_models_forward(model_best, inputs, tmp_path, n):
    args, files, unreadable = inputs
    out = tmp_path / "out"
    # -b 64 over 454 files: the last batch is short, and on 2 processes padded with duplicates
    proc = run_on(n, SCRIPT, ["--predict", *args, "--resume", model_best, "--topk", "3", "-b", "64", "-j", "0",
                              "--output_dir", out])
    rows = read_jsonl(out / "predictions.jsonl")
    assert [row["file"] for row in rows] == files
    assert {row["file"] for row in rows if "skipped" in row} == unreadable
    missing = next(row for row in rows if row["file"].endswith("missing.png"))
    assert missing["skipped"].startswith("unreadable image (FileNotFoundError")
    readable = [f for f in files if f not in unreadable]
    expected = reference_predictions(model_best, readable, topk=3)
    for row in rows:
        if "skipped" in row:
            continue
        labels, scores = expected[row["file"]]
        assert [t["label"] for t in row["topk"]] == labels, row
        assert [t["score"] for t in row["topk"]] == pytest.approx(scores, abs=1e-5), row
        assert (row["label"], row["score"]) == (row["topk"][0]["label"], row["topk"][0]["score"])
    assert f"wrote {len(readable)} predictions and 3 rows for unreadable files" in proc.stdout
    # the export records 16-pixel sizes: predicted at them, not at torchvision's 224/256 defaults
    assert "was trained with --image_size 16, --val_resize 16" in proc.stdout


def test_predictions_stream_a_batch_at_a_time(model_best, inputs, tmp_path, monkeypatch):
    """Memory bounded for any number of images: the rows are made from one gathered batch at a time (never from
    every image's top-k at once), in input order."""
    args, files, _ = inputs
    from utils import image_data

    sizes, real = [], image_data.prediction_rows

    def counted(dataset, first, items, *rest):
        sizes.append(len(items))
        return real(dataset, first, items, *rest)
    monkeypatch.setattr(image_data, "prediction_rows", counted)
    run_here(SCRIPT, ["--predict", *args, "--resume", model_best, "--topk", "1", "-b", "64", "-j", "0",
                      "--output_dir", tmp_path / "out"])
    assert sizes == [64] * 7 + [6]  # 454 files in batches of 64
    assert [row["file"] for row in read_jsonl(tmp_path / "out" / "predictions.jsonl")] == files


def test_topk_is_capped_at_the_class_count(model_best, inputs, tmp_path):
    args, files, _ = inputs
    run_here(SCRIPT, ["--predict", args[2], "--resume", model_best, "--topk", "50", "-j", "0",
                      "--output_dir", tmp_path])
    (row,) = read_jsonl(tmp_path / "predictions.jsonl")
    assert len(row["topk"]) == 10 and sum(t["score"] for t in row["topk"]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("extra, message", [
    ([], "--predict needs the trained model's export: --resume FILE"),
    (["--resume", "MODEL", "-a", "resnet50"], "checkpoint's arch: 'resnet18'; this run's: 'resnet50'"),
    (["--resume", "MODEL", "-e"], "--predict and -e/--evaluate: one at a time"),
    (["--resume", "MODEL", "DATA"], "--predict labels the images it names; it takes no data directory"),
    (["--resume", "BARE"], "records no class names"),
    (["--resume", "latest"], "--resume latest: no such file; --predict needs the trained model's export"),
])
def test_bad_predict_commands_are_one_line(model_best, inputs, tmp_path, extra, message):
    bare = tmp_path / "bare.pth"
    torch.save(load_torch_checkpoint(model_best)["state_dict"], bare)  # torch.save(model.state_dict()): no classes
    names = {"MODEL": str(model_best), "BARE": str(bare), "DATA": str(inputs[0][0])}
    proc = run_here(SCRIPT, ["--predict", inputs[0][2], *[names.get(a, a) for a in extra], "--output_dir",
                             tmp_path / "out"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "predictions.jsonl").exists()


def test_missing_folder_is_one_line(model_best, tmp_path):
    proc = run_here(SCRIPT, ["--predict", tmp_path / "nowhere", "--resume", model_best, "--output_dir",
                             tmp_path / "out"], check=False)
    assert proc.returncode == 2 and f"--predict {tmp_path / 'nowhere'}: no such file or directory" in proc.stderr
