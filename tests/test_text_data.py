"""utils.text_data: every format, every bad line named by file and line, deterministic label order."""
import json

import pytest
import torch

from utils.runtime import UserError
from utils.text_data import (build_label_list, check_known_labels, Example, find_split_file, read_examples, read_labels_file,
                       read_predict_file, split_files, TextFormat)
from utils.text_metrics import prediction_rows


def write(path, text, encoding="utf-8"):
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return path


def test_reads_cnews_tab_format_and_skips_blank_lines(tmp_path):
    path = write(tmp_path / "train.txt", "体育\t球队赢了\t还有一个TAB\n\n财经\t股市上涨\n")
    examples = read_examples(path)
    assert [(e.label, e.text) for e in examples] == [("体育", "球队赢了\t还有一个TAB"), ("财经", "股市上涨")]
    assert examples[1].where == f"{path}:3"


def test_reads_csv_and_json_lines_and_json_array(tmp_path):
    csv_path = write(tmp_path / "a.csv", 'label,text\n体育,"球队,赢了"\n财经,股市\n')
    jsonl = write(tmp_path / "a.jsonl", '{"label": "体育", "text": "球队"}\n{"label": "财经", "text": "股市"}\n')
    array = write(tmp_path / "a.json", json.dumps([{"label": "体育", "text": "球队"}], ensure_ascii=False))
    assert [(e.label, e.text) for e in read_examples(csv_path)] == [("体育", "球队,赢了"), ("财经", "股市")]
    assert [e.label for e in read_examples(jsonl)] == ["体育", "财经"]
    assert [e.text for e in read_examples(array)] == ["球队"]


def test_utf8_byte_order_mark_is_not_part_of_the_first_label(tmp_path):
    path = write(tmp_path / "t.txt", "\ufeff体育\t球队\n")
    assert read_examples(path)[0].label == "体育"


