"""Datasets as rows: every file format round-trips (written here by the standard library, pyarrow and
`datasets` itself), bad files are named with their row and column, the built-in addition task is a dataset
like any other (the same eval problems as before), and reasoning-gym generates and scores offline."""
import json
import random
import socket
import sys

import pytest

from minite_core.rl.data import DataError, default_reward, load_rows, prompt_format
from minite_core.rl.rewards import compute_rewards, load_rewards
from minite_core.rl.addition import BOS, EOS, addition_eval_rows, build_tokenizer

CONVERSATIONAL = [
    {"prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+3?"}],
     "answer": "5", "data_source": "arith"},
    {"prompt": [{"role": "user", "content": "What is 7*6?"}], "answer": "42", "data_source": "mult"},
]
STANDARD = [{"prompt": "2+3=", "answer": "5", "data_source": "arith"},
            {"prompt": "Say hi, \"politely\".\n", "answer": "hi", "data_source": "chat"}]


@pytest.fixture
def offline(monkeypatch):
    """No connection can be opened (nothing comes from a hub)."""
    def refuse(*args, **kwargs):
        raise OSError("this test runs offline")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL], ids=["standard", "conversational"])
def test_jsonl_json_parquet_and_save_to_disk_round_trip(tmp_path, rows, offline):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    _jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "splits"))
    want = "standard" if isinstance(rows[0]["prompt"], str) else "conversational"
    for spec in ["d.jsonl", "d.json", "d.parquet", "folder", "splits"]:
        got = load_rows(str(tmp_path / spec))
        assert list(got) == rows, spec
        assert prompt_format(got) == want and default_reward(str(tmp_path / spec)) is None
    assert list(load_rows(f"{tmp_path / 'splits'}:test")) == rows[:1]
    with pytest.raises(DataError, match=r"splits: no split 'validation' \(its splits: train, test\)"):
        load_rows(f"{tmp_path / 'splits'}:validation")


def test_csv_gives_strings_and_standard_prompts(tmp_path):
    import csv
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "answer", "data_source"])
        w.writeheader()
        w.writerows(STANDARD + [{"prompt": "1+1=", "answer": 2, "data_source": "arith"}])
    rows = load_rows(str(tmp_path / "d.csv"))
    assert list(rows) == STANDARD + [{"prompt": "1+1=", "answer": "2", "data_source": "arith"}]
    assert prompt_format(rows) == "standard"
    (tmp_path / "ragged.csv").write_text("prompt,answer\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(DataError, match=r"ragged.csv:3: 3 values for the 2 columns of the header \(prompt, answer\)"):
        load_rows(str(tmp_path / "ragged.csv"))


def test_rows_with_differing_keys_all_get_every_column(tmp_path):
    rows = load_rows(str(_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "tag": "x"}])))
    assert list(rows) == [{"prompt": "a", "answer": "1", "tag": None}, {"prompt": "b", "answer": None, "tag": "x"}]


