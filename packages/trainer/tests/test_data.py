import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from drivetrain.trainer.data.batching import StepPlan, make_batch
from drivetrain.trainer.data.files import iter_rows
from drivetrain.trainer.data.tokenize import (
    LengthLimit,
    RowKeys,
    longest_token_chars,
    tokenize_row,
    truncate,
)
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.sft.config import DataConfig
from drivetrain.trainer.sft.dataset import load_sft_data
from trainer_fixtures import write_jsonl

#: long enough for every row here: no characters or tokens are cut
NO_LIMIT = LengthLimit(10**6, "data.max_length=1000000", "error", chars_per_token=1)


def limit(tokens: int, policy: str) -> LengthLimit:
    return LengthLimit(tokens, f"data.max_length={tokens}", policy, chars_per_token=1)


CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}


def targets(tokenizer, example):
    return tokenizer.decode(
        [t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
    )


def test_chat_loss_covers_assistant_turns_only(tokenizer):
    example = tokenize_row(tokenizer, CHAT, RowKeys(), "row 0", NO_LIMIT)
    assert targets(tokenizer, example) == "3<|end|>4<|end|>"
    assert tokenizer.decode(example.input_ids).startswith("<|system|>be brief")


def test_prompt_response_rows_use_the_chat_template(tokenizer):
    example = tokenize_row(tokenizer, {"prompt": "hi", "response": "yo"}, RowKeys(), "r", NO_LIMIT)
    assert tokenizer.decode(example.input_ids) == "<|user|>hi<|end|><|assistant|>yo<|end|>"
    assert targets(tokenizer, example) == "yo<|end|>"


def test_custom_keys(tokenizer):
    keys = RowKeys(prompt="q", response="a")
    example = tokenize_row(tokenizer, {"q": "hi", "a": "yo"}, keys, "row 0", NO_LIMIT)
    assert targets(tokenizer, example) == "yo<|end|>"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "x"}, "expected 'messages' or 'prompt'\\+'response' keys, found: text"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
        ({"prompt": 1, "response": "x"}, "must be strings"),
    ],
)
def test_malformed_rows_are_named(tokenizer, row, message):
    with pytest.raises(DataError, match=f"row 7: .*{message}"):
        tokenize_row(tokenizer, row, RowKeys(), "f.jsonl row 7", NO_LIMIT)


def test_truncation_policies(tokenizer):
    row = {"prompt": "abcdef", "response": "xyz"}
    example = tokenize_row(tokenizer, row, RowKeys(), "r", NO_LIMIT)
    with pytest.raises(DataError, match="r: 13 tokens is longer than data.max_length=10"):
        truncate(example, limit(10, "error"), "r")
    left = truncate(example, limit(10, "left"), "r")
    assert left.input_ids == example.input_ids[-10:] and left.loss_mask[0] == 0
    assert targets(tokenizer, left) == "xyz<|end|>"
    assert targets(tokenizer, truncate(example, limit(10, "right"), "r")) == "x"
    assert truncate(example, limit(8, "right"), "r") is None  # the response was cut away entirely


class UntouchableTokenizer:
    """Fails the test when asked to tokenise."""

    chat_template = None

    def __call__(self, *args, **kwargs):
        raise AssertionError("tokenised a row that could not fit")


@pytest.mark.fault
def test_too_many_characters_are_refused_before_tokenising():
    row = {"prompt": "a" * 1000, "response": "b"}
    with pytest.raises(
        DataError, match=r"f.jsonl:3: 1,001 characters cannot fit in 10 tokens \(data.max_length=10"
    ):
        tokenize_row(UntouchableTokenizer(), row, RowKeys(), "f.jsonl:3", limit(10, "error"))


@pytest.mark.parametrize("policy", ["left", "right"])
@pytest.mark.parametrize("chat", [True, False])
def test_long_rows_are_cut_to_characters_then_tokens(tokenizer, policy, chat):
    """Cutting the characters first keeps exactly the tokens the whole row would keep."""
    row = {"prompt": "1234567890" * 3, "response": "abcdefghij" * 1000}
    if chat:
        row = {"messages": [{"role": "user", "content": row["prompt"]},
                            {"role": "assistant", "content": row["response"]}]}  # fmt: skip
    bounded = LengthLimit(100, "data.max_length=100", policy, longest_token_chars(tokenizer))
    assert bounded.max_chars < 10_000  # the row is over the character bound
    cut = truncate(tokenize_row(tokenizer, row, RowKeys(), "r", bounded), bounded, "r")
    whole = truncate(tokenize_row(tokenizer, row, RowKeys(), "r", NO_LIMIT), bounded, "r")
    assert len(cut) == 100 and cut == whole


def test_missing_corrupt_and_empty_files(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        iter_rows(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        list(iter_rows(bad))
    corrupt = tmp_path / "bad.parquet"
    corrupt.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        list(iter_rows(corrupt))
    with pytest.raises(DataError, match="unknown format"):
        (tmp_path / "x.csv").write_text("a")
        iter_rows(tmp_path / "x.csv")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="holds no usable example"):
        load_sft_data(DataConfig(train_path=str(empty)), tokenizer, seed=0)


def test_parquet_and_validation_split(tmp_path, tokenizer):
    rows = [{"prompt": f"{i}+1", "response": str(i + 1)} for i in range(20)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = load_sft_data(DataConfig(train_path=str(path), val_ratio=0.25), tokenizer, seed=3)
    assert (len(data.train), len(data.val)) == (15, 5)
    again = load_sft_data(DataConfig(train_path=str(path), val_ratio=0.25), tokenizer, seed=3)
    assert again == data


def test_explicit_validation_file(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "response": "b"}] * 4)
    val = write_jsonl(tmp_path / "v.json", [])
    val.write_text('[{"prompt": "c", "response": "d"}]')
    data = load_sft_data(DataConfig(train_path=str(train), val_path=str(val)), tokenizer, 0)
    assert (len(data.train), len(data.val)) == (4, 1)


def test_step_plan_is_a_function_of_seed_and_step():
    plan = StepPlan(10, 3, seed=5)
    assert plan.steps_per_epoch == 3
    first_epoch = [i for step in range(3) for i in plan.indices(step)]
    assert len(set(first_epoch)) == 9
    assert plan.indices(4) == StepPlan(10, 3, seed=5).indices(4)
    assert plan.indices(3) != plan.indices(0) or plan.epoch_order(1) != plan.epoch_order(0)
    assert StepPlan(10, 3, seed=0, shuffle=False).indices(1) == [3, 4, 5]
    with pytest.raises(ValueError, match="larger than the 2 training examples"):
        StepPlan(2, 3, seed=0)


def test_batches_in_both_layouts(tokenizer):
    rows = [{"prompt": "a", "response": "bc"}, {"prompt": "abcd", "response": "e"}]
    examples = [tokenize_row(tokenizer, r, RowKeys(), "r", NO_LIMIT) for r in rows]
    padded = make_batch(examples, pad_token_id=0, packed=False)
    packed = make_batch(examples, pad_token_id=0, packed=True)
    assert padded["input_ids"].shape == (2, max(len(e) for e in examples))
    assert packed["input_ids"].shape == (sum(len(e) for e in examples),)
    assert packed["loss_mask"].sum() == padded["loss_mask"].sum() == 5
