"""Tests for oppo.data: reading prompt sets, tokenising them, and the seeded prompt stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_tokenizer
from oppo.config import DataConfig
from oppo.data import DataError, PromptSet, build_prompt_set, read_jsonl, read_prompts


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def ds_cache(tmp_path, monkeypatch):
    """Keep the `datasets` cache of these tests out of the user's home."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return tmp_path


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# --------------------------------------------------------------------------- JSONL

def test_jsonl_default_field(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "the film was", "id": 1}, {"prompt": "a day"}])
    assert read_prompts(str(p)) == ["the film was", "a day"]
    assert read_jsonl(p, "prompt") == ["the film was", "a day"]


def test_jsonl_custom_field_and_blank_lines(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question": "why"}\n\n   \n{"question": "how", "prompt": 3}\n')
    assert read_prompts(str(p), field="question") == ["why", "how"]


def test_json_suffix_with_jsonl_content(tmp_path):
    p = _jsonl(tmp_path / "lines.json", [{"text": "one"}, {"text": "two"}])
    assert read_prompts(str(p), field="text") == ["one", "two"]


def test_malformed_json_line_names_file_and_line(tmp_path):
    p = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "ok too"}, '{"prompt": "oops"'])
    with pytest.raises(DataError) as info:
        read_prompts(str(p))
    assert f"{p}:3:" in str(info.value) and "not valid JSON" in str(info.value)


def test_missing_field_names_file_line_and_setting(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"text": "no prompt here"}])
    with pytest.raises(DataError) as info:
        read_prompts(str(p))
    msg = str(info.value)
    assert f"{p}:2:" in msg and "'prompt'" in msg and "data.field" in msg


def test_non_object_line(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", ['"just a string"'])
    with pytest.raises(DataError, match=r"p\.jsonl:1:"):
        read_prompts(str(p))


@pytest.mark.parametrize("value, kind", [(3, "int"), (None, "NoneType"), (["a"], "list")])
def test_non_string_field(tmp_path, value, kind):
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": value}])
    with pytest.raises(DataError) as info:
        read_prompts(str(p))
    msg = str(info.value)
    assert f"{p}:2:" in msg and "must be a string" in msg and kind in msg


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(tmp_path, text):
    p = tmp_path / "empty.jsonl"
    p.write_text(text)
    with pytest.raises(DataError, match="empty"):
        read_prompts(str(p))


def test_missing_jsonl(tmp_path):
    with pytest.raises(DataError) as info:
        read_prompts(str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in str(info.value) and "not found" in str(info.value)


# --------------------------------------------------------------------------- files `datasets` loads

def test_csv(ds_cache):
    p = ds_cache / "p.csv"
    p.write_text('prompt,label\nthe film was,1\n"a day, then",0\n')
    assert read_prompts(str(p)) == ["the film was", "a day, then"]


def test_csv_missing_column_lists_columns(ds_cache):
    p = ds_cache / "p.csv"
    p.write_text("question,label\nwhy,1\n")
    with pytest.raises(DataError) as info:
        read_prompts(str(p))
    msg = str(info.value)
    assert "'prompt'" in msg and "question" in msg and "label" in msg and "data.field" in msg
    assert read_prompts(str(p), field="question") == ["why"]


def test_csv_empty_cell_is_an_error(ds_cache):
    p = ds_cache / "p.csv"
    p.write_text("prompt,label\nfine,1\n,0\n")
    with pytest.raises(DataError, match="no value"):
        read_prompts(str(p))


def test_json_array(ds_cache):
    p = ds_cache / "arr.json"
    p.write_text(json.dumps([{"text": "one", "n": 1}, {"text": "two", "n": 2}], indent=1))
    assert read_prompts(str(p), field="text") == ["one", "two"]
    with pytest.raises(DataError, match=r"no column 'prompt' \(it has (text, n|n, text)\)"):
        read_prompts(str(p))


def test_saved_dataset_directory(ds_cache):
    import datasets

    d = ds_cache / "saved"
    datasets.Dataset.from_dict({"query": ["a b", "c"], "score": [1, 2]}).save_to_disk(str(d))
    assert read_prompts(str(d), field="query") == ["a b", "c"]
    with pytest.raises(DataError) as info:
        read_prompts(str(d))
    assert "query" in str(info.value) and "score" in str(info.value)


def test_saved_dataset_dict_split(ds_cache):
    import datasets

    d = ds_cache / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["x"]}),
                          "test": datasets.Dataset.from_dict({"prompt": ["y"]})}).save_to_disk(str(d))
    assert read_prompts(str(d)) == ["x"]
    assert read_prompts(str(d), split="test") == ["y"]
    with pytest.raises(DataError) as info:
        read_prompts(str(d), split="validation")
    assert "'validation'" in str(info.value) and "data.split" in str(info.value)


