"""--export_onnx of both scripts: the selected model as ONNX with dynamic axes, checked by onnxruntime in a second
process (the test checks the reported numbers against its own onnxruntime run), int8 beside fp32, launched on 1 and 2
processes; the folder runs on its own in a fresh process (config.json, the tokenizer); onnx/onnxruntime missing is one
line."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import launch, pythonpath, read_json, run, run_here
from shared_image_runs import ONNX

from utils.export import load_torch_checkpoint
from train_resnet import val_transform
from utils.image_data import decode_rgb

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def onnxruntime_or_skip():
    return pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnx onnxruntime)")


def assert_reported_check(results, check, samples=100):
    """The results' onnx_* numbers are onnx_check.json's, fp32 matches PyTorch, int8 mostly agrees."""
    assert results["onnx_samples"] == check["samples"] == samples
    assert results["onnx_max_abs_diff"] == check["files"]["model.onnx"]["max_abs_diff"] < 1e-3
    assert results["onnx_top1_agreement"] == 1.0 and results["onnx_accuracy"] == results["onnx_torch_accuracy"]
    assert results["onnx_int8_top1_agreement"] >= 0.9, results
    assert results["onnx_int8_file_bytes"] < 0.5 * results["onnx_file_bytes"]
    assert results["onnx_ms_per_batch"] > 0 and results["onnx_int8_ms_one_sample"] > 0


@pytest.fixture(scope="module")
def resnet_run(digits_model):
    """model_best.pth of a 2-epoch run on the digits and its ONNX export (tests/shared_image_runs.py)."""
    onnxruntime_or_skip()
    return digits_model


def test_resnet_training_exports_the_best_model(resnet_run, digits_data):
    ort = onnxruntime_or_skip()
    check = read_json(resnet_run / "onnx" / "onnx_check.json")
    assert_reported_check(read_json(resnet_run / "all_results.json"), check)
    assert check["input_shapes"] == ["[36, 3, 16, 16]", "[64, 3, 16, 16]"]  # 100 = 64 + 36
    # the file is model_best.pth's model: onnxruntime on 3 images (a batch size never exported) = torchvision's forward
    export = load_torch_checkpoint(resnet_run / "model_best.pth")
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(export["state_dict"])
    sizes = {key: export[key] for key in ("val_resize", "val_crop_size", "interpolation")}
    transform = val_transform(type("Args", (), sizes))
    images = torch.stack([transform(decode_rgb(p)) for p in sorted((Path(digits_data) / "val").rglob("*.png"))[:3]])
    with torch.no_grad():
        expected = model.eval()(images).numpy()
    session = ort.InferenceSession(str(resnet_run / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"pixel_values": images.numpy()})[0]
    assert got.shape == (3, 10) and np.abs(got - expected).max() < 1e-3
    assert not (resnet_run / "onnx" / "check_inputs.npz").exists()


# A fresh process with the ONNX folder alone: its config.json says what each output is and how to preprocess
IMAGES_FROM_THE_FOLDER = """
import json, sys
from pathlib import Path
import numpy as np, onnxruntime, torch
from PIL import Image
from torchvision.transforms import v2
folder, files = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
config = json.loads((folder / "config.json").read_text())
pre = config["preprocessing"]
preprocess = v2.Compose([v2.ToImage(), v2.Resize(pre["resize"], interpolation=v2.InterpolationMode(pre["interpolation"]),
                                                 antialias=True), v2.CenterCrop(pre["center_crop"]),
                         v2.ToDtype(torch.float32), v2.Lambda(lambda x: x * pre["rescale_factor"]),
                         v2.Normalize(pre["mean"], pre["std"])])
