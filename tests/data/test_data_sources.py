"""Sources: GSM8K on the real test file, local jsonl/parquet/arrow via HF datasets, the optional TFDS source."""

import importlib.util
import json
from pathlib import Path

import pytest

from dgemma.data.config import DataConfig
from dgemma.data.rewards import TaskExample, extract_gsm8k_answer, gsm8k_reward, normalize_number, reward
from dgemma.data.sources import GSM8KSource, HFFileSource, TFDSSource, build_source, infer_format
from dgemma.data.tokenizer import ToyTokenizer

GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared/data/gsm8k/test.jsonl"
needs_gsm8k = pytest.mark.skipif(
    not GSM8K_TEST.exists(), reason=f"GSM8K test split not found at {GSM8K_TEST} (expected next to the repo)"
)


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
    return GSM8KSource(str(GSM8K_TEST), cache_dir=str(tmp_path_factory.mktemp("hf_cache")))


@needs_gsm8k
def test_gsm8k_rows_and_final_answers(gsm8k):
    assert len(gsm8k) == 1319
    first = gsm8k[0]
    assert first.task == "gsm8k" and first.index == 0
    assert first.prompt.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.response.endswith("#### 18") and first.answer == "18"
    answers = [gsm8k[i].answer for i in range(len(gsm8k))]
    assert all(a and a.lstrip("-").replace(".", "", 1).isdigit() for a in answers)
    # thousands separators in the reference are normalized away
    raw = [json.loads(line)["answer"] for line in GSM8K_TEST.read_text().splitlines()]
    with_comma = [i for i, r in enumerate(raw) if "," in r.rsplit("####", 1)[1]]
    assert with_comma, "the real file has answers such as '2,125'"
    assert "," not in answers[with_comma[0]]


@needs_gsm8k
def test_gsm8k_reward_on_real_rows(gsm8k):
    for i in range(0, len(gsm8k), 7):
        ex = gsm8k[i]
        assert gsm8k_reward(ex, ex.response) == 1.0, i  # the reference solution scores 1
        assert reward(ex, ex.response + "<eos>#### 999999") == 1.0  # text after EOS is ignored
        wrong = str(int(float(ex.answer)) + 1)
        assert reward(ex, ex.response.rsplit("####", 1)[0] + "#### " + wrong) == 0.0
    ex = gsm8k[0]
    assert reward(ex, "She makes $18.\n#### $18.00") == 1.0
    assert reward(ex, "The answer is 18.") == 0.0  # no '####'
    assert reward(ex, "#### 18", require_eos=True) == 0.0
    with_comma = TaskExample(task="gsm8k", prompt="q", response="#### 2,125", answer="2125")
    assert reward(with_comma, "so 2,000 + 125\n#### 2,125 \n") == 1.0
    assert reward(with_comma, "#### 2 125") == 1.0


def test_gsm8k_reward_on_tokens():
    tok = ToyTokenizer(("#", " ", *"0123456789"), num_reserved=0)
    ex = TaskExample(task="gsm8k", prompt="q", response="#### 42", answer="42")
    ids = tok.encode("#### 42")
    assert reward(ex, ids + [1, *tok.encode("1")], tok) == 1.0
    assert reward(ex, tok.encode("#### 43") + [1], tok) == 0.0


def test_number_normalization():
    assert normalize_number(" 1,600 ") == "1600"
    assert normalize_number("$18.00") == "18"
    assert normalize_number("-3.50") == "-3.5"
    assert normalize_number("18.") == "18"
    assert normalize_number("abc") == "abc"
    assert extract_gsm8k_answer("x #### 5 \n more text") == "5"
    assert extract_gsm8k_answer("#### 1 then #### 2") == "2"
    assert extract_gsm8k_answer("no marker 5") is None
    assert extract_gsm8k_answer("####   ") is None


