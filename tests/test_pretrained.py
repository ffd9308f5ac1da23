"""Starting weights of train_resnet.py (utils/image_model.py): `-a timm:NAME --pretrained [PATH]` and torchvision's
`--weights NAME|PATH`, offline. The files are written as users get them: a timm model's state dict saved with
safetensors, a torchvision state dict saved with torch.save in main.py's checkpoint layout, and a Hugging Face hub
cache laid out as huggingface_hub lays it out (refs/main, snapshots/<revision>/model.safetensors)."""
import pytest
import torch
import torchvision
from conftest import one_thread, run_here
from safetensors.torch import save_file

import train_resnet
from utils.runtime import UserError

timm = pytest.importorskip("timm")


@pytest.fixture(autouse=True, scope="module")
def in_one_thread():
    """The in-process runs and models use one torch thread, as the launched runs (conftest's one_thread)."""
    with one_thread():
        yield


def parse(*argv):
    return train_resnet.parse_args(["--dummy", *argv])


def parameters(model_or_state_dict, reference=None):
    """The trainable weights (BatchNorm's running statistics are not), by name."""
    names = [name for name, _ in (reference or model_or_state_dict).named_parameters()]
    state_dict = model_or_state_dict if isinstance(model_or_state_dict, dict) else model_or_state_dict.state_dict()
    return {name: state_dict[name] for name in names}


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory):
    """timm's smallest ResNet, trained (here: seeded) for 5 classes, saved with safetensors."""
    torch.manual_seed(1)
    model = timm.create_model("test_resnet", num_classes=5)
    path = tmp_path_factory.mktemp("weights") / "test_resnet_5.safetensors"
    save_file(model.state_dict(), path)
    return path, model


def test_timm_pretrained_file_is_where_training_starts(timm_file, tmp_path):
    """With --lr 1e-12 (0 is refused) the exported weights are those the run started from, up to 1e-12 x a gradient:
    the file's, but for a new 1000-class head (--dummy data has 1000 classes, the file's head 5)."""
    path, source = timm_file
    out = tmp_path / "out"
    proc = run_here("train_resnet.py", ["--cpu", "--dummy", "64", "-a", "timm:test_resnet", "--pretrained", path,
                                        "--image_size", "32", "-b", "32", "--lr", "1e-12", "--wd", "0", "--momentum", "0",
                                        "-j", "0", "--epochs", "1", "--output_dir", out])
    assert f"{path}: its head predicts 5 classes, the data has 1000: the head starts new" in proc.stdout
    exported = torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"]
    started, loaded = parameters(exported, source), parameters(source)
    assert started.keys() == loaded.keys()
    moved = max((started[k] - loaded[k]).abs().max().item() for k in loaded if not k.startswith("fc."))
    assert moved < 1e-9, moved  # a random start differs by about the weights themselves (0.1)
    assert exported["fc.weight"].shape[0] == 1000


def test_evaluating_a_new_head_and_another_architecture_are_refused(timm_file, tmp_path):
    path, _ = timm_file
    with pytest.raises(UserError, match="its head predicts 5 classes, the data has 10; a new head would be random"):
        train_resnet.build_model(parse("-a", "timm:test_resnet", "--pretrained", path, "-e"), 10)
    other = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), other)
    with pytest.raises(UserError, match=rf"^{other}: weights do not fit this model \(Missing key"):
        train_resnet.build_model(parse("-a", "timm:test_resnet", "--pretrained", other), 10)
    with pytest.raises(UserError, match=rf"^{path}: weights do not fit this model"):
        train_resnet.build_model(parse("-a", "resnet18", "--weights", path), 10)


