"""verl-format datasets and reward functions: parquet/JSONL rows rendered with the model's tokenizer and chat
template, verl's data keys (truncation, filtering, shuffle), compute_score called with verl's signature (a
float, or a dict whose extras become metrics), failures that name the row, and the config checks."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from mesh_runtime.config import ConfigError, load_config
from modeling.tokenizer import preset_tokenizer
from trainer_agent.config import TrainerAgentConfig
from trainer_agent.training.data import DatasetError, load_dataset, prompt_order
from trainer_agent.training.rewards import RewardFunctionError, RewardScorer

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == ground_truth else 0.0

def with_extras(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) > 0), "length": float(len(solution_str)), "note": "text is ignored"}

def broken(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        raise KeyError("no answer field")
    return 0.5

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "high"
'''


def verl_rows(count: int = 3) -> list[dict]:
    """Rows as verl's data preprocessing scripts write them (gsm8k-style)."""
    return [{"data_source": "toy/add", "ability": "math",
             "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(count)]


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    return path


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return path


def test_rows_are_rendered_with_the_chat_template(parquet):
    tokenizer = preset_tokenizer()
    rows = load_dataset(str(parquet), tokenizer)
    assert [r.prompt_id for r in rows] == ["r0", "r1", "r2"]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert list(rows[1].token_ids) == expected and tokenizer.decode(rows[1].token_ids).endswith("<|assistant|>")
    assert (rows[1].data_source, rows[1].ground_truth, rows[1].extra_info["index"]) == ("toy/add", "2", 1)


def test_jsonl_and_string_prompts(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"say {i}", "reward_model": {"ground_truth": str(i)}})
                              for i in range(2)) + "\n")
    rows = load_dataset([str(path)], preset_tokenizer(), prompt_key="question")
    assert preset_tokenizer().decode(rows[0].token_ids) == "say 0" and rows[1].ground_truth == "1"


def test_long_prompts_follow_truncation_and_filter_overlong_prompts(tmp_path):
    rows = verl_rows(2)
    rows[1]["prompt"] = [{"role": "user", "content": "x" * 100}]
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tokenizer = preset_tokenizer()
    with pytest.raises(DatasetError, match="row 1: the prompt is .* more than data.max_prompt_length 20"):
        load_dataset(str(path), tokenizer, max_prompt_length=20)
    left = load_dataset(str(path), tokenizer, max_prompt_length=20, truncation="left")
    assert len(left[1].token_ids) == 20 and tokenizer.decode(left[1].token_ids).endswith("<|assistant|>")
    right = load_dataset(str(path), tokenizer, max_prompt_length=20, truncation="right")
    assert tokenizer.decode(right[1].token_ids).startswith("<|user|>xxx")
    assert [r.row for r in load_dataset(str(path), tokenizer, max_prompt_length=20,
                                        filter_overlong_prompts=True)] == [0]


def test_the_order_is_shuffled_per_pass_from_the_seed(parquet):
    rows = load_dataset(str(parquet), preset_tokenizer())
    order = prompt_order(rows, shuffle=True, seed=1)
    first = [next(order).row for _ in range(6)]
    again = prompt_order(rows, shuffle=True, seed=1)
    assert [next(again).row for _ in range(6)] == first and sorted(first[:3]) == [0, 1, 2]
    plain = prompt_order(rows, shuffle=False, seed=1)
    assert [next(plain).row for _ in range(4)] == [0, 1, 2, 0]


@pytest.mark.parametrize("workers", [0, 2])
def test_reward_functions_are_called_with_verls_signature(parquet, reward_file, workers):
    tokenizer = preset_tokenizer()
    rows = load_dataset(str(parquet), tokenizer)
    answer = tokenizer("2", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    scorer = RewardScorer(str(reward_file), "compute_score", tokenizer, num_workers=workers)
    try:
        scores, extra = scorer.score([(rows[1], answer), (rows[0], answer)])
    finally:
        scorer.close()
    assert scores == [1.0, 0.0] and extra == {}
    extras = RewardScorer(str(reward_file), "with_extras", tokenizer)
    scores, extra = extras.score([(rows[0], answer), (rows[1], answer + answer)])
    assert scores == [1.0, 1.0] and extra == {"reward_extra/length": 1.5}


def test_a_failing_reward_names_the_row_and_the_traceback(parquet, reward_file):
    tokenizer = preset_tokenizer()
    rows = load_dataset(str(parquet), tokenizer)
    scorer = RewardScorer(str(reward_file), "broken", tokenizer)
    with pytest.raises(RewardFunctionError, match=r"(?s)failed on row 1 .*Traceback.*KeyError: 'no answer field'"):
        scorer.score([(rows[0], [72]), (rows[1], [72])])
    with pytest.raises(RewardFunctionError, match="not a finite number"):
        RewardScorer(str(reward_file), "not_a_number", tokenizer).score([(rows[0], [72])])
    with pytest.raises(RewardFunctionError, match="has no function 'nope'"):
        RewardScorer(str(reward_file), "nope", tokenizer)


def test_the_config_names_what_is_wrong(tmp_path, parquet, reward_file):
    def load(**sections):
        path = tmp_path / "trainer.yaml"
        path.write_text(yaml.safe_dump(sections))
        return load_config(TrainerAgentConfig, path)

    good = load(data={"train_files": str(parquet)}, custom_reward_function={"path": str(reward_file)})
    assert good.data.enabled and good.data.seed == 1 and good.data.max_response_length == 512
    with pytest.raises(ConfigError, match="data.train_files.*does not exist"):
        load(data={"train_files": [str(tmp_path / "missing.parquet")]},
             custom_reward_function={"path": str(reward_file)})
    with pytest.raises(ConfigError, match="no column 'question'"):
        load(data={"train_files": str(parquet), "prompt_key": "question"},
             custom_reward_function={"path": str(reward_file)})
    with pytest.raises(ConfigError, match="needs a reward function"):
        load(data={"train_files": str(parquet)})
    with pytest.raises(ConfigError, match="custom_reward_function.path.*does not exist"):
        load(custom_reward_function={"path": str(tmp_path / "nope.py")})
    with pytest.raises(ConfigError, match="truncation"):
        load(data={"truncation": "middle"})
