"""The quick start's reward function, in verl's custom_reward_function form.

``ground_truth`` is the kind of character the prompt asks for (``digits`` or ``capitals``); the score is the
share of the first ``LENGTH`` characters of the response that are of that kind (a missing character counts
as wrong), so it moves smoothly from the random model's near 0 to 1.
"""

LENGTH = 3


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    check = (lambda ch: "0" <= ch <= "9") if ground_truth == "digits" else (lambda ch: "A" <= ch <= "Z")
    hits = sum(1 for ch in solution_str[:LENGTH] if check(ch))
    return {"score": hits / LENGTH, "chars_of_kind": float(hits)}