@pytest.mark.parametrize("content, message", [
    ("体育\t球队\n财经 股市上涨\n", ":2: expected 'label<TAB>text', found no TAB"),
    ("体育\t球队\n财经\t   \n", ":2: empty text"),
    ("体育\t球队\n\t股市\n", ":2: empty label"),
    ("", "no examples (the file is empty)"),
    (b"\xe4\xbd\x93\xe8\x82\xb2\tok\n\xff\xfe\tbad\n", ":2: not valid UTF-8"),
])
def test_bad_lines_name_file_and_line(tmp_path, content, message):
    path = write(tmp_path / "train.txt", content)
    with pytest.raises(UserError) as err:
        read_examples(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_json_and_csv(tmp_path):
    with pytest.raises(UserError, match=r"a.jsonl:2: invalid JSON"):
        read_examples(write(tmp_path / "a.jsonl", '{"label": "x", "text": "y"}\n{oops\n'))
    with pytest.raises(UserError, match=r"b.csv:1: header lacks column\(s\) label"):
        read_examples(write(tmp_path / "b.csv", "text\nhello\n"))
    with pytest.raises(UserError, match=r"c.jsonl:1: no field 'text' \(--text_column\)"):
        read_examples(write(tmp_path / "c.jsonl", '{"label": "x"}\n'))
    with pytest.raises(UserError, match="unsupported file type '.xml'"):
        read_examples(write(tmp_path / "d.xml", "<x/>"))
    with pytest.raises(UserError, match="missing.txt: file not found"):
        read_examples(tmp_path / "missing.txt")


def test_label_order_is_sorted_not_set_order(tmp_path):
    examples = read_examples(write(tmp_path / "t.txt", "娱乐\ta\n体育\tb\n财经\tc\n体育\td\n"))
    assert build_label_list(examples) == sorted(["娱乐", "体育", "财经"])


def test_labels_file_defines_order_and_must_cover_train(tmp_path):
    examples = read_examples(write(tmp_path / "t.txt", "b\tx\na\ty\n"))
    labels_file = write(tmp_path / "labels.txt", "b\na\nc\n")
    assert build_label_list(examples, labels_file) == ["b", "a", "c"]
    with pytest.raises(UserError, match=r"t.txt:2: label 'a' is not in .*short.txt"):
        build_label_list(examples, write(tmp_path / "short.txt", "b\n"))
    with pytest.raises(UserError, match="listed twice: a"):
        read_labels_file(write(tmp_path / "dup.txt", "a\nb\na\n"))


def test_unknown_label_in_validation_names_its_line(tmp_path):
    val = read_examples(write(tmp_path / "val.txt", "a\tx\nzzz\ty\n"))
    with pytest.raises(UserError, match=r"val.txt:2: label 'zzz' is not in"):
        check_known_labels(val, ["a", "b"])


def test_find_split_files_accepts_cnews_names(tmp_path):
    write(tmp_path / "cnews.train.txt", "a\tb\n")
    write(tmp_path / "val.txt", "a\tb\n")
    assert find_split_file(tmp_path, "train").name == "cnews.train.txt"
    assert find_split_file(tmp_path, "validation").name == "val.txt"
    assert find_split_file(tmp_path, "test") is None


def test_predict_texts_one_per_line_or_jsonl(tmp_path):
    def texts(path):
        return [(example.line, example.text, example.skipped) for example in read_predict_file(path)]
    assert texts(write(tmp_path / "p.txt", "第一条\n\n第二条\n")) == [
        (1, "第一条", None), (2, "", "blank line"), (3, "第二条", None)]
    assert texts(write(tmp_path / "p.jsonl", '{"text": "甲"}\n{"text": "乙", "id": 3}\n')) == [
        (1, "甲", None), (2, "乙", None)]


PAIRS = TextFormat(text_column="sentence1", text_pair_column="sentence2", label_column="tags")


def test_named_columns_and_sentence_pairs_in_csv_and_json(tmp_path):
    csv_path = write(tmp_path / "p.csv", "sentence1,sentence2,tags\n今天下雨,明天下雨,0\n股市,楼市,1\n")
    jsonl = write(tmp_path / "p.jsonl", '{"sentence1": "甲", "sentence2": "乙", "tags": 1, "id": 7}\n')
    assert [(e.text, e.text_pair, e.label) for e in read_examples(csv_path, fmt=PAIRS)] == [
        ("今天下雨", "明天下雨", "0"), ("股市", "楼市", "1")]
    assert [(e.text, e.text_pair, e.label) for e in read_examples(jsonl, fmt=PAIRS)] == [("甲", "乙", "1")]
    assert [(e.text, e.text_pair) for e in read_predict_file(csv_path, PAIRS)] == [("今天下雨", "明天下雨"), ("股市", "楼市")]
    assert [e.label for e in read_examples(csv_path, labelled=False, fmt=PAIRS)] == [None, None]


def test_missing_columns_name_file_line_and_flag(tmp_path):
    with pytest.raises(UserError, match=r"p.csv:1: header lacks column\(s\) sentence2 \(--text_pair_column\)"):
        read_examples(write(tmp_path / "p.csv", "sentence1,tags\n甲,1\n"), fmt=PAIRS)
    with pytest.raises(UserError, match=r"p.jsonl:2: no field 'tags' \(--label_column\)"):
        read_examples(write(tmp_path / "p.jsonl", '{"sentence1": "甲", "sentence2": "乙", "tags": 1}\n'
                                                  '{"sentence1": "甲", "sentence2": "乙"}\n'), fmt=PAIRS)
    with pytest.raises(UserError, match=r"q.csv:3: 2 fields, the header has 3"):  # a short row
        read_examples(write(tmp_path / "q.csv", "sentence1,tags,sentence2\n甲,1,乙\n甲,1\n"), fmt=PAIRS)
    with pytest.raises(UserError, match=r"p.txt: sentence pairs need a .csv or .json\(l\) file"):
        read_examples(write(tmp_path / "p.txt", "1\t甲\n"), fmt=PAIRS)


def test_multi_label_fields_lists_and_empty_sets(tmp_path):
    fmt = TextFormat(label_separator="|")
    txt = write(tmp_path / "m.txt", "体育|财经\t球队上市\n财经\t股市\n | \t无关的话\n")
    assert [e.label for e in read_examples(txt, fmt=fmt)] == [("体育", "财经"), ("财经",), ()]
    jsonl = write(tmp_path / "m.jsonl", '{"text": "甲", "label": ["b", "a", "b"]}\n{"text": "乙", "label": "a|c"}\n')
    examples = read_examples(jsonl, fmt=fmt)
    assert [e.label for e in examples] == [("a", "b"), ("a", "c")]
    assert build_label_list(examples) == ["a", "b", "c"]
    with pytest.raises(UserError, match=r"m.jsonl:2: label 'c' is not in"):
        check_known_labels(examples, ["a", "b"])


def test_encodings_gb18030_and_big5_and_a_gbk_file_read_as_utf8(tmp_path):
    gbk = write(tmp_path / "gbk.txt", "体育\t球队赢了\n财经\t股市上涨\n", encoding="gb18030")
    big5 = write(tmp_path / "big5.csv", "text,label\n球隊贏了,體育\n", encoding="big5")
    assert [e.text for e in read_examples(gbk, fmt=TextFormat(encoding="gb18030"))] == ["球队赢了", "股市上涨"]
    assert [e.label for e in read_examples(big5, fmt=TextFormat(encoding="big5"))] == ["體育"]
    with pytest.raises(UserError) as err:
        read_examples(gbk)
    message = str(err.value)
    assert message.startswith(f"{gbk}:1: not valid UTF-8") and "--encoding gb18030" in message and "\n" not in message
    with pytest.raises(UserError, match="--encoding latin-9x: unknown encoding"):
        read_examples(gbk, fmt=TextFormat(encoding="latin-9x"))
    with pytest.raises(UserError, match="--encoding utf-16: not supported"):
        read_examples(gbk, fmt=TextFormat(encoding="utf-16"))


# Files as the programs that wrote them meant them: pandas, the csv module, Excel, old Mac line ends.

TRICKY = ["他说\"你好\"，然后走了", "逗号,分号;和 TAB\t在一起", "两行\n文字", "  前后空格  ", "x" * 200_000]


def test_tsv_header_rows_written_by_pandas_name_the_columns(tmp_path):
    """DataFrame.to_csv(sep="\\t") writes a header row (and, unless index=False, an index column) and quotes texts
    holding quotes, TABs or line breaks: read back as pandas reads it, the header never a class."""
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"label": ["体育", "财经", "体育", "娱乐", "财经"], "text": TRICKY})
    for name, index in (("indexed.tsv", True), ("plain.txt", False)):
        path = tmp_path / name
        frame.to_csv(path, sep="\t", index=index)
        notes = []
        examples = read_examples(path, say=notes.append)
        assert [e.label for e in examples] == list(frame["label"])
        assert [e.text for e in examples] == [text.strip() for text in TRICKY]
        assert [e.line for e in examples] == [2, 3, 4, 6, 7]  # the record with a line break spans lines 4 and 5
        assert notes == [f"skipped the header row of {path}:1 ({'(index), ' if index else ''}label, text): its "
                         "columns are read by name, quoted fields as pandas and the csv module write them"]
        assert pd.read_csv(path, sep="\t")["text"].tolist() == TRICKY  # what pandas itself reads
    frame.rename(columns={"label": "category"}).to_csv(tmp_path / "renamed.tsv", sep="\t", index=False)
    with pytest.raises(UserError, match=r"renamed.tsv:1: header lacks column\(s\) label \(--label_column\)"):
        read_examples(tmp_path / "renamed.tsv")
    assert [e.label for e in read_examples(tmp_path / "renamed.tsv", fmt=TextFormat(label_column="category"))] == list(
        frame["label"])
    hand_made = write(tmp_path / "hand.tsv", 'label\ttext\n体育\t"快讯"球队\n')  # a header, then unquoted quotes
    with pytest.raises(UserError, match=r"hand.tsv:2: 'TAB' expected after '\"' .*remove the header row to read"):
        read_examples(hand_made)


