"""Datasets as rows: where the prompts (and the columns the reward functions read) come from.

`load_rows(spec)` gives a sequence of dicts, each with a `prompt` in one of TRL's two formats, *standard* (a
string, tokenized as is) or *conversational* (a list of {"role", "content"} messages, rendered with the model's
chat template and the generation prompt), plus every other column of its row (e.g. `answer`, `data_source`).
A spec is one of:
- a local file: `.jsonl` (one object per line), `.json` (a list of objects), `.csv` (every value a string, so
  only standard prompts), `.parquet` (pyarrow);
- a folder written by `datasets.Dataset.save_to_disk` (a `DatasetDict` folder gives its "train" split, or the
  split named as `folder:split`);
- `addition` or `addition:<digits>`: the built-in addition task (minite_core.rl.addition.AdditionRows);
- `reasoning_gym:<name>[?size=N&seed=S&system=P&<config key>=<value>...]`: a procedural reasoning-gym dataset,
  generated offline (default size: the generator's own, seed 0, so use another seed for an eval set). Each row
  has a conversational prompt (a system message with reasoning-gym's "<answer>...</answer>" instructions,
  `system=` naming one of its SYSTEM_PROMPTS or `none`, then the question as the user message) and the
  columns `question`, `answer` and `metadata`, which the `reasoning_gym` reward scores with the dataset's own
  `score_answer`. Other keys go to the generator's config (e.g. `min_numbers=3`).
Nothing is downloaded. Rows of a file with differing keys all get every column (None where it is missing).
Parquet and `save_to_disk` folders need the `data` extra, reasoning-gym the `gym` extra.

Anything unusable is a `DataError` naming the file, row and column.
"""
from __future__ import annotations

import ast
import csv
import json
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qsl

from .addition import AdditionRows

ROLES = ("system", "developer", "user", "assistant", "tool")


class DataError(ValueError):
    """A dataset that cannot be used as is; the message names the file, row and column."""


def load_rows(spec: str) -> Sequence[dict]:
    """The rows of a dataset spec (see the module docstring), checked: each has a prompt, all in one format."""
    if spec == "addition" or spec.startswith("addition:"):
        digits = spec.partition(":")[2] or "2"
        try:
            return AdditionRows(int(digits))
        except ValueError as e:
            raise DataError(f"dataset {spec!r}: digits must be an integer from 1 to 9") from e
    if spec.startswith("reasoning_gym:"):
        return _reasoning_gym(spec)
    path, split = Path(spec), None
    if not path.exists() and ":" in spec and Path(spec.rpartition(":")[0]).is_dir():
        path, split = Path(spec.rpartition(":")[0]), spec.rpartition(":")[2]
    if not path.exists():
        raise DataError(f"dataset {spec!r}: no such file or folder (a dataset is a .jsonl, .json, .csv or .parquet "
                        "file, a datasets.save_to_disk folder, 'addition[:digits]' or 'reasoning_gym:<name>')")
    if path.is_dir():
        rows = _from_disk(path, split)
    else:
        readers = {".jsonl": _jsonl, ".json": _json, ".csv": _csv, ".parquet": _parquet, ".pq": _parquet}
        if path.suffix.lower() not in readers:
            raise DataError(f"{path}: unknown dataset format {path.suffix or '(no extension)'!r}; "
                            "expected .jsonl, .json, .csv or .parquet")
        try:
            rows = readers[path.suffix.lower()](path)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    check_rows(rows, str(path))
    return rows


def prompt_format(rows: Sequence[dict]) -> str:
    """"standard" (string prompts) or "conversational" (message lists), read from the first row."""
    return "standard" if isinstance(rows[0]["prompt"], str) else "conversational"


def default_reward(spec: str) -> list[str] | None:
    """The reward specs that go with a dataset when the user names none; None when there is no default."""
    if spec == "addition" or spec.startswith("addition:"):
        return ["addition"]
    if spec.startswith("reasoning_gym:"):
        return ["reasoning_gym"]
    return None


def check_rows(rows: Sequence[dict], source: str) -> None:
    """Every row a dict with a prompt, all prompts in one format, messages with a known role and text content."""
    if len(rows) == 0:
        raise DataError(f"{source}: no rows")
    first = None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source}: row {i} is a {type(row).__name__}, not an object with a 'prompt' column")
        if "prompt" not in row:
            raise DataError(f"{source}: row {i} has no 'prompt' column (its columns: {', '.join(row) or 'none'})")
        fmt = _format(row["prompt"], f"{source}: row {i}, column 'prompt'")
        first = first or (fmt, i)
        if fmt != first[0]:
            raise DataError(f"{source}: row {i}'s prompt is {fmt} but row {first[1]}'s is {first[0]}: "
                            "one dataset holds one prompt format")