def test_columns_reach_a_reward_function(tmp_path):
    """The path a trainer takes: rows -> the columns other than prompt, as lists, to a TRL-style function."""
    rows = load_rows(str(_jsonl(tmp_path / "d.jsonl", CONVERSATIONAL)))
    (tmp_path / "r.py").write_text(
        "def seen(prompts, completions, completion_ids, answer, data_source, **kwargs):\n"
        "    return [float(c[0]['content'] == a) + (d == 'mult') for c, a, d in zip(completions, answer, data_source)]\n")
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    total, _ = compute_rewards(load_rewards([f"{tmp_path}/r.py:seen"]), prompts=[r["prompt"] for r in rows],
                               completions=[[{"role": "assistant", "content": c}] for c in ("5", "41")],
                               completion_ids=[[1], [2]], columns=columns, trainer_state={"step": 0})
    assert total.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("content, message", [
    ('{"question": "1+1", "answer": "2"}\n',
     r"d.jsonl: row 0 has no 'prompt' column \(its columns: question, answer\)"),
    ('{"prompt": "a"}\n{"prompt": "b",}\n', r"d.jsonl:2: not a JSON object: "),
    ('{"prompt": "a"}\n["b"]\n', r"d.jsonl:2: a line is one JSON object, not a list"),
    ('{"prompt": "a"}\n{"prompt": [{"role": "usr", "content": "b"}]}\n',
     r"row 1, column 'prompt': message 0 has role 'usr', expected one of system, developer, user, assistant, tool"),
    ('{"prompt": [{"role": "user", "content": ["b"]}]}\n', r"row 0, column 'prompt': message 0 has content \['b'\]"),
    ('{"prompt": [{"role": "user"}]}\n', r"row 0, column 'prompt': message 0 is \{'role': 'user'\}, expected"),
    ('{"prompt": 12}\n', r"row 0, column 'prompt': a prompt is a string \(standard\) or a non-empty list"),
    ('{"prompt": []}\n', r"row 0, column 'prompt': a prompt is a string"),
    ('{"prompt": "a"}\n{"prompt": [{"role": "user", "content": "b"}]}\n',
     r"row 1's prompt is conversational but row 0's is standard"),
    ("\n\n", r"d.jsonl: no rows"),
])
def test_bad_jsonl_names_file_row_and_column(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        load_rows(str(tmp_path / "d.jsonl"))


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match=r"'nope.jsonl': no such file or folder"):
        load_rows("nope.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"d.txt: unknown dataset format '.txt'; expected .jsonl, .json, .csv or .parquet"):
        load_rows(str(tmp_path / "d.txt"))
    (tmp_path / "d.json").write_text('{"prompt": "a"}')
    with pytest.raises(DataError, match=r"d.json: a .json dataset is a list of objects, not a dict"):
        load_rows(str(tmp_path / "d.json"))
    with pytest.raises(DataError, match=r"not a folder written by datasets' save_to_disk"):
        pytest.importorskip("datasets")
        load_rows(str(tmp_path))
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"d.parquet: not a readable Parquet file"):
        load_rows(str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"digits must be an integer from 1 to 9"):
        load_rows("addition:x")


def test_missing_extras_say_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_text("")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(DataError, match=r"reading Parquet needs the pyarrow package: pip install 'minite\[data\]'"):
        load_rows(str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"datasets folder needs the datasets package: pip install 'minite\[data\]'"):
        load_rows(str(tmp_path))
    with pytest.raises(DataError, match=r"needs the reasoning_gym package: pip install 'minite\[gym\]'"):
        load_rows("reasoning_gym:chain_sum")


# -- the built-in addition task ----------------------------------------------------------------------------


def test_addition_rows():
    rows = load_rows("addition")
    assert len(rows) == 10_000 and rows[0] == {"prompt": "<bos>0+0=", "answer": "0"}
    assert rows[1234] == {"prompt": "<bos>12+34=", "answer": "46"} and rows[-1] == {"prompt": "<bos>99+99=", "answer": "198"}
    assert len(load_rows("addition:3")) == 10**6 and load_rows("addition:1")[37]["prompt"] == "<bos>3+7="
    assert prompt_format(rows) == "standard" and default_reward("addition:3") == ["addition"]
    tok = build_tokenizer()  # the text prompt tokenizes to the ids the task always used: <bos> then the characters
    for i in random.Random(0).sample(range(len(rows)), 50):
        a, b = divmod(i, 100)
        assert tok.encode(rows[i]["prompt"]).ids == [BOS] + tok.encode(f"{a}+{b}=").ids
    with pytest.raises(IndexError):
        rows[10_000]


def test_addition_eval_rows_are_the_old_fixed_problems():
    for digits in (1, 2, 3):
        rng, hi, old = random.Random(1234), 10**digits, []  # AdditionTask(digits, seed=1234).sample(), n times
        for _ in range(128):
            a, b = rng.randrange(hi), rng.randrange(hi)
            old.append((a, b))
        assert addition_eval_rows(digits) == [{"prompt": f"<bos>{a}+{b}=", "answer": str(a + b)} for a, b in old]
    assert addition_eval_rows(2, n=5, seed=7) == addition_eval_rows(2, n=9, seed=7)[:5]
    rows = addition_eval_rows(2, n=4)
    tok = build_tokenizer()
    right = [tok.encode(r["answer"]).ids + [EOS] for r in rows]
    total, _ = compute_rewards(load_rewards(default_reward("addition")), prompts=[r["prompt"] for r in rows],
                               completions=["c"] * 4, completion_ids=right, columns={"answer": [r["answer"] for r in rows]},
                               trainer_state={})
    assert total.tolist() == [1.0] * 4