pixels = np.stack([preprocess(Image.open(f).convert("RGB")).numpy() for f in files])
session = onnxruntime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
logits = session.run(["logits"], {"pixel_values": pixels})[0]
print(json.dumps([config["id2label"][str(i)] for i in logits.argmax(-1)]))
"""


def test_resnet_onnx_folder_runs_on_its_own(resnet_run, digits_data, tmp_path):
    """OUT/onnx copied elsewhere: a fresh process with its config.json and model.onnx alone labels the validation
    images with the accuracy the run reported for model_best.pth."""
    onnxruntime_or_skip()
    alone = shutil.copytree(resnet_run / "onnx", tmp_path / "alone")
    config = read_json(alone / "config.json")
    export = load_torch_checkpoint(resnet_run / "model_best.pth")
    assert config["id2label"] == {str(i): name for name, i in export["class_to_idx"].items()}
    assert config["trained_with"] == {key: export[key] for key in config["trained_with"]}
    files = sorted((Path(digits_data) / "val").rglob("*.png"))
    (tmp_path / "files.json").write_text(json.dumps([str(f) for f in files]))
    labels = json.loads(run(["python", "-c", IMAGES_FROM_THE_FOLDER, alone, tmp_path / "files.json"]).stdout)
    accuracy = 100 * sum(label == f.parent.name for label, f in zip(labels, files)) / len(files)
    assert accuracy == pytest.approx(read_json(resnet_run / "all_results.json")["best_acc1"], abs=1e-9)


def test_resnet_evaluate_exports_on_two_processes(resnet_run, digits_model_evaluated):
    """`-e --resume model_best.pth --export_onnx` on 2 processes (tests/shared_image_runs.py; its evaluation is
    tests/test_resnet.py's)."""
    out = digits_model_evaluated
    results = read_json(out / "eval_results.json")
    assert results["num_processes"] == 2
    assert_reported_check(results, read_json(out / "onnx" / "onnx_check.json"))
    trained = read_json(resnet_run / "all_results.json")
    assert results["onnx_torch_accuracy"] == trained["onnx_torch_accuracy"]  # the same model, the same 100 images
    assert read_json(out / "onnx" / "config.json") == read_json(resnet_run / "onnx" / "config.json")


# A fresh process with the ONNX folder alone, as optimum's ORTModelForSequenceClassification reads one: config.json,
# the tokenizer, model.onnx
TEXTS_FROM_THE_FOLDER = """
import json, sys
from pathlib import Path
import numpy as np, onnxruntime
from transformers import AutoConfig, AutoTokenizer
folder, texts = sys.argv[1], json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
session = onnxruntime.InferenceSession(f"{folder}/model.onnx", providers=["CPUExecutionProvider"])
batch = tokenizer(texts, truncation=True, padding=True, return_tensors="np")
logits = session.run(["logits"], {i.name: batch[i.name] for i in session.get_inputs()})[0]
probabilities = np.exp(logits - logits.max(-1, keepdims=True))
probabilities /= probabilities.sum(-1, keepdims=True)
print(json.dumps([[config.id2label[int(p.argmax())], float(p.max())] for p in probabilities], ensure_ascii=False))
"""


def test_bert_export_has_dynamic_batch_and_sequence_axes(text_data, tmp_path):
    ort = onnxruntime_or_skip()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "bert"
    launch("train_bert_cls.py", ["--data_dir", text_data, "--model_name_or_path", text_data / "model", "--from_scratch",
                                 "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "16",
                                 "--learning_rate", "2e-3", "--num_train_epochs", "1", "--do_train", "--do_eval",
                                 "--do_predict", "--predict_file", text_data / "test.txt", "--output_dir", out, *ONNX],
           num_processes=2)
    check = read_json(out / "onnx" / "onnx_check.json")
    assert_reported_check(read_json(out / "all_results.json"), check, samples=99)  # all 99 validation texts
    assert check["batch_sizes"] == [3, 16] and len({s.split(",")[1] for s in check["input_shapes"]}) > 1  # lengths
    # best_model/ in transformers = the ONNX file, on two texts of a length no check batch had
    tokenizer = AutoTokenizer.from_pretrained(out / "best_model")
    model = AutoModelForSequenceClassification.from_pretrained(out / "best_model").eval()
    texts = [line.split("\t", 1)[1] for line in (text_data / "test.txt").read_text(encoding="utf-8").splitlines()[:2]]
    batch = tokenizer(texts, padding="max_length", max_length=29, truncation=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).logits.numpy()
    session = ort.InferenceSession(str(out / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {k: v.numpy() for k, v in batch.items()})[0]
    assert np.abs(got - expected).max() < 1e-4
    # OUT/onnx copied elsewhere labels the texts to predict as the run did, with nothing but that folder
    alone = shutil.copytree(out / "onnx", tmp_path / "alone")
    assert read_json(alone / "config.json")["id2label"] == read_json(out / "best_model" / "config.json")["id2label"]
    assert read_json(alone / "trained_with.json") == read_json(out / "best_model" / "trained_with.json")
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text(encoding="utf-8").splitlines()]
    (tmp_path / "texts.json").write_text(json.dumps([row["text"] for row in rows], ensure_ascii=False),
                                         encoding="utf-8")
    labelled = json.loads(run(["python", "-c", TEXTS_FROM_THE_FOLDER, alone, tmp_path / "texts.json"]).stdout)
    assert [label for label, _ in labelled] == [row["label"] for row in rows]
    assert np.abs(np.array([score for _, score in labelled]) - [row["score"] for row in rows]).max() < 1e-4


@pytest.mark.parametrize("script, args", [
    ("train_resnet.py", ["DATA", "-e", "--resume", "m.pth"]),
    ("train_bert_cls.py", ["--do_eval", "--model_name_or_path", "m"]),
])
def test_missing_onnxruntime_is_one_line(tmp_path, digits_data, script, args):
    hidden = tmp_path / "site" / "onnxruntime"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'onnxruntime'\")\n")
    args = [str(digits_data) if a == "DATA" else a for a in args]
    proc = run(["python", script, *args, "--export_onnx", "--output_dir", tmp_path / "out"], check=False,
               env=pythonpath(tmp_path / "site"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("--export_onnx needs the optional packages onnx and onnxruntime (onnxruntime is not installed)"
            in proc.stderr)
    assert not (tmp_path / "out").exists()


def test_int8_needs_the_export(digits_data, tmp_path):
    proc = run_here("train_resnet.py", [digits_data, "--onnx_int8", "--output_dir", tmp_path], check=False)
    assert proc.returncode == 2 and "--onnx_int8 quantises the ONNX export: add --export_onnx" in proc.stderr
