"""The multi-turn example's reward, in verl's custom_reward_function form.

``solution_str`` is the whole decoded response: the model's turns and the tool's responses (special tokens
left out), e.g. ``<tool_call>{...}</tool_call><tool_response>Q</tool_response>Q``. The score is 1 when the
model called the tool and then answered exactly the row's secret letter, else 0: an answer not grounded in
the tool's result earns nothing, even a lucky guess (one in 26).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    called = "</tool_response>" in solution_str
    answer = solution_str.rsplit("</tool_response>", 1)[-1].strip()
    return {"score": float(called and answer == ground_truth), "called_tool": float(called)}