def test_csv_records_are_read_from_the_raw_file(tmp_path):
    """Quoted commas, quotes and line breaks, a 200,000-character field, Excel's BOM and lone-CR line ends, from
    pandas and the csv module: every record comes back whole, numbered by the line it starts on."""
    import csv

    pd = pytest.importorskip("pandas")
    labels = ["体育", "财经", "体育", "娱乐", "财经"]
    pd.DataFrame({"label": labels, "text": TRICKY}).to_csv(tmp_path / "pandas.csv", index=False, encoding="utf-8-sig")
    with open(tmp_path / "mac.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\r")  # old Mac / some Excel exports: it quotes a \r, not a \n
        writer.writerows([["text", "label"], *zip([text.replace("\n", "\r") for text in TRICKY], labels)])
    for name in ("pandas.csv", "mac.csv"):
        examples = read_examples(tmp_path / name)
        assert [(e.label, e.text.replace("\r", "\n")) for e in examples] == [
            (label, text.strip()) for label, text in zip(labels, TRICKY)]
        assert [e.line for e in examples] == [2, 3, 4, 6, 7]
    predict = read_predict_file(tmp_path / "pandas.csv")
    assert [e.text for e in predict] == [text.strip() for text in TRICKY] and predict[0].label == "体育"


@pytest.mark.parametrize("content, message", [
    ('text,label\n"第一条,a\n第二条,b\n第三条,a\n', r"p.csv:2: a quoted field of this record is never closed"),
    ("text,label\n第一条,a\n你好,世界,b\n", r"p.csv:3: 3 fields, the header has 2 \(a field holding a ',', a quote"),
    ('text,label\n"引号"之后,体育\n', r"p.csv:2: ',' expected after '\"'"),
    (b"text,label\r\xe4\xbd\x93\xe8\x82\xb2,a\r\xff,b\r", r"p.csv:3: not valid UTF-8 \(invalid start byte at byte 0\)"),
])
def test_malformed_csv_names_its_line(tmp_path, content, message):
    path = write(tmp_path / "p.csv", content)
    for read in (read_examples, read_predict_file):
        with pytest.raises(UserError, match=message):
            read(path)