def test_torchvision_weights_from_a_file(tmp_path, capsys):
    """main.py's layout ({state_dict, arch, ...}): every weight loads; a 1000-class head gets a new 10-class one."""
    torch.manual_seed(2)
    source = torchvision.models.resnet18()
    path = tmp_path / "model_best.pth"
    torch.save({"state_dict": source.state_dict(), "arch": "resnet18", "epoch": 90}, path)
    model = train_resnet.build_model(parse("-a", "resnet18", "--weights", path), 10)
    assert f"{path}: its head predicts 1000 classes, the data has 10" in capsys.readouterr().out
    loaded, wanted = parameters(model), parameters(source)
    assert all(torch.equal(loaded[k], wanted[k]) for k in wanted if not k.startswith("fc."))
    assert model.fc.out_features == 10
    same_classes = train_resnet.build_model(parse("-a", "resnet18", "--pretrained", path, "-e"), 1000)
    assert all(torch.equal(w, wanted[k]) for k, w in parameters(same_classes).items())


def fake_hub_cache(root, repo_id, state_dict, revision="0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face hub cache entry as huggingface_hub writes it."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    save_file(state_dict, repo / "snapshots" / revision / "model.safetensors")


def test_timm_default_weights_from_the_hub_cache_offline(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError, match=rf"--pretrained: cannot get timm's test_resnet weights .*Hugging Face cache "
                                        rf"{tmp_path / 'empty'} \(HF_HUB_CACHE\).*needs the network"):
        train_resnet.build_model(parse("-a", "timm:test_resnet", "--pretrained"), 10)
    torch.manual_seed(3)
    published = timm.create_model("test_resnet")  # 1000 classes, as timm/test_resnet.r160_in1k
    fake_hub_cache(tmp_path / "hub", "timm/test_resnet.r160_in1k", published.state_dict())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = train_resnet.build_model(parse("-a", "timm:test_resnet", "--pretrained"), 10)
    assert "--pretrained: its head predicts 1000 classes, the data has 10" in capsys.readouterr().out
    loaded, wanted = parameters(model), parameters(published)
    assert all(torch.equal(loaded[k], wanted[k]) for k in wanted if not k.startswith("fc."))
    assert model.fc.out_features == 10


def test_drop_path_and_dropout(capsys):
    model = train_resnet.build_model(parse("-a", "timm:test_resnet", "--drop-path", "0.1", "--drop", "0.25"), 10)
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    assert rates and max(rates) == pytest.approx(0.1) and model.drop_rate == 0.25
    model = train_resnet.build_model(parse("-a", "efficientnet_b0", "--drop_path", "0.3", "--drop_rate", "0.4"), 10)
    assert model.classifier[0].p == 0.4  # torchvision's dropout
    assert max(m.p for m in model.modules() if type(m).__name__ == "StochasticDepth") < 0.3  # scaled by depth
    with pytest.raises(SystemExit):
        parse("-a", "resnet50", "--drop_path", "0.1")
    assert "torchvision's resnet50 takes no stochastic_depth_prob" in capsys.readouterr().err
    for flag, value in (("--drop_path", "1.5"), ("--drop", "-0.1")):  # probabilities: refused before the model
        with pytest.raises(SystemExit):
            parse("-a", "timm:test_resnet", flag, value)
        assert f"{flag} {float(value)}: must be in [0, 1)" in capsys.readouterr().err


def test_pretrained_flag_forms(tmp_path, capsys):
    args = train_resnet.parse_args(["-a", "resnet18", "--pretrained", "/data/imagenet"])  # main.py's order
    assert (str(args.data), args.weights) == ("/data/imagenet", "DEFAULT")
    assert parse("-a", "timm:test_resnet", "--pretrained").weights == "DEFAULT"
    for argv, message in ((["-a", "timm:test_resnet", "--weights", "ResNet50_Weights.IMAGENET1K_V2"],
                           "names torchvision weights; for a timm model pass --pretrained"),
                          (["--pretrained", "weights.json"], "PATH is a weights file (.safetensors, .pth"),
                          (["--pretrained", "--weights", "DEFAULT"], "both name the starting weights")):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert message in capsys.readouterr().err
    with pytest.raises(UserError, match=r"missing.pth: no such weights file"):  # files are read when the model is built
        train_resnet.build_model(parse("--pretrained", tmp_path / "missing.pth"), 10)
