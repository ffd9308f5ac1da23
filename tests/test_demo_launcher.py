"""demo.py trains in bf16 on a GPU that has it and fp16 on one that does not, on 1 GPU as on several."""
import pytest

import demo
from test_accelerate_configs import resolve_launch_args


@pytest.mark.parametrize("gpus", [1, 4])
@pytest.mark.parametrize("bf16, precision", [(True, "bf16"), (False, "fp16")])
def test_gpu_demo_precision(monkeypatch, gpus, bf16, precision):
    monkeypatch.setattr(demo.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(demo.torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    prefix, flags = demo.launcher()
    args = resolve_launch_args([*prefix[3:], "train_bert_cls.py"])  # after `python -m accelerate.commands.launch`
    assert args.mixed_precision == precision and args.num_processes == gpus and flags == []


def test_cpu_demo_stays_fp32_gloo_ddp(monkeypatch):
    monkeypatch.setattr(demo.torch.cuda, "device_count", lambda: 0)
    prefix, flags = demo.launcher()
    args = resolve_launch_args([*prefix[3:], "train_bert_cls.py"])
    assert args.mixed_precision == "no" and args.num_processes == 2 and flags == ["--cpu"]