def test_lone_carriage_returns_end_lines_in_txt_files(tmp_path):
    path = write(tmp_path / "mac.txt", "体育\t球队赢了\r\r财经\t股市上涨\r")
    assert [(e.line, e.label, e.text) for e in read_examples(path)] == [(1, "体育", "球队赢了"), (3, "财经", "股市上涨")]
    with pytest.raises(UserError, match=r"bad.txt:3: not valid UTF-8 \(invalid start byte at byte 2\)"):
        read_examples(write(tmp_path / "bad.txt", b"a\tb\r\na\tc\rb\t\xff\n"))
    assert [e.text for e in read_predict_file(write(tmp_path / "p.txt", "第一条\r第二条\r"))] == ["第一条", "第二条"]


def test_predict_file_of_labelled_lines_predicts_on_the_texts(tmp_path):
    """A predict .txt whose every line starts with one of the model's labels and a TAB is the cnews format: the label
    is given, not read as part of the text. Other lines with TABs stay whole texts."""
    labels = ["体育", "财经"]
    notes = []
    path = write(tmp_path / "test.txt", "体育\t球队赢了\n\n财经\t股市\t上涨\n")
    examples = read_predict_file(path, labels=labels, say=notes.append)
    assert [(e.line, e.label, e.text, e.skipped) for e in examples] == [
        (1, "体育", "球队赢了", None), (2, None, "", "blank line"), (3, "财经", "股市\t上涨", None)]
    assert notes == [f"{path}: every line is 'label<TAB>text' with a label of the model: predicting on the texts "
                     "(the labels go to label_given)"]
    plain = write(tmp_path / "plain.txt", "标题\t正文\n体育\t球队\n")  # one line of two starts with a label: texts
    assert [(e.label, e.text) for e in read_predict_file(plain, labels=labels)] == [
        (None, "标题\t正文"), (None, "体育\t球队")]
    mostly = write(tmp_path / "mostly.txt", "体育\t球队\n财经\t股市\n汽车\t新车\n")
    with pytest.raises(UserError, match=r"mostly.txt:3: 2 of the 3 lines are 'label<TAB>text' with a label"):
        read_predict_file(mostly, labels=labels)


