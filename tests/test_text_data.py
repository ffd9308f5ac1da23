"""text.data: every format, every bad line named by file and line, deterministic label order."""
import json

import pytest

from common.runtime import UserError
from text.data import build_label_list, check_known_labels, find_split_file, read_examples, read_labels_file, read_unlabelled, TextFormat


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
        return [example.text for example in read_unlabelled(path)]
    assert texts(write(tmp_path / "p.txt", "第一条\n\n第二条\n")) == ["第一条", "第二条"]
    assert texts(write(tmp_path / "p.jsonl", '{"text": "甲"}\n{"text": "乙", "id": 3}\n')) == ["甲", "乙"]


PAIRS = TextFormat(text_column="sentence1", text_pair_column="sentence2", label_column="tags")


def test_named_columns_and_sentence_pairs_in_csv_and_json(tmp_path):
    csv_path = write(tmp_path / "p.csv", "sentence1,sentence2,tags\n今天下雨,明天下雨,0\n股市,楼市,1\n")
    jsonl = write(tmp_path / "p.jsonl", '{"sentence1": "甲", "sentence2": "乙", "tags": 1, "id": 7}\n')
    assert [(e.text, e.text_pair, e.label) for e in read_examples(csv_path, fmt=PAIRS)] == [
        ("今天下雨", "明天下雨", "0"), ("股市", "楼市", "1")]
    assert [(e.text, e.text_pair, e.label) for e in read_examples(jsonl, fmt=PAIRS)] == [("甲", "乙", "1")]
    assert [(e.text, e.text_pair) for e in read_unlabelled(csv_path, PAIRS)] == [("今天下雨", "明天下雨"), ("股市", "楼市")]


def test_missing_columns_name_file_line_and_flag(tmp_path):
    with pytest.raises(UserError, match=r"p.csv:1: header lacks column\(s\) sentence2 \(--text_pair_column\)"):
        read_examples(write(tmp_path / "p.csv", "sentence1,tags\n甲,1\n"), fmt=PAIRS)
    with pytest.raises(UserError, match=r"p.jsonl:2: no field 'tags' \(--label_column\)"):
        read_examples(write(tmp_path / "p.jsonl", '{"sentence1": "甲", "sentence2": "乙", "tags": 1}\n'
                                                  '{"sentence1": "甲", "sentence2": "乙"}\n'), fmt=PAIRS)
    with pytest.raises(UserError, match=r"q.csv:3: no field 'sentence2'"):  # a short row
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
