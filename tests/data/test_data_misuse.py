"""A local data file is checked whole when the pipeline is built (before a run writes anything): a row the tokenizer
cannot encode, a GSM8K answer without '####', a prompt or response too long under an 'error' policy is one line naming
the file and its 1-based line (or record), not a failure when (if ever) a batch reaches the row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dgemma.data.config import DataConfig
from dgemma.data.pipeline import DataPipeline

REPO = Path(__file__).resolve().parents[2]
GOOD = {"prompt": "C123|", "response": "123"}


def _jsonl(path: Path, rows, blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(tmp_path, paths, source="json", **layout_fields):
    layout = dict(prompt_len=8, canvas_length=4, n_blocks=2, truncate_prompt="error")
    layout.update(layout_fields)
    return DataConfig(source=source, paths=[str(p) for p in paths], layout=layout, batch_size=2, num_threads=0,
                      shuffle=False, cache_dir=str(tmp_path / "hf_cache"))


def _refused(cfg) -> str:
    with pytest.raises(ValueError) as info:
        DataPipeline(cfg, process_index=0, process_count=1)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1, msg
    return msg


def test_a_row_the_tokenizer_cannot_encode_names_its_file_and_line(tmp_path):
    # a blank line before the bad record: the reported number is the file's line, not the row index + 1
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {"prompt": "C12x|", "response": "12"}, GOOD, {"prompt": "C1|",
                                                                                                       "response": "é"}],
                  blank_after=1)
    msg = _refused(_cfg(tmp_path, [path]))
    assert msg.startswith(f"{path}:4: the tokenizer cannot encode the prompt (ToyTokenizer cannot encode 'x' at offset "
                          "3 of 'C12x|'"), msg
    path = _jsonl(tmp_path / "r.jsonl", [GOOD, {"prompt": "C1|", "response": "é"}, {"prompt": "C1|", "response": "ü"}])
    msg = _refused(_cfg(tmp_path, [path]))
    assert msg.startswith(f"{path}:2: the tokenizer cannot encode the response") and msg.endswith("2 rows in all)"), msg


def test_a_prompt_too_long_under_truncate_error_names_line_and_both_numbers(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {"prompt": "C1234567|", "response": "1"}])
    msg = _refused(_cfg(tmp_path, [path]))
    assert msg.startswith(f"{path}:3: prompt has 10 tokens incl. BOS > data.layout.prompt_len=8 "
                          "(data.layout.truncate_prompt='error')"), msg
    DataPipeline(_cfg(tmp_path, [path], truncate_prompt="left"), process_index=0, process_count=1)  # truncates


def test_a_response_too_long_names_the_line_unless_dropped(tmp_path):
    first = _jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    second = _jsonl(tmp_path / "b.jsonl", [GOOD, {"prompt": "C1|", "response": "12345678"}, GOOD])
    msg = _refused(_cfg(tmp_path, [first, second]))
    assert msg.startswith(f"{second}:2: response has 9 tokens incl. EOS > data.layout.n_blocks x canvas_length = "
                          "2 x 4 = 8 (data.layout.response_overflow='error')"), msg
    DataPipeline(_cfg(tmp_path, [first, second], response_overflow="drop"), process_index=0, process_count=1)


def test_a_json_array_file_names_the_record(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, GOOD, GOOD, {"prompt": "C?|", "response": "1"}], indent=2))
    assert _refused(_cfg(tmp_path, [path])).startswith(f"{path}: record 4: the tokenizer cannot encode the prompt")


def test_a_gsm8k_answer_without_its_final_line_names_the_line(tmp_path):
    rows = [{"question": "1+1", "answer": "2\n#### 2"}, {"question": "2+2", "answer": "it is 4"}]
    path = _jsonl(tmp_path / "g.jsonl", rows)
    msg = _refused(_cfg(tmp_path, [path], source="gsm8k"))
    assert msg == f"{path}:2: GSM8K answer has no '####' final-answer line", msg


def test_the_kept_token_ids_give_the_batches_tokenizing_gives(tmp_path):
    rows = [{"prompt": f"C{i}{i + 1}|", "response": f"{i}{i + 1}" * (i % 3 + 1)} for i in range(1, 9)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _cfg(tmp_path, [path], prompt_len=6, truncate_prompt="left")
    cached = DataPipeline(cfg, process_index=0, process_count=1)
    assert cached._encoded_rows is not None and len(cached._encoded_rows) == len(rows)
    fresh = DataPipeline(cfg, process_index=0, process_count=1)
    fresh._encoded_rows = None  # tokenize each example, as the pipeline did before it kept the ids
    for step in range(4):
        a, b = cached.batch(step), fresh.batch(step)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_dgemma_train_refuses_a_bad_data_file_before_writing(tmp_path, capsys):
    from dgemma.cli.main import main

    path = _jsonl(tmp_path / "d.jsonl", [GOOD] * 20 + [{"prompt": "C1|", "response": "one"}])
    out = tmp_path / "runs"
    argv = ["train", "-c", str(REPO / "configs/stage1/tiny.yaml"), "--no-progress", "mesh.ici={fsdp: -1}",
            "optim.warmup_steps=0", "trainer.steps=1", "data.source=json", f"data.paths=[{path}]",
            f"data.cache_dir={tmp_path / 'hf_cache'}", f"run.output_dir={out}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("dgemma")]  # besides HF datasets' progress bars
    assert len(ours) == 1 and "Traceback" not in err, err
    assert f"{path}:21: the tokenizer cannot encode the response" in ours[0]
    assert not out.exists()
