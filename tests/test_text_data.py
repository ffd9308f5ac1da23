"""utils.text_data: every format, every bad line named by file and line, deterministic label order."""
import json

import pytest

from utils.errors import UserError
from utils.text_data import (build_label_list, check_known_labels, find_split_file, read_examples, read_labels_file,
                             read_texts)


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
    assert read_texts(write(tmp_path / "p.txt", "第一条\n\n第二条\n")) == ["第一条", "第二条"]
    assert read_texts(write(tmp_path / "p.jsonl", '{"text": "甲"}\n{"text": "乙", "id": 3}\n')) == ["甲", "乙"]