def test_unknown_suffix(ds_cache):
    p = ds_cache / "prompts.xlsx"
    p.write_text("x")
    with pytest.raises(DataError, match="Cannot tell the format"):
        read_prompts(str(p))


@pytest.mark.parametrize("name", ["missing.csv", "sub/missing.json", "missing.parquet"])
def test_missing_relative_data_file_is_not_looked_up_on_the_hub(ds_cache, monkeypatch, name):
    monkeypatch.chdir(ds_cache)
    import time

    t = time.perf_counter()
    with pytest.raises(DataError) as info:
        read_prompts(name)
    assert name in str(info.value) and "not found" in str(info.value)
    assert time.perf_counter() - t < 5  # no network retries


def test_missing_absolute_path(tmp_path):
    with pytest.raises(DataError) as info:
        read_prompts(str(tmp_path / "nowhere" / "p.csv"))
    assert "not found" in str(info.value)
    with pytest.raises(DataError, match="not found"):
        read_prompts(str(tmp_path / "no_such_dir"))


# --------------------------------------------------------------------------- build_prompt_set

def test_tokenised_in_file_order(tok):
    ps = build_prompt_set(["the film was", "a day"], tok, DataConfig(), seed=0)
    assert ps.texts == ["the film was", "a day"]
    assert ps.ids == [tok("the film was")["input_ids"], tok("a day")["input_ids"]]
    assert len(ps) == 2 and ps.truncated == 0 and ps.skipped == 0


def test_truncation_keeps_last_tokens(tok):
    long = "the film was very good and the book was bad"
    short = "a day"
    full = tok(long)["input_ids"]
    assert len(full) == 10
    ps = build_prompt_set([long, short], tok, DataConfig(max_prompt_tokens=4), seed=0)
    assert ps.ids[0] == full[-4:] == tok("the book was bad")["input_ids"]
    assert ps.ids[1] == tok(short)["input_ids"]
    assert ps.texts == ["the book was bad", short]  # the reward function sees what the policy saw
    assert ps.truncated == 1 and ps.skipped == 0


def _bos_tokenizer(path):
    """The test tokenizer with a BOS prepended to every text (as Llama's does)."""
    from tokenizers.processors import TemplateProcessing

    t = make_tokenizer(path)
    bos = t.convert_tokens_to_ids("i")  # any id: stands for <s>
    t.backend_tokenizer.post_processor = TemplateProcessing(single="i $A", special_tokens=[("i", bos)])
    return t, bos


def test_truncation_keeps_bos(tmp_path):
    t, bos = _bos_tokenizer(tmp_path)
    long = "the film was very good and the book was bad"
    assert t(long)["input_ids"][0] == bos
    ps = build_prompt_set([long], t, DataConfig(max_prompt_tokens=5), seed=0)
    # before: the last 5 tokens, BOS lost; now BOS + the text's last 4 tokens
    assert ps.ids[0] == [bos] + t("the book was bad", add_special_tokens=False)["input_ids"]
    assert ps.truncated == 1


