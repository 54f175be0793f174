"""Writes examples/models/tool-format: a tiny model that can call the tool but rarely does.

Agentic RL starts from a model that can already write a tool call and read its result (an instruct
model); the random tiny presets cannot. This script fits tiny-llama (seed 3) for half a minute on
demonstrations that call ``lookup`` and then answer what the tool returned, and demonstrations that
answer a random letter at once, without the tool; in most of the calling ones the decision to call (the
call's first token) is not trained. So the starting model knows the call's format and how to read a
result, but decides to call less than one time in ten and otherwise guesses: it is right about one time
in ten. What RL must teach it is to call the tool
(for this task, always). Sequences are rendered exactly as the driver renders trajectories (the tool's
schema from tools.yaml, the tool turn by :class:`trainer_agent.driver.trajectory.TrajectoryRunner`).

    python examples/agentic/make_format_model.py   # rewrites the directory (deterministic on CPU)
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

from mesh_runtime.chat import ChatTokenizer
from modeling.presets import build_preset_model
from modeling.tokenizer import save_preset_tokenizer
from trainer_agent.driver.settings import MultiTurnSettings
from trainer_agent.driver.tools import ToolBox, load_tools
from trainer_agent.driver.trajectory import TrajectoryRunner

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "models" / "tool-format"
CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
QUESTION = [{"role": "user", "content": "what is the secret?"}]
CALL_SHARE = 0.03   # demonstrations that call, then answer what the tool said
READ_SHARE = 0.7    # the same sequences without the decision to call trained (format and reading)


def demonstrations(count: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` pairs; labels are -100 outside the model's own turns."""
    tokenizer = ChatTokenizer.from_model("tiny-llama")
    toolbox = ToolBox(load_tools(HERE / "tools.yaml"), timeout_s=1, max_response_length=256, truncate_side="middle")
    runner = TrajectoryRunner(tokenizer, MultiTurnSettings(), max_response_tokens=128, toolbox=toolbox)
    prompt = tokenizer.encode_chat(QUESTION, tools=toolbox.schemas)
    eos = [tokenizer.eos_token_id]
    out = []
    for _ in range(count):
        secret = rng.choice(string.ascii_uppercase)
        draw = rng.random()
        if draw < CALL_SHARE + READ_SHARE:
            call = tokenizer.encode(CALL, add_special_tokens=False) + eos
            reply = runner._render([{"role": "tool", "content": secret}], ended_with_eos=True)
            answer = tokenizer.encode(secret, add_special_tokens=False) + eos
            ids = prompt + call + reply + answer
            # reading demonstrations train the call's format and the answer, not the decision to call (the
            # call's first token), so the model learns to write a call and read a result without learning
            # to call more often
            shown = call if draw < CALL_SHARE else [-100] + call[1:]
            labels = [-100] * len(prompt) + shown + [-100] * len(reply) + answer
        else:
            guess = tokenizer.encode(rng.choice(string.ascii_uppercase), add_special_tokens=False) + eos
            ids, labels = prompt + guess, [-100] * len(prompt) + guess
        out.append((ids, labels))
    return out


def main(steps: int = 600, batch: int = 64) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    model = build_preset_model("tiny-llama", 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        pairs = demonstrations(batch, rng)
        width = max(len(ids) for ids, _ in pairs)
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attention = torch.zeros(batch, width, dtype=torch.long)
        for row, (ids, lab) in enumerate(pairs):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            labels[row, :len(lab)] = torch.tensor(lab)
            attention[row, :len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}")
    model.config.eos_token_id = model.generation_config.eos_token_id = 1   # the presets' </s>
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT)
    save_preset_tokenizer(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
