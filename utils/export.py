"""The weights an export writes: the model's own parameter names, whatever wrapped it during training.

DDP/DataParallel add `module.`, torch.compile adds `_orig_mod.` (before every key when the whole model is
compiled, inside each block under regional compilation). A file with those names loads into a fresh model
as random weights with no error (transformers reports every weight MISSING and initialises it), so both
scripts export through `export_state_dict`, which also refuses to return anything a fresh model would not load.
"""
import torch

COMPILE_PREFIX = "_orig_mod."


def export_state_dict(accelerator, model, reference):
    """The full state dict of the prepared `model` under the names of `reference` (a freshly built model).

    Every rank must call it: under FSDP/DeepSpeed it gathers the shards (and only the main process gets the
    weights back; the others get an empty dict).
    """
    # get_state_dict gathers shards and strips DDP/FSDP/DeepSpeed, but unwraps with keep_torch_compile=True
    # (accelerate 1.15); the compiled wrapper's name is not part of the model, so it goes here.
    state_dict = accelerator.get_state_dict(model)
    state_dict = {key.replace(COMPILE_PREFIX, ""): value for key, value in state_dict.items()}
    if state_dict:
        check_same_keys(state_dict, reference)
    return state_dict


def check_same_keys(state_dict, reference):
    """Raise unless `state_dict` has exactly the keys of `reference`'s state dict (nothing would load as random)."""
    expected = set(reference.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise RuntimeError(f"refusing to export weights a fresh {type(reference).__name__} would not load: "
                           f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected "
                           f"(e.g. {unexpected[:2]})")


def on_meta_device(build):
    """build() without allocating or initialising weights: the reference only lends its parameter names."""
    with torch.device("meta"):
        return build()