# -- reasoning-gym -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic", "number_sorting", "countdown"])
def test_reasoning_gym_generates_and_scores_offline(name, offline):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    rows = load_rows(f"reasoning_gym:{name}?size=4&seed=5")
    assert len(rows) == 4 and prompt_format(rows) == "conversational"
    assert default_reward(f"reasoning_gym:{name}") == ["reasoning_gym"]
    rows = list(rows)
    library = reasoning_gym.create_dataset(name, size=4, seed=5)
    assert [r["answer"] for r in rows] == [library[i]["answer"] for i in range(4)]
    assert rows[0]["prompt"][0]["role"] == "system" and "<answer>" in rows[0]["prompt"][0]["content"]
    assert rows[0]["prompt"][1] == {"role": "user", "content": library[0]["question"]}

    fns = load_rewards(default_reward(f"reasoning_gym:{name}") + ["format_regex=.*<answer>.*</answer>"])
    completions = [f"Let me see.\n<answer>{rows[0]['answer']}</answer>", f"<answer>{rows[1]['answer']}</answer>",
                   "<answer>-12345</answer>", rows[3]["answer"]]  # right, right, wrong, right without the tags
    conversational = [[{"role": "assistant", "content": c}] for c in completions]
    columns = {k: [r[k] for r in rows] for k in ("question", "answer", "metadata")}
    total, per = compute_rewards(fns, prompts=[r["prompt"] for r in rows], completions=conversational,
                                 completion_ids=[[1]] * 4, columns=columns, trainer_state={})
    assert per["reasoning_gym"][:2] == [1.0, 1.0] and per["reasoning_gym"][2] < 1.0 and per["reasoning_gym"][3] < 1.0
    if name != "countdown":  # countdown gives a little credit to any well-formed wrong expression
        assert per["reasoning_gym"][2:] == [0.0, 0.0]
    # the library's own scorer on the same extracted text
    assert per["reasoning_gym"][2] == library.score_answer("-12345", library[2])
    assert total.tolist() == pytest.approx([2.0, 2.0, 1.0 + per["reasoning_gym"][2], per["reasoning_gym"][3]], rel=1e-6)


def test_reasoning_gym_settings_and_errors(offline):
    pytest.importorskip("reasoning_gym")
    rows = load_rows("reasoning_gym:chain_sum?size=3&seed=1&system=none&min_terms=4&max_terms=4")
    assert len(rows) == 3 and [m["role"] for m in rows[0]["prompt"]] == ["user"]
    assert all(r["metadata"]["num_terms"] == 4 for r in rows)
    seed1, again, seed2 = (list(load_rows(f"reasoning_gym:chain_sum?size=3&seed={s}")) for s in (1, 1, 2))
    assert seed1 == again and [r["answer"] for r in seed1] != [r["answer"] for r in seed2]
    with pytest.raises(DataError, match=r"reasoning-gym has no dataset 'chainsum' \(did you mean chain_sum"):
        load_rows("reasoning_gym:chainsum")
    with pytest.raises(DataError, match=r"chain_sum's settings are .*min_terms"):
        load_rows("reasoning_gym:chain_sum?terms=3")
    with pytest.raises(DataError, match=r"system='chatty' is not one of reasoning-gym's system prompts"):
        load_rows("reasoning_gym:chain_sum?system=chatty")


def test_a_byte_order_mark_is_read_and_other_encodings_are_named(tmp_path):
    """Windows tools start UTF-8 files with a BOM: read as UTF-8. A Latin-1 file: one error naming it."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "d.jsonl").write_bytes(bom + '{"prompt": "caf\u00e9?", "answer": "1"}\n'.encode())
    (tmp_path / "d.json").write_bytes(bom + '[{"prompt": "caf\u00e9?", "answer": "1"}]'.encode())
    (tmp_path / "d.csv").write_bytes(bom + "prompt,answer\ncaf\u00e9?,1\n".encode())
    for name in ("d.jsonl", "d.json", "d.csv"):
        rows = load_rows(str(tmp_path / name))
        assert list(rows[0]) == ["prompt", "answer"] and rows[0]["prompt"] == "caf\u00e9?", (name, rows[0])
    (tmp_path / "latin.jsonl").write_bytes('{"prompt": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.jsonl: not UTF-8 text.*save it as UTF-8"):
        load_rows(str(tmp_path / "latin.jsonl"))
