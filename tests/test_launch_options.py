"""ResNet launched from `accelerate config default`'s file with bf16 on 2 processes (BERT's such runs are shared with
tests/test_metric_flag.py and tests/test_hub_checkpoints.py): the exports still load in plain torchvision."""
import torch
from conftest import read_json
from launch_options import default_config, launch_with_config


def test_resnet_fp16_two_processes_from_a_default_config_file(digits_data, tmp_path):
    """(Not bf16: ResNet-18 in CPU bf16 autocast turned NaN at random in 2 of 4 seeded runs on an AMD EPYC without
    AMX, on this tree and on the one before it: a CPU kernel's doing, not reproducible; BERT covers CPU bf16.)"""
    import torchvision

    out = tmp_path / "out"
    launch_with_config(default_config(tmp_path / "fp16.json", "fp16"), "train_resnet.py", [
        digits_data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.05",
        "-j", "0", "-p", "5", "--epochs", "1", "--output_dir", out], num_processes=2)
    results = read_json(out / "all_results.json")
    # fp16 on the CPU trains in fp32, and the results say so
    assert (results["num_processes"], results["mixed_precision"], results["mixed_precision_requested"]) == (
        2, "no", "fp16")
    assert results["eval_samples"] == 449 and torch.isfinite(torch.tensor(results["eval_loss"]))
    state_dict = torch.load(out / "model_best.pth", weights_only=True)["state_dict"]
    assert {w.dtype for w in state_dict.values() if w.is_floating_point()} == {torch.float32}
    torchvision.models.resnet18(num_classes=10).load_state_dict(state_dict)  # strict: every key, no prefix
