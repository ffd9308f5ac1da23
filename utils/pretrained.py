"""A sequence classifier from any hub checkpoint layout, refused if more than its head would start from random.

transformers reads every layout users bring (pytorch_model.bin with the Google conversions' LayerNorm
`gamma`/`beta`, safetensors, sharded safetensors with an index, MLM/NSP/discriminator heads that the
classifier drops) and maps the names; what it cannot map it initialises at random and only warns. A
classifier whose encoder starts from random weights trains to a poor model without any error, so here
a missing encoder weight is an error. A missing pooler is allowed (BertForMaskedLM saves have none).
"""
from transformers import AutoModelForSequenceClassification

from utils.errors import UserError

ALLOWED_NEW_IN_ENCODER = ("pooler.",)


def load_classifier(model_name_or_path, config, trust_remote_code=False):
    """AutoModelForSequenceClassification from the checkpoint, its head (and at most the pooler) newly initialised."""
    model, info = AutoModelForSequenceClassification.from_pretrained(
        model_name_or_path, config=config, ignore_mismatched_sizes=True,  # a fine-tuned head of another size
        trust_remote_code=trust_remote_code, output_loading_info=True)
    mismatched = {key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys", ())}
    new = sorted(set(info.get("missing_keys", ())) | mismatched)
    encoder = model.base_model_prefix + "."
    random_encoder = [key for key in new if key.startswith(encoder)
                      and not key[len(encoder):].startswith(ALLOWED_NEW_IN_ENCODER)]
    if random_encoder:
        raise UserError(f"{model_name_or_path}: {len(random_encoder)} encoder weights are not in the checkpoint "
                        f"and would start from random (e.g. {random_encoder[0]}); is it a {config.model_type} "
                        "checkpoint? (--from_scratch trains from random on purpose)")
    return model
