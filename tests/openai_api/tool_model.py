"""A tiny model that calls a tool: the tiny-llama preset fitted to answer one chat with a Hermes tool call.

The random presets never write ``<tool_call>`` on their own; an agent harness's tool loop needs a model
that does. A few hundred steps on one example (a few seconds on CPU) make greedy decoding of that chat
produce exactly :data:`ANSWER`. Saved as a Hugging Face directory with the presets' tokenizer, so the
torch engine serves it and the balancer reads its tokenizer and chat template from the directory.
"""

from __future__ import annotations

import json
from pathlib import Path

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "value of a key",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
MESSAGES = [{"role": "user", "content": "what is x?"}]
CALL = {"name": "lookup", "arguments": {"key": "x"}}
ANSWER = f"<tool_call>{json.dumps(CALL)}</tool_call>"


def fit_tool_model(directory: Path, *, seed: int = 3, steps: int = 400) -> Path:
    import torch

    from modeling.presets import build_preset_model
    from modeling.tokenizer import preset_tokenizer, save_preset_tokenizer

    tokenizer = preset_tokenizer()
    prompt = list(tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                                tokenize=True)["input_ids"])
    target = tokenizer.encode(ANSWER) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    model = build_preset_model("tiny-llama", seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 1e-3:
                break
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(target), do_sample=False)
    assert tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True) == ANSWER, "the fit did not converge"
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id   # stops at </s>
    model.save_pretrained(directory)
    save_preset_tokenizer(directory)
    return directory