def _format(prompt, where: str) -> str:
    if isinstance(prompt, str):
        return "standard"
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: a prompt is a string (standard) or a non-empty list of {{'role', 'content'}} "
                        f"messages (conversational), not {_short(prompt)}")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {j} is {_short(m)}, expected {{'role': ..., 'content': ...}}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has role {m['role']!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {j} has content {_short(m['content'])}, expected a string")
    return "conversational"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _same_columns(rows: list[dict]) -> list[dict]:
    keys = list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r))
    return [{k: r.get(k) for k in keys} if isinstance(r, dict) else r for r in rows]


# -- readers -----------------------------------------------------------------------------------------------


def _jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8-sig") as f:  # (a BOM, as Windows tools write, is dropped)
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON object: {e.msg} (column {e.colno})") from e
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: a line is one JSON object, not a {type(row).__name__}")
            rows.append(row)
    return _same_columns(rows)


def _json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file
            return _jsonl(path)
        raise DataError(f"{path}:{e.lineno}: not JSON: {e.msg} (column {e.colno})") from e
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset is a list of objects, not a {type(data).__name__}")
    return _same_columns(data)


def _csv(path: Path) -> list[dict]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        rows = []
        for row in reader:
            if None in row or None in row.values():
                got = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, []))
                raise DataError(f"{path}:{reader.line_num}: {got} values for the {len(reader.fieldnames)} columns of "
                                f"the header ({', '.join(reader.fieldnames)})")
            rows.append(row)
    return rows


def _need(module: str, what: str, extra: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DataError(f"{what} needs the {module.split('.')[0]} package: pip install 'minite[{extra}]'") from e


def _parquet(path: Path) -> list[dict]:
    pq = _need("pyarrow.parquet", f"{path}: reading Parquet", "data")
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file: {type(e).__name__}: {e}") from e


def _from_disk(path: Path, split: str | None) -> list[dict]:
    datasets = _need("datasets", f"{path}: reading a datasets folder", "data")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({type(e).__name__}: {e})") from e
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise DataError(f"{path}: no split {name!r} (its splits: {', '.join(ds)}); name one as {path}:<split>")
        ds = ds[name]
    elif split is not None:
        raise DataError(f"{path}: a single dataset, not a DatasetDict with a {split!r} split")
    return ds.to_list()


# -- reasoning-gym -----------------------------------------------------------------------------------------


class GymRows(Sequence):
    """Rows generated on access from a reasoning-gym dataset (row i depends only on the seed and i)."""

    def __init__(self, dataset, system: str | None):
        self.dataset, self.system = dataset, system

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"reasoning-gym row {i} out of range ({len(self)} rows)")
        e = self.dataset[i % len(self)]
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"prompt": system + [{"role": "user", "content": e["question"]}],
                "question": e["question"], "answer": e["answer"], "metadata": e["metadata"]}


def _reasoning_gym(spec: str) -> GymRows:
    rg = _need("reasoning_gym", f"dataset {spec!r}", "gym")
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    name, _, query = spec.partition(":")[2].partition("?")
    if name not in DATASETS:
        import difflib
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else f"; it has: {', '.join(sorted(DATASETS))}"
        raise DataError(f"dataset {spec!r}: reasoning-gym has no dataset {name!r}{hint}")
    config = {"seed": 0}
    for key, value in parse_qsl(query, keep_blank_values=True):
        try:
            config[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            config[key] = value
    system = config.pop("system", "default")
    if system in (None, "none", ""):
        system = None
    elif system not in SYSTEM_PROMPTS:
        raise DataError(f"dataset {spec!r}: system={system!r} is not one of reasoning-gym's system prompts "
                        f"({', '.join(SYSTEM_PROMPTS)}) or 'none'")
    else:
        system = SYSTEM_PROMPTS[system]
    try:
        dataset = rg.create_dataset(name, **config)
    except TypeError as e:
        import dataclasses
        keys = [f.name for f in dataclasses.fields(DATASETS[name][1])]
        raise DataError(f"dataset {spec!r}: {e}; {name}'s settings are {', '.join(keys)} (and system)") from e
    except Exception as e:
        raise DataError(f"dataset {spec!r}: {type(e).__name__}: {e}") from e
    rows = GymRows(dataset, system)
    check_rows([rows[0]], spec)
    return rows