def test_truncation_keeps_the_chat_template_frame(tmp_path):
    t = make_tokenizer(tmp_path)
    # a header before the user's text and an assistant turn after it
    t.chat_template = ("{% for m in messages %}we . {{ m['content'] }} .{% endfor %}"
                       "{% if add_generation_prompt %} i{% endif %}")
    text = "the film was very good and the book was bad"
    full = t(t.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    ps = build_prompt_set([text], t, DataConfig(chat_template=True, max_prompt_tokens=8), seed=0)
    ids = ps.ids[0]
    assert len(full) == 14 and len(ids) == 8
    assert ids[:2] == full[:2] and ids[-2:] == full[-2:], "header 'we .' and tail '. i' kept"
    assert ids[2:6] == t("the book was bad", add_special_tokens=False)["input_ids"]
    assert ps.texts == [t.decode(ids)] and "the book was bad" in ps.texts[0] and "film" not in ps.texts[0]


def test_truncation_budget_smaller_than_frame_is_an_error(tmp_path):
    t, _ = _bos_tokenizer(tmp_path)
    with pytest.raises(DataError, match="max_prompt_tokens=1"):
        build_prompt_set(["the film was very good"], t, DataConfig(max_prompt_tokens=1), seed=0)


def test_prompt_exactly_at_limit_is_untouched(tok):
    ps = build_prompt_set(["the book was bad"], tok, DataConfig(max_prompt_tokens=4), seed=0)
    assert ps.truncated == 0 and len(ps.ids[0]) == 4


def test_skip_mode_counts_skipped(tok):
    texts = ["the film was very good", "a day", "we liked it but it was sad", "the book"]
    ps = build_prompt_set(texts, tok, DataConfig(max_prompt_tokens=3, on_long_prompt="skip"), seed=0)
    assert ps.texts == ["a day", "the book"]
    assert ps.skipped == 2 and ps.truncated == 0


def test_empty_prompt_is_skipped(tok):
    ps = build_prompt_set(["", "a day"], tok, DataConfig(), seed=0)
    assert ps.texts == ["a day"] and ps.skipped == 1


def test_all_skipped_is_an_error(tok):
    with pytest.raises(DataError) as info:
        build_prompt_set(["the film was very good", "we liked it a lot"], tok,
                         DataConfig(max_prompt_tokens=2, on_long_prompt="skip"), seed=0)
    msg = str(info.value)
    assert "data.max_prompt_tokens=2" in msg and "skip" in msg and "all 2" in msg


def test_chat_template_without_template(tok):
    assert not getattr(tok, "chat_template", None)
    with pytest.raises(DataError) as info:
        build_prompt_set(["a day"], tok, DataConfig(chat_template=True), seed=0)
    assert "chat template" in str(info.value) and "data.chat_template=false" in str(info.value)


def test_chat_template_applied(tmp_path):
    t = make_tokenizer(tmp_path)
    t.chat_template = "{% for m in messages %}{{ m['content'] }} .{% endfor %}{% if add_generation_prompt %} i{% endif %}"
    ps = build_prompt_set(["a day"], t, DataConfig(chat_template=True), seed=0)
    assert ps.texts == ["a day . i"]
    assert ps.ids == [t("a day . i", add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------- the prompt stream

def _ps(n: int, seed: int = 0, shuffle: bool = True) -> PromptSet:
    return PromptSet([f"p{i}" for i in range(n)], [[i] for i in range(n)], 0, 0, seed, shuffle)


def _stream(ps: PromptSet, start: int, stop: int) -> list[str]:
    return [ps.at(i)[0] for i in range(start, stop)]


def test_stream_deterministic_per_seed():
    n = 7
    a, b = _ps(n, seed=3), _ps(n, seed=3)
    assert _stream(a, 0, 5 * n) == _stream(b, 0, 5 * n)
    assert _stream(_ps(n, seed=4), 0, 3 * n) != _stream(a, 0, 3 * n)


def test_stream_random_access_matches_sequential():
    n = 6
    seq = _stream(_ps(n, seed=1), 0, 4 * n)
    ps = _ps(n, seed=1)  # positions visited out of order (as after a resume) give the same prompts
    for pos in (17, 3, 23, 0, 12, 12, 5):
        assert ps.at(pos)[0] == seq[pos]


def test_each_prompt_once_per_epoch():
    n = 9
    ps = _ps(n, seed=2)
    for epoch in range(4):
        assert sorted(_stream(ps, epoch * n, (epoch + 1) * n)) == sorted(ps.texts)


def test_epochs_have_different_orders():
    n = 10
    ps = _ps(n, seed=0)
    orders = [tuple(_stream(ps, e * n, (e + 1) * n)) for e in range(4)]
    assert len(set(orders)) > 1
    assert orders[0] != orders[1]


def test_text_and_ids_stay_paired():
    ps = _ps(8, seed=5)
    for pos in range(24):
        text, ids = ps.at(pos)
        assert text == f"p{ids[0]}"


def test_no_shuffle_keeps_file_order():
    n = 5
    ps = _ps(n, shuffle=False)
    assert _stream(ps, 0, 3 * n) == [f"p{i}" for i in range(n)] * 3


def test_shuffle_flag_from_config(tok):
    texts = ["a", "the", "film", "book", "day", "story"]
    ps = build_prompt_set(texts, tok, DataConfig(shuffle=False), seed=9)
    assert _stream(ps, 0, 6) == texts
    ps = build_prompt_set(texts, tok, DataConfig(shuffle=True), seed=9)
    assert sorted(_stream(ps, 0, 6)) == sorted(texts)


# --------------------------------------------------------------------------- columns and objects

def test_records_carry_the_columns_asked_for(tmp_path, tok):
    from oppo.data import ALL_COLUMNS, read_records

    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "the film was", "answer": 3, "id": "a"},
                                      {"prompt": "", "answer": 0, "id": "b"},  # empty: skipped
                                      {"prompt": "a day", "answer": 2}])  # no id: id is not a column of every record
    rec = read_records(str(p), columns=("answer", "id", "nope"))
    assert rec.available == ["prompt", "answer"] and rec.columns == {"answer": [3, 0, 2]}
    assert read_records(str(p), columns=ALL_COLUMNS).columns == {"prompt": ["the film was", "", "a day"],
                                                                 "answer": [3, 0, 2]}
    ps = build_prompt_set(rec.texts, tok, DataConfig(shuffle=False), seed=0, columns=rec.columns)
    assert ps.skipped == 1 and ps.columns == {"answer": [3, 2]}  # aligned with the prompts kept
    ctx = ps.context([1, 0, 2])  # data positions: past the end is the next epoch
    assert ctx == {"answer": [2, 3, 3], "raw_prompts": ["a day", "the film was", "the film was"],
                   "formatted_prompts": ["a day", "the film was", "the film was"]}