def test_prediction_rows_keep_every_input_record_in_order():
    examples = [Example("甲", "a", "p:1", line=1), Example("", None, "p:2", line=2, skipped="blank line"),
                Example("乙", None, "p:3", line=3)]
    rows = prediction_rows(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), examples, ["a", "b"], multi_label=False)
    assert [(r["line"], r["text"], r.get("label"), r.get("label_given"), r.get("skipped")) for r in rows] == [
        (1, "甲", "a", "a", None), (2, "", None, None, "blank line"), (3, "乙", "b", None, None)]
    with pytest.raises(ValueError, match="3 predictions for 2 texts"):
        prediction_rows(torch.zeros(3, 2), examples, ["a", "b"], multi_label=False)


def test_data_dir_finds_every_split_name_and_type(tmp_path):
    """CLUE's train.json/dev.json/test.json; two candidates for a split are an error naming both."""
    for name in ("train.json", "dev.json", "test.json"):
        write(tmp_path / name, '{"label": "1", "sentence": "甲"}\n')
    notes = []
    files = split_files(tmp_path, {"train": None, "validation": None, "test": tmp_path / "mine.csv"}, notes.append)
    assert files == {"train": tmp_path / "train.json", "validation": tmp_path / "dev.json", "test": tmp_path / "mine.csv"}
    assert notes == [f"--data_dir {tmp_path}: train {tmp_path / 'train.json'}, validation {tmp_path / 'dev.json'}, "
                     f"test {tmp_path / 'mine.csv'}"]
    write(tmp_path / "validation.tsv", "1\t乙\n")
    with pytest.raises(UserError, match=r"dev.json and validation.tsv are each a validation file; keep one of them "
                                        r"there, or name it with --validation_file"):
        find_split_file(tmp_path, "validation")


@pytest.mark.parametrize("content, message", [
    ("1\t甲\n0\t乙\n1.0\t丙\n", r"t.txt:1: label '1' and .*t.txt:3: label '1.0' are one number written two ways"),
    ('{"label": 1, "text": "甲"}\n{"label": true, "text": "乙"}\n', r"t.jsonl:1: label '1' and .*t.jsonl:2: label 'True'"),
])
def test_one_number_written_two_ways_is_not_two_classes(tmp_path, content, message):
    path = write(tmp_path / ("t.txt" if "\t" in content else "t.jsonl"), content)
    with pytest.raises(UserError, match=message):
        build_label_list(read_examples(path))
    labels_file = write(tmp_path / "labels.txt", "0\n1\n1.0\nTrue\n")  # listed apart: different classes on purpose
    assert build_label_list(read_examples(path), labels_file) == ["0", "1", "1.0", "True"]
    numbers = read_examples(write(tmp_path / "n.jsonl", '{"label": 2, "text": "甲"}\n{"label": "2", "text": "乙"}\n'))
    assert build_label_list(numbers) == ["2"]  # a JSON number and the same digits in a string: one class


def test_list_labels_need_multi_label(tmp_path):
    pd = pytest.importorskip("pandas")
    jsonl = write(tmp_path / "l.jsonl", '{"label": "a", "text": "甲"}\n{"label": ["a", "b"], "text": "乙"}\n')
    with pytest.raises(UserError, match=r"l.jsonl:2: the label \['a', 'b'\] is a list; pass --multi_label"):
        read_examples(jsonl)
    pd.DataFrame({"label": [["a", "b"], ["c"]], "text": ["甲", "乙"]}).to_csv(tmp_path / "l.csv", index=False)
    with pytest.raises(UserError, match=r"l.csv:2: the label \['a', 'b'\] is a list; pass --multi_label"):
        read_examples(tmp_path / "l.csv")
    multi = TextFormat(label_separator="|")  # pandas wrote the lists as Python does: their items are the labels
    assert [e.label for e in read_examples(tmp_path / "l.csv", fmt=multi)] == [("a", "b"), ("c",)]
    assert read_examples(write(tmp_path / "b.txt", "[体育]\t甲\n"))[0].label == "[体育]"  # brackets alone: a label


# ---- --dataset_name: datasets written by the real producers (save_to_disk, pandas' parquet), read offline ----

def bert_args(*extra):
    import train_bert_cls

    return train_bert_cls.parse_args(["--model_name_or_path", "m", *map(str, extra)])


def load(*extra):
    import train_bert_cls

    notes = []
    labels, examples = train_bert_cls.load_splits(bert_args(*extra), None, say=notes.append)
    return labels, examples, notes