def _write_rows(tmp_path, n=7):
    rows = [{"q": f"C{i}{i}|", "a": f"{i}{i}", "gold": f"g{i}", "other": i} for i in range(n)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, jsonl


def test_local_jsonl_parquet_arrow(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows, jsonl = _write_rows(tmp_path)
    ds = datasets.Dataset.from_list(rows)
    parquet = tmp_path / "rows.parquet"
    ds.to_parquet(str(parquet))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    cache = str(tmp_path / "cache")
    for path, fmt in ((jsonl, "json"), (parquet, "parquet"), (arrow, "arrow")):
        assert infer_format([str(path)]) == fmt
        src = HFFileSource([str(path)], prompt_field="q", response_field="a", prompt_template="<<{prompt}>>",
                           cache_dir=cache)
        assert len(src) == len(rows), fmt
        ex = src[3]
        assert ex == TaskExample(task="text", prompt="<<C33|>>", response="33", answer="33", index=3), fmt
        assert reward(ex, "33<eos>junk") == 1.0 and reward(ex, "34<eos>") == 0.0
        with_gold = HFFileSource(str(path), format=fmt, prompt_field="q", response_field="a", answer_field="gold",
                                 cache_dir=cache)
        assert with_gold[5].answer == "g5"


def test_local_source_errors(tmp_path):
    _, jsonl = _write_rows(tmp_path)
    with pytest.raises(KeyError, match=r"prompt_field='question' is not a column .*\['a', 'gold', 'other', 'q'\]"):
        HFFileSource(str(jsonl), prompt_field="question", response_field="a", cache_dir=str(tmp_path / "c"))
    # checked up front, not when the row is read (a bad column fails at construction)
    with pytest.raises(ValueError, match=r"column 'other' must be text, it holds int64"):
        HFFileSource(str(jsonl), prompt_field="q", response_field="other", cache_dir=str(tmp_path / "c"))
    src = HFFileSource(str(jsonl), prompt_field="q", response_field="a", cache_dir=str(tmp_path / "c"))
    with pytest.raises(IndexError):
        src[7]
    with pytest.raises(FileNotFoundError):
        HFFileSource(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="cannot infer"):
        infer_format(["a.csv"])


def test_bad_rows_are_found_up_front_naming_file_and_line(tmp_path):
    rows = [{"q": f"C{i}|", "a": f"{i}"} for i in range(6)]
    rows[3]["a"] = None
    missing = tmp_path / "missing_value.jsonl"
    missing.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"line 4 of {missing}: column 'a' is missing \(1 rows in all\)"):
        HFFileSource(str(missing), prompt_field="q", response_field="a", cache_dir=str(tmp_path / "c"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="data files are empty"):
        HFFileSource(str(empty), prompt_field="q", response_field="a", cache_dir=str(tmp_path / "c"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"cannot read \['{broken}'\] as json"):
        HFFileSource(str(broken), prompt_field="q", response_field="a", cache_dir=str(tmp_path / "c"))


def test_build_source_from_config(tmp_path):
    _, jsonl = _write_rows(tmp_path)
    cfg = DataConfig(source="json", paths=[str(jsonl)], prompt_field="q", response_field="a",
                     cache_dir=str(tmp_path / "c"))
    src = build_source(cfg)
    assert isinstance(src, HFFileSource) and src[1].response == "11"
    with pytest.raises(ValueError, match="DataConfig.paths"):
        DataConfig(source="parquet")
    if GSM8K_TEST.exists():
        g = build_source(DataConfig(source="gsm8k", paths=(str(GSM8K_TEST),), cache_dir=str(tmp_path / "c"),
                                    prompt_template="Q: {prompt}\nA:"))
        assert isinstance(g, GSM8KSource) and g[1].prompt.startswith("Q: A robe") and g[1].answer == "3"


def _build_tiny_tfds(data_dir: Path, n: int) -> None:
    """A real TFDS dataset (ArrayRecord files + dataset_info.json) built offline by a local builder (no tensorflow)."""
    import tensorflow_datasets as tfds

    class DgemmaTinyQa(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            text = tfds.features.Text()
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"question": text, "answer": text}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, n), "test": self._generate_examples(n, 2)}

        def _generate_examples(self, start, count):
            for i in range(start, start + count):
                yield i, {"question": f"{i}+{i}", "answer": str(2 * i)}

    DgemmaTinyQa(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def test_tfds_source_reads_a_dataset(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets", reason="test extra: tensorflow-datasets")
    import tempfile

    from dgemma.data.pipeline import DataPipeline

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # TFDS leaves an empty tmp*tfds dir behind
    _build_tiny_tfds(tmp_path / "tfds", n=6)
    cfg = DataConfig(source="tfds", tfds_name="dgemma_tiny_qa", data_dir=str(tmp_path / "tfds"),
                     prompt_field="question", response_field="answer", prompt_template="{prompt}=",
                     layout={"prompt_len": 8, "canvas_length": 4, "n_blocks": 1}, batch_size=3, shuffle=False,
                     num_threads=0)
    src = build_source(cfg)
    assert isinstance(src, TFDSSource) and len(src) == 6
    rows = {src[i].prompt: src[i].response for i in range(len(src))}  # text features arrive as bytes: decoded
    assert rows == {f"{i}+{i}=": str(2 * i) for i in range(6)}
    assert all(src[i].answer == src[i].response for i in range(6))
    test = build_source(DataConfig(**{**cfg.__dict__, "split": "test"}))
    assert sorted(test[i].prompt for i in range(len(test))) == ["6+6=", "7+7="]
    # end to end through the grain pipeline: tokens decode back to the dataset's text
    pipe = DataPipeline(cfg, process_index=0, process_count=1)
    batch = pipe.batch(0)
    tok = pipe.tokenizer
    for row, idx in enumerate(batch["index"]):
        ex = src[int(idx)]
        prompt = [int(t) for t, v in zip(batch["tokens"][row, :8], batch["valid"][row, :8]) if v]
        assert tok.decode(prompt[1:]) == ex.prompt  # after BOS
    with pytest.raises(Exception, match="dgemma_missing"):  # a dataset that is not there: tfds's own error
        TFDSSource("dgemma_missing", data_dir=str(tmp_path / "tfds"))


@pytest.mark.skipif(importlib.util.find_spec("tensorflow_datasets") is not None, reason="tensorflow_datasets present")
def test_tfds_missing_extra_is_a_clear_error():
    with pytest.raises(ImportError, match=r"tensorflow_datasets.*dgemma\[tfds\]"):
        TFDSSource("mnist")
    with pytest.raises(ValueError, match="DataConfig.tfds_name"):
        DataConfig(source="tfds")
    with pytest.raises(ImportError, match="dgemma"):
        build_source(DataConfig(source="tfds", tfds_name="gsm8k"))