def test_context_follows_the_shuffled_order_across_epochs(tok):
    texts = [f"the book {w}" for w in ("was", "is", "and", "but", "not")]
    ps = build_prompt_set(texts, tok, DataConfig(), seed=3, columns={"n": list(range(5))})
    positions = list(range(12))  # two and a bit epochs, each its own order
    ctx = ps.context(positions)
    assert ctx["formatted_prompts"] == [ps.at(p)[0] for p in positions]
    assert ctx["n"] == [texts.index(t) for t in ctx["raw_prompts"]]
    assert ps.context(positions[:3]) == {k: v[:3] for k, v in ctx.items()}  # (an older epoch looked up again)


def test_chat_template_raw_and_formatted_prompts(tmp_path):
    t = make_tokenizer(tmp_path)
    t.chat_template = "{% for m in messages %}we . {{ m['content'] }} .{% endfor %}"
    ps = build_prompt_set(["a day"], t, DataConfig(chat_template=True), seed=0)
    ctx = ps.context([0])
    assert ctx["raw_prompts"] == ["a day"] and ctx["formatted_prompts"] == ps.texts and ps.texts[0] != "a day"


def test_prompt_objects(ds_cache):
    import datasets

    from oppo.data import object_problems, records_from_object

    assert records_from_object(["a", "b"], "prompt", columns=("prompt",)).columns == {"prompt": ["a", "b"]}
    rec = records_from_object([{"q": "a", "k": 1}, {"q": "b", "k": 2}], "q", columns=("k",))
    assert rec.texts == ["a", "b"] and rec.columns == {"k": [1, 2]} and rec.available == ["q", "k"]
    ds = datasets.Dataset.from_dict({"prompt": ["x", "y"], "answer": [1, 2]})
    rec = records_from_object(datasets.DatasetDict({"train": ds}), "prompt", columns=("answer",))
    assert rec.texts == ["x", "y"] and rec.columns == {"answer": [1, 2]}
    assert "no split 'test'" in object_problems(datasets.DatasetDict({"train": ds}), "prompt", "test")[0]
    assert "empty list" in object_problems([], "prompt")[0]
    assert "got str" in object_problems("prompts.jsonl", "prompt")[0]
    assert "not a mix" in object_problems(["a", {"prompt": "b"}], "prompt")[0]
    assert "must be a string or a list of messages" in object_problems([{"prompt": 1}], "prompt")[0]
    with pytest.raises(DataError, match="no column 'text'"):
        records_from_object(ds, "text")


# --------------------------------------------------------------------------- conversational prompts

CHAT = "{% for m in messages %}{{ m['role'] == 'user' and 'we' or 'i' }} . {{ m['content'] }} .{% endfor %}" \
       "{% if add_generation_prompt %} it{% endif %}"


def _chat_tokenizer(path):
    t = make_tokenizer(path)
    t.chat_template = CHAT
    return t


