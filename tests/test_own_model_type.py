"""A BERT with a head of one's own: a copy of train_bert_cls.py whose ADAPTATION SECTION defines a model type
transformers does not ship (`BertTextCNN`, model_type `bert_textcnn`) and registers it with the Auto classes trains,
and the model card's pipeline() snippet, run as printed in a fresh interpreter beside the copy, loads the model (the
snippet imports the copy, which registers the type) and predicts what the run predicted."""
import ast
import subprocess
import sys

from conftest import ENV, HANG_S, ROOT, pythonpath, read_jsonl, run_here

SCRIPT_NAME = "train_bert_cls_textcnn"  # the copy's own name: the card must name it, not train_bert_cls

TEXTCNN = '''
from torch import nn
from transformers import BertConfig, BertModel, BertPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class BertTextCNNConfig(BertConfig):
    model_type = "bert_textcnn"


class BertTextCNN(BertPreTrainedModel):
    """BERT's token states through convolutions 2 and 3 tokens wide, max-pooled over the text, then a linear head."""
    config_class = BertTextCNNConfig

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.convs = nn.ModuleList(nn.Conv1d(config.hidden_size, 16, width, padding=width - 1) for width in (2, 3))
        self.classifier = nn.Linear(2 * 16, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state  # (B, T, H)
        hidden = (hidden * attention_mask.unsqueeze(-1)).transpose(1, 2)  # (B, H, T), padding zeroed
        pooled = torch.cat([conv(hidden).amax(-1) for conv in self.convs], -1)  # (B, 32)
        return SequenceClassifierOutput(logits=self.classifier(pooled))


AutoConfig.register("bert_textcnn", BertTextCNNConfig, exist_ok=True)
AutoModelForSequenceClassification.register(BertTextCNNConfig, BertTextCNN, exist_ok=True)


def as_textcnn(config):
    return BertTextCNNConfig.from_dict({**config.to_dict(), "model_type": "bert_textcnn"})


def new_model(config, trust_remote_code=False):
    return BertTextCNN(as_textcnn(config))


def load_model(path, config, trust_remote_code=False, hub=None):
    text_model.check_weight_files(path)
    model, info = BertTextCNN.from_pretrained(path, config=as_textcnn(config), ignore_mismatched_sizes=True,
                                              output_loading_info=True, **(hub or {}))
    return model, text_model.new_weight_names(info)
'''


def textcnn_copy(directory):
    """train_bert_cls.py copied to directory/SCRIPT_NAME.py, its new_model and load_model replaced by TEXTCNN's
    classes, registration and functions, as a user edits the ADAPTATION SECTION (found by the syntax tree)."""
    text = (ROOT / "train_bert_cls.py").read_text(encoding="utf-8")
    functions = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
    new, load = functions["new_model"], functions["load_model"]
    assert load.lineno > new.end_lineno, "train_bert_cls.py: load_model no longer follows new_model"
    lines = text.splitlines(keepends=True)
    lines[new.lineno - 1:load.end_lineno] = [TEXTCNN.lstrip("\n")]
    path = directory / f"{SCRIPT_NAME}.py"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def card_snippet(best):
    return (best / "README.md").read_text(encoding="utf-8").split("```python\n")[1].split("```")[0]


def fresh_python(code, cwd):
    """`code` in a new interpreter in `cwd`, with this repository's utils/ importable (as beside the script)."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**ENV, **pythonpath(ROOT)}, capture_output=True,
                          text=True, timeout=HANG_S)


def test_the_model_card_of_an_own_model_type_loads_it_in_a_fresh_process(text_data, tmp_path, monkeypatch):
    script = textcnn_copy(tmp_path)
    first_val = (text_data / "val.txt").read_text(encoding="utf-8").splitlines()[0].split("\t", 1)[1]
    predict_file = tmp_path / "texts.txt"
    predict_file.write_text(first_val + "\n", encoding="utf-8")
    out = tmp_path / "out"
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        run_here(script.name, ["--cpu", "--data_dir", text_data, "--model_name_or_path", text_data / "model",
                               "--from_scratch", "--max_seq_len", "32", "--train_batch_size", "16",
                               "--max_train_steps", "4", "--do_train", "--do_predict", "--predict_file", predict_file,
                               "--output_dir", out])
    finally:
        sys.modules.pop(script.stem, None)
    best = out / "best_model"
    snippet = card_snippet(best)
    assert snippet.startswith(f"import {SCRIPT_NAME}  # registers the model type \"bert_textcnn\""), snippet
    card = (best / "README.md").read_text(encoding="utf-8")
    assert f"python {SCRIPT_NAME}.py --model_name_or_path" in card and "python train_bert_cls.py" not in card
    proc = fresh_python(snippet, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [predicted] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    [row] = read_jsonl(out / "predictions.jsonl")  # the card's text is the first validation text
    assert row["text"] == first_val and predicted["label"] == row["label"]
    assert abs(predicted["score"] - row["score"]) < 1e-5
    # without the import, transformers does not know the type: what the card's first line is for
    proc = fresh_python(snippet.split("\n", 1)[1], cwd=tmp_path)
    assert proc.returncode != 0 and "bert_textcnn" in proc.stderr, proc.stderr[-3000:]
