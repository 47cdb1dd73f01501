"""A prompt plus its new tokens longer than the model's context (or grpo.max_sequence_length)
is refused before run_start, naming the task and the lengths (it used to crash mid-run
with ``index out of range in self``, unslothai/unsloth#1642)."""

import json
import shutil

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import parse_config
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.tasks.base import Task
from mlperf_grpo.tasks.lengths import PromptTooLongError, check_prompt_lengths

# The built-in tokenizer: one token per character of "0123456789+=", plus <bos> in front.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}0000000000={% endif %}"


def _gpt2(tmp_path, n_positions=16, chat_template=None):
    """A GPT-2 of context ``n_positions`` with the built-in character tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=15, n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    directory = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    if chat_template is not None:
        tok = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": chat_template}))
    return directory


def _rows(path, prompts, prefix):
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "prompt": p, "answer": "3"}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def _jsonl_run(tmp_path, model, train_prompts, validation_prompts, **grpo):
    config = {"model": {"path": str(model)},
              "grpo": {"num_prompts_per_step": 4, "max_steps": 2, "first_eval_step": 1, **grpo},
              "validation": {"num_tasks": len(validation_prompts)},
              "task": {"name": "jsonl", "num_train_tasks": len(train_prompts),
                       "train_path": str(_rows(tmp_path / "train.jsonl", train_prompts, "t")),
                       "validation_path": str(_rows(tmp_path / "validation.jsonl", validation_prompts, "v"))}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


SHORT = [f"{i % 10}+{i // 10 % 10}=" for i in range(63)]  # 5 tokens each: 5 + 6 new = 11 <= 16
LONG = "1234567890+12345678"  # 19 characters: 20 tokens with <bos>


@pytest.mark.parametrize("where", ["training", "validation"])
def test_a_prompt_longer_than_the_context_exits_2_before_anything_is_written(tmp_path, capsys, where):
    """The issue's case: GPT-2 of context 16, one 20-token prompt among 64 training prompts."""
    train = SHORT + [LONG if where == "training" else "99+9="]
    validation = ["11+1=", LONG if where == "validation" else "33+3=", "22+2="]
    config = _jsonl_run(tmp_path, _gpt2(tmp_path), train, validation)
    capsys.readouterr()  # save_pretrained's progress bar
    task_id = "t63" if where == "training" else "v1"
    assert main(["train", "--config", str(config), "--output", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    total = len(train) if where == "training" else len(validation)
    assert line == (
        f"mlperf-grpo: error: {where} task {task_id!r}: its prompt is 20 tokens, + grpo.max_new_tokens 6 = 26 tokens, "
        f"over the model's context (n_positions 16 in config.json) (1 of {total} {where} prompts are over it); "
        "shorten or drop those prompts, lower grpo.max_new_tokens, or use a model with a longer context")
    assert not (tmp_path / "run").exists()


def test_the_new_tokens_count_against_the_context(tmp_path):
    """A 12-token prompt fits a context of 16 alone, not with 6 new tokens; with 4 it fits
    exactly (16 = 16: positions 0..15 all have a row of GPT-2's position embedding)."""
    model = _gpt2(tmp_path)
    tasks = {"training": [Task("t0", "1+2=", "3"), Task("t1", "12345+67890", "3")]}  # 5 and 12 tokens
    with pytest.raises(PromptTooLongError, match=r"training task 't1': its prompt is 12 tokens, \+ grpo.max_new_tokens "
                                                 r"6 = 18 tokens, over the model's context \(n_positions 16"):
        check_prompt_lengths(parse_config({"model": {"path": str(model)}}), tasks)
    check_prompt_lengths(parse_config({"model": {"path": str(model)}, "grpo": {"max_new_tokens": 4}}), tasks)


def test_grpo_max_sequence_length_is_enforced(tmp_path):
    """The built-in model (context 65536): a prompt of 7 tokens + 6 new is over a
    max_sequence_length of 12, and fits 13."""
    tasks = {"validation": [Task("v0", "12+34=", "46")]}  # <bos> + 6 characters
    with pytest.raises(PromptTooLongError, match=r"= 13 tokens, over grpo.max_sequence_length 12 \(1 of 1") as err:
        check_prompt_lengths(parse_config({"grpo": {"max_sequence_length": 12}}), tasks)
    # the remedy is the setting, not another model (whose context, 65,536, is not what binds)
    assert str(err.value).endswith("lower grpo.max_new_tokens, or raise grpo.max_sequence_length")
    check_prompt_lengths(parse_config({"grpo": {"max_sequence_length": 13}}), tasks)


def test_a_chat_prompt_is_measured_as_its_rendered_template(tmp_path, capsys):
    """A ``messages`` row is measured as the engines see it: the chat template's text
    (here "1+2" + "0000000000=": 15 tokens with <bos>), not the row's short prompt field."""
    model = _gpt2(tmp_path, chat_template=CHAT_TEMPLATE)
    config = _jsonl_run(tmp_path, model, SHORT + ["88+8="], ["11+1=", "22+2="])
    capsys.readouterr()  # save_pretrained's progress bar
    rows = (tmp_path / "train.jsonl").read_text().splitlines()
    rows[0] = json.dumps({**json.loads(rows[0]), "messages": [{"role": "user", "content": "1+2"}]})
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    assert main(["train", "--config", str(config), "--output", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "training task 't0': its prompt is 15 tokens, + grpo.max_new_tokens 6 = 21 tokens" in line
    assert not (tmp_path / "run").exists()


def test_evaluate_checks_the_validation_prompts_before_anything(tmp_path):
    """``evaluate`` refuses the same way before taking the run's lock or reading its log."""
    from mlperf_grpo.config.rundir import RunDir
    from mlperf_grpo.evaluate.offline import SeriesRequest, evaluate_series

    config = parse_config({"grpo": {"max_sequence_length": 12}})
    with pytest.raises(PromptTooLongError, match=r"validation task '.*': its prompt is \d+ tokens"):
        evaluate_series(SeriesRequest(RunDir(tmp_path / "run"), None, config, tmp_path / "run" / "mlperf.log"))
    assert not (tmp_path / "run").exists()


def test_an_agent_context_over_a_limit_is_refused():
    # an agent's trajectory runs to agent.max_context_tokens, whatever grpo.max_new_tokens: 100,000 on
    # the built-in model (context 65,536), or over grpo.max_sequence_length, trained past either
    tasks = {"training": [Task("t0", "12+34=", "46")]}
    config = parse_config({"agent": {"max_context_tokens": 65537}})
    check_prompt_lengths(config, tasks)  # not an agent's samples: the prompts alone are checked
    with pytest.raises(PromptTooLongError) as err:
        check_prompt_lengths(config, tasks, agentic=True)
    assert str(err.value) == ("agent.max_context_tokens 65537 is over the model's context (max_position_embeddings "
                              "65536 in config.json): an agent trajectory runs to it; lower agent.max_context_tokens "
                              "to at most 65536, or use a model with a longer context")
    config = parse_config({"agent": {"max_context_tokens": 8192}, "grpo": {"max_sequence_length": 4096}})
    with pytest.raises(PromptTooLongError, match=r"over grpo.max_sequence_length 4096: .* at most 4096, or raise "
                                                 r"grpo.max_sequence_length$"):
        check_prompt_lengths(config, tasks, agentic=True)
    check_prompt_lengths(parse_config({"agent": {"max_context_tokens": 4096}, "grpo": {"max_sequence_length": 4096}}),
                         tasks, agentic=True)
