"""Make this CPU-only machine look like a 1-GPU box to torch, for tests of `--cpu` (put this folder on PYTHONPATH).

Like real CUDA, the device count is decided once, the first time anything asks, from CUDA_VISIBLE_DEVICES at that
moment: "" means no GPU, anything else one GPU. Code that then tries to use CUDA (set_device, lazy init, .cuda())
raises, so a `--cpu` run that touches CUDA in any way fails loudly instead of passing because there is no GPU.
"""
import gc
import os

# This file imports torch before the script does: it first sets the collector's thresholds as both scripts do before
# their imports (train_bert_cls.py, train_resnet.py), so that torch's import costs what it costs in a script's process.
gc.set_threshold(700, 10, 1000)

import torch  # noqa: E402

_count = []


def _device_count():
    if not _count:
        _count.append(0 if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else 1)
    return _count[0]


def _cuda_used(name):
    # one function per name: torch._dynamo refuses one object registered under two torch names
    def raise_(*args, **kwargs):
        raise RuntimeError(f"fake GPU: {name} was called in a --cpu run")
    return raise_


def _machine_accelerator():
    return torch.device("cuda") if _device_count() else torch.device("cpu")


torch.cuda.is_available = lambda: _device_count() > 0
torch.cuda.device_count = _device_count
torch.cuda.is_bf16_supported = lambda *a, **k: _device_count() > 0
torch._C._get_accelerator = _machine_accelerator  # torch.distributed.barrier picks its device from this
torch.accelerator.is_available = lambda: _device_count() > 0
torch.accelerator.device_count = _device_count
torch.accelerator.current_accelerator = lambda check_available=False: (
    torch.device("cuda") if _device_count() else None)
for name in ("set_device", "init", "_lazy_init", "current_device", "synchronize"):
    setattr(torch.cuda, name, _cuda_used(f"torch.cuda.{name}"))
torch.Tensor.cuda = _cuda_used("Tensor.cuda")
torch.nn.Module.cuda = _cuda_used("Module.cuda")