NEWS = ["球队赢了比赛", "股市今天上涨", "新电影首映", "冠军进球", "银行利率下调", "明星演唱会"]


def test_dataset_dict_with_a_class_label_and_a_dev_split(tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["体育", "财经", "娱乐"])})
    DatasetDict(
        train=Dataset.from_dict({"sentence": NEWS, "label": [0, 1, 2, 0, 1, 2]}, features=features),
        dev=Dataset.from_dict({"sentence": NEWS[:2], "label": [0, 1]}, features=features),
        test=Dataset.from_dict({"sentence": NEWS[:3], "label": [-1, -1, -1]}, features=features),  # GLUE's unlabelled
    ).save_to_disk(str(tmp_path / "news"))
    labels, examples, notes = load("--dataset_name", tmp_path / "news", "--text_column_names", "sentence",
                                   "--do_train", "--do_predict")
    assert labels == ["体育", "财经", "娱乐"]  # the ClassLabel's order, not sorted
    assert [e.label for e in examples["train"]] == ["体育", "财经", "娱乐"] * 2
    assert [e.label for e in examples["validation"]] == ["体育", "财经"]  # "dev" is the validation split
    assert [e.text for e in examples["predict"]] == NEWS[:3] and examples["predict"][0].label is None
    assert notes[0] == (f"--dataset_name {tmp_path / 'news'}: train <- split 'train' (6 rows), validation <- split "
                        "'dev' (2 rows), predict <- split 'test' (its labels unused)")
    assert "ClassLabel names of column 'label', in the dataset's order" in notes[1]
    labels, examples, notes = load("--dataset_name", tmp_path / "news", "--do_train")  # run_classification's default
    assert [e.text for e in examples["train"]] == NEWS and notes[0] == (
        f"--text_column sentence: {tmp_path / 'news'} split 'train' has a 'sentence' field and no 'text' "
        "(run_classification.py's default text column)")
    with pytest.raises(UserError, match=r"news split 'test' row 0: label -1 \(no label; .*--do_predict"):
        load("--dataset_name", tmp_path / "news", "--text_column", "sentence", "--do_test")
    with pytest.raises(UserError, match=r"--validation_split_name valid: \S*news has no such split \(it has train, "
                                        r"dev, test\)"):
        load("--dataset_name", tmp_path / "news", "--validation_split_name", "valid", "--do_eval")


def test_a_sentence_column_is_the_text_where_there_is_no_text_column(tmp_path):
    """run_classification.py's files (a `sentence` column, no column flag) are read as it reads them, said once; a
    file with a `text` column too keeps reading `text`, and --text_column still chooses."""
    import pandas as pd

    frame = pd.DataFrame({"sentence": NEWS, "label": ["体育", "财经", "娱乐"] * 2})
    frame.to_csv(tmp_path / "train.csv", index=False)
    frame[:2].to_json(tmp_path / "dev.jsonl", orient="records", lines=True, force_ascii=False)
    _, examples, notes = load("--train_file", tmp_path / "train.csv", "--validation_file", tmp_path / "dev.jsonl",
                              "--do_train")
    assert [e.text for e in examples["train"]] == NEWS and [e.text for e in examples["validation"]] == NEWS[:2]
    assert [note for note in notes if "--text_column" in note] == [
        f"--text_column sentence: {tmp_path / 'train.csv'} has a 'sentence' field and no 'text' "
        "(run_classification.py's default text column)"]
    frame.assign(text=[f"{text}!" for text in NEWS]).to_csv(tmp_path / "both.csv", index=False)
    _, examples, notes = load("--train_file", tmp_path / "both.csv", "--do_train")
    assert examples["train"][0].text == f"{NEWS[0]}!" and not any("--text_column" in note for note in notes)
    _, examples, notes = load("--train_file", tmp_path / "both.csv", "--text_column", "sentence", "--do_train")
    assert examples["train"][0].text == NEWS[0] and not any("--text_column" in note for note in notes)