def test_conversations_go_through_the_chat_template_from_jsonl_datasets_and_lists(tmp_path, ds_cache):
    """A prompt given as messages (TRL's conversational format) is formatted by the tokenizer's chat
    template with the assistant turn opened, whether it comes from a JSONL file, a
    datasets.Dataset, a Python list of conversations or of dicts; plain-text prompts beside them
    stay text (data.chat_template=false)."""
    import datasets

    from oppo.data import read_records, records_from_object

    t = _chat_tokenizer(tmp_path / "tok")
    talk = [{"role": "user", "content": "the film was"}, {"role": "assistant", "content": "good"},
            {"role": "user", "content": "and the book"}]
    want = "we . the film was .i . good .we . and the book . it"
    p = _jsonl(tmp_path / "chat.jsonl", [{"prompt": talk, "answer": 1}, {"prompt": "a day", "answer": 2}])
    from_file = read_records(str(p), columns=("answer",))
    from_ds = records_from_object(datasets.Dataset.from_list([{"prompt": talk, "answer": 1},
                                                              {"prompt": [{"role": "user", "content": "a day"}],
                                                               "answer": 2}]), "prompt")
    from_list = records_from_object([talk, "a day"], "prompt")
    from_dicts = records_from_object([{"prompt": talk}, {"prompt": "a day"}], "prompt")
    for rec in (from_file, from_list, from_dicts):
        ps = build_prompt_set(rec.texts, t, DataConfig(shuffle=False), seed=0)
        assert ps.texts == [want, "a day"], ps.texts
        assert ps.ids[0] == t(want, add_special_tokens=False)["input_ids"]
        assert ps.raw[0] == talk and ps.templated
    assert from_file.columns == {"answer": [1, 2]}
    ps = build_prompt_set(from_ds.texts, t, DataConfig(shuffle=False), seed=0)
    assert ps.texts == [want, "we . a day . it"] and ps.context([0])["raw_prompts"] == [talk]
    plain = build_prompt_set(["a day"], t, DataConfig(), seed=0)
    assert plain.texts == ["a day"] and not plain.templated


def test_conversation_without_a_chat_template_names_the_fix(tmp_path, tok):
    talk = [{"role": "user", "content": "a day"}]
    with pytest.raises(DataError) as info:
        build_prompt_set(["the film", talk, talk], tok, DataConfig(), seed=0)
    msg = str(info.value)
    assert "prompt 1 (and 1 more) is a conversation" in msg and "has none" in msg and "chat template" in msg


def test_a_list_that_is_not_messages_is_named(tmp_path):
    from oppo.data import object_problems

    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": [{"text": "a"}]}])
    with pytest.raises(DataError, match=r"p\.jsonl:1: field 'prompt' must be a string or a list of messages .*"
                                        r"each needs a 'role' and a 'content'"):
        read_prompts(str(p))
    assert "must be a string or a list of messages" in object_problems([{"prompt": []}], "prompt")[0]


def test_prompts_are_never_cut_silently(tmp_path, caplog):
    """data.max_prompt_tokens empty (the default): a prompt is cut only past the room the models'
    positions leave (``room``), and then one console line says how many and names the settings;
    none is cut where no room is known. transformers' false "indexing errors" warning (about the
    tokenizer's model_max_length, not the models oppo runs) is not passed on (issue 53)."""
    t = make_tokenizer(tmp_path / "t")
    t.model_max_length = 4  # (the tokenizer's own limit: what transformers warns against)
    long, short = "the film was very good and the book was bad", "a day"
    assert DataConfig().max_prompt_tokens is None
    ps = build_prompt_set([long, short], t, DataConfig(), seed=0)  # no room known: whole
    assert ps.ids[0] == t(long, verbose=False)["input_ids"] and ps.truncated == 0 and ps.budget is None
    assert ps.width == 10
    said = []
    ps = build_prompt_set([long, short, long], t, DataConfig(), seed=0, room=6, say=said.append)
    assert [len(i) for i in ps.ids] == [6, 2, 6] and ps.truncated == 2 and ps.width == 6 and ps.budget == 6
    (line,) = said
    assert "2 of 3 prompts are longer than data.max_prompt_tokens" in line and "the longest 10" in line
    assert "generation.max_new_tokens" in line and "data.on_long_prompt=skip" in line
    said.clear()  # a set one: named with its value; every prompt fits: no line
    ps = build_prompt_set([long, short], t, DataConfig(max_prompt_tokens=12), seed=0, room=6, say=said.append)
    assert ps.truncated == 0 and ps.width == 12 and not said
    with pytest.raises(DataError, match="data.max_prompt_tokens=4"):  # all skipped
        build_prompt_set([long], t, DataConfig(max_prompt_tokens=4, on_long_prompt="skip"), seed=0, say=said.append)
    assert "longer than data.max_prompt_tokens=4 tokens" in said[0] and "skipped" in said[0]
    assert "indexing errors" not in caplog.text
    t(long)  # (the check can fail: transformers' own call warns, through its logger)
    assert "indexing errors" in caplog.text
