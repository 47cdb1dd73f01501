"""The compiled decoder layers serve passes of any rows and width with one graph: duck sizing
(sizes equal at the first compile made one symbol) recompiled every layer when a square first
pass was followed by one of other rows."""

import shutil

import pytest
import torch
import torch.fx.experimental._config as shape_config
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from mlperf_grpo.model.compile import compile_decoder_layers

HIDDEN = 16


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_a_pass_of_other_rows_after_a_square_one_does_not_recompile_the_layers(monkeypatch):
    monkeypatch.setattr(shape_config, "use_duck_shape", True)  # torch's default
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    compile_decoder_layers(model)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 32, (HIDDEN, HIDDEN)))  # rows = width = hidden size
        graphs = counters["stats"]["unique_graphs"]
        model(input_ids=torch.randint(0, 32, (5, HIDDEN)))
        model(input_ids=torch.randint(0, 32, (5, 24)))
    assert graphs > 0
    assert counters["stats"]["unique_graphs"] == graphs