def test_saved_dataset_is_the_train_split_and_integer_labels_sort_numerically(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": NEWS, "label": [10, 2, 1, 10, 2, 1]}).save_to_disk(str(tmp_path / "ds"))
    labels, examples, notes = load("--dataset_name", tmp_path / "ds", "--do_train")
    assert labels == ["1", "2", "10"] and [e.label for e in examples["train"][:3]] == ["10", "2", "1"]
    assert examples["train"][4].where == f"{tmp_path / 'ds'} split 'train' row 4"
    assert notes[1] == "labels: the integers of column 'label', in numeric order"
    with pytest.raises(UserError, match=r"--do_eval needs a validation split: \S*ds has train \(--validation_split_na"):
        load("--dataset_name", tmp_path / "ds", "--do_train", "--do_eval")
    with pytest.raises(UserError, match=r"ds split 'train': no column 'sentence' \(--text_column\); it has text, lab"):
        load("--dataset_name", tmp_path / "ds", "--do_train", "--text_column", "sentence")


def test_bad_rows_name_the_split_and_row(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": ["好", " ", "坏"], "label": ["a", "b", "a"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(UserError, match=r"ds split 'train' row 1: empty text"):
        load("--dataset_name", tmp_path / "ds", "--do_train")
    Dataset.from_dict({"text": NEWS[:2], "score": [0.5, 1.5]}).save_to_disk(str(tmp_path / "floats"))
    with pytest.raises(UserError, match=r"floats split 'train': column 'score' holds float64 numbers: pass "
                                        "--do_regression"):
        load("--dataset_name", tmp_path / "floats", "--label_column", "score", "--do_train")
    labels, examples, _ = load("--dataset_name", tmp_path / "floats", "--label_column_name", "score", "--do_train",
                               "--do_regression")
    assert labels == ["score"] and [e.label for e in examples["train"]] == [0.5, 1.5]
    Dataset.from_dict({"text": NEWS[:2], "tags": [["a", "b"], []]}).save_to_disk(str(tmp_path / "tags"))
    with pytest.raises(UserError, match=r"tags split 'train': column 'tags' holds lists of labels: pass --multi_lab"):
        load("--dataset_name", tmp_path / "tags", "--label_column", "tags", "--do_train")
    labels, examples, _ = load("--dataset_name", tmp_path / "tags", "--label_column", "tags", "--do_train",
                               "--multi_label")
    assert labels == ["a", "b"] and [e.label for e in examples["train"]] == [("a", "b"), ()]


def test_parquet_files_written_by_pandas_with_joined_text_columns(tmp_path):
    import pandas as pd

    data = tmp_path / "reviews"
    data.mkdir()
    frame = pd.DataFrame({"title": ["好评", None, "差评"], "body": ["质量很好", "还行", "坏了"], "stars": [5, 3, 1]})
    frame.to_parquet(data / "train.parquet")
    frame.iloc[:2].to_parquet(data / "validation.parquet")
    cache = tmp_path / "cache"
    labels, examples, notes = load("--dataset_name", data, "--text_column_names", "title,body",
                                   "--text_column_delimiter", "|", "--label_column_name", "stars", "--do_train",
                                   "--cache_dir", cache)
    assert [e.text for e in examples["train"]] == ["好评|质量很好", "|还行", "差评|坏了"]  # a missing title joins as ""
    assert labels == ["1", "3", "5"] and len(examples["validation"]) == 2  # read for model selection
    assert any(cache.iterdir())  # load_dataset's arrow cache went to --cache_dir
    with pytest.raises(UserError, match=r"reviews split 'train': no column 'headline' \(--text_column_names\)"):
        load("--dataset_name", data, "--text_column_names", "headline,body", "--label_column", "stars",
             "--do_train", "--cache_dir", cache)


def test_a_hub_id_offline_is_one_line_naming_the_hub(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # HF_DATASETS_OFFLINE=1, read when datasets loads
    with pytest.raises(UserError) as err:
        load("--dataset_name", "nyu-mll/glue", "--dataset_config_name", "stsb", "--do_train", "--do_regression")
    message = str(err.value)
    assert message.startswith("--dataset_name nyu-mll/glue: cannot load (") and "needs the hub or its cache" in message
    assert "\n" not in message


def test_max_samples_cut_after_the_labels_and_shuffle_like_datasets(tmp_path):
    from datasets import Dataset

    rows = {"text": [f"第{i}条新闻" for i in range(20)], "label": ["a"] * 19 + ["z"]}
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    labels, examples, notes = load("--dataset_name", tmp_path / "ds", "--do_train", "--max_train_samples", "5")
    assert labels == ["a", "z"]  # "z" (row 19) is cut, but the model still gets its class
    assert [e.text for e in examples["train"]] == rows["text"][:5]
    assert "train: the first 5 of 20 examples" in notes
    _, shuffled, _ = load("--dataset_name", tmp_path / "ds", "--do_train", "--max_train_samples", "5",
                          "--shuffle_train_dataset", "--shuffle_seed", "3")
    # run_classification.py's train_dataset.shuffle(seed).select(range(N)), on the same rows
    expected = Dataset.from_dict(rows).shuffle(seed=3).select(range(5))["text"]
    assert [e.text for e in shuffled["train"]] == list(expected)


def test_regression_labels_in_files_and_a_bad_one_named(tmp_path):
    fmt = TextFormat(regression=True)
    path = write(tmp_path / "sts.csv", "text,label\n甲,0.5\n乙,4\n")
    assert [e.label for e in read_examples(path, fmt=fmt)] == [0.5, 4.0]
    with pytest.raises(UserError, match=r"bad.csv:3: label 'high' is not a number \(--do_regression\)"):
        read_examples(write(tmp_path / "bad.csv", "text,label\n甲,0.5\n乙,high\n"), fmt=fmt)
    with pytest.raises(UserError, match=r"nan.txt:1: label 'nan' is not a finite number"):
        read_examples(write(tmp_path / "nan.txt", "nan\t甲\n"), fmt=fmt)


@pytest.mark.parametrize("flags, message", [
    (["--dataset_name", "d", "--train_file", "t.csv", "--do_train"], "--dataset_name and --train_file are two sources"),
    (["--dataset_config_name", "stsb", "--train_file", "t.csv", "--do_train"], "--dataset_config_name needs --dat"),
    (["--train_file", "t.csv", "--do_train", "--max_train_samples", "0"], "--max_train_samples 0: must be at least"),
    (["--train_file", "t.csv", "--do_train", "--max_predict_samples", "9"], "--max_predict_samples: nothing of that"),
    (["--train_file", "t.csv", "--do_train", "--shuffle_seed", "1"], "--shuffle_seed needs --shuffle_train_dataset"),
    (["--train_file", "t.csv", "--do_train", "--text_column_delimiter", "|"], "--text_column_delimiter joins sev"),
    (["--train_file", "t.csv", "--do_train", "--do_regression", "--multi_label"], "cannot be combined with --multi"),
    (["--train_file", "t.csv", "--do_train", "--do_regression", "--label_smoothing", "0.1"], "--label_smoothing is"),
    (["--train_file", "t.csv", "--do_train", "--do_predict"], "--do_predict needs --predict_file, or a test split"),
])
def test_data_flags_that_cannot_work_are_refused_while_parsing(flags, message, capsys):
    with pytest.raises(SystemExit):
        bert_args(*flags)
    assert message in capsys.readouterr().err


def test_do_predict_without_a_predict_file_predicts_the_test_split(tmp_path):
    write(tmp_path / "train.txt", "体育\t甲\n财经\t乙\n")
    write(tmp_path / "test.txt", "财经\t丙\n\n体育\t丁\n")
    _, examples, _ = load("--data_dir", tmp_path, "--do_train", "--do_predict")
    assert [(e.text, e.label, e.line, e.skipped) for e in examples["predict"]] == [
        ("丙", "财经", 1, None), ("", None, 2, "blank line"), ("丁", "体育", 3, None)]  # labels kept as label_given
    write(tmp_path / "sts.tsv", "0.5\t甲\n4\t乙\n")
    write(tmp_path / "new.txt", "1.5\t丙\n2\t丁\n")  # every line a number, a TAB, a text: labelled
    _, examples, _ = load("--train_file", tmp_path / "sts.tsv", "--do_regression", "--do_train", "--do_predict",
                          "--predict_file", tmp_path / "new.txt")
    assert [(e.text, e.label) for e in examples["predict"]] == [("丙", 1.5), ("丁", 2.0)]
