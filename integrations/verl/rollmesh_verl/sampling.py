"""verl's sampling parameters (vLLM's and SGLang's names, as verl's agent loops send them) as rollmesh's.

Parameters that change which tokens are sampled and that rollmesh's engines do not implement are refused by name,
never ignored; parameters that only shape text (rollmesh serves tokens in, tokens out) are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollmesh.common.v1 import generation_pb2

# Accepted at their neutral value only: any other value changes the output and is refused.
_NEUTRAL: dict[str, Any] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "min_p": 0.0, "n": 1, "min_tokens": 0, "min_new_tokens": 0, "priority": 0}
# Shape text only, or say what to return besides the tokens: no effect on token ids and logprobs.
_TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize",
                        "include_stop_str_in_output", "prompt_logprobs", "return_logprob"})


class UnsupportedSampling(ValueError):
    """A sampling parameter rollmesh does not implement, at a value that would change the output."""


def sampling_params(params: Mapping[str, Any], *, default_max_tokens: int) -> generation_pb2.SamplingParams:
    """rollmesh's ``SamplingParams`` for verl's dict; ``default_max_tokens`` when it names no limit."""
    out = generation_pb2.SamplingParams()
    max_tokens = None
    for key, value in params.items():
        if key in ("max_tokens", "max_new_tokens"):
            max_tokens = int(value)
        elif key == "temperature":
            out.temperature = float(value)
        elif key == "top_p":
            out.top_p = float(value)
        elif key == "top_k":
            out.top_k = 0 if value is None or int(value) <= 0 else int(value)   # verl's -1: no limit
        elif key == "logprobs":
            out.logprobs = value is not None and value is not False   # vLLM's 0 asks for the sampled token's
        elif key == "seed":
            if value is not None:
                out.seed = int(value)
        elif key == "stop_token_ids":
            out.stop_token_ids.extend(int(t) for t in value or ())
        elif key == "ignore_eos":
            out.ignore_eos = bool(value)
        elif key == "stop":
            if value:
                raise UnsupportedSampling(f"sampling parameter 'stop' (stop strings, {str(value)[:40]!r}) is not "
                                          "supported by rollmesh, which generates tokens: use stop_token_ids")
        elif key in _NEUTRAL:
            if value is not None and value != _NEUTRAL[key]:
                raise UnsupportedSampling(f"sampling parameter {key!r}={str(value)[:20]} is not supported by "
                                          f"rollmesh's engines (only {_NEUTRAL[key]!r}); it would change the output")
        elif key not in _TEXT_ONLY:
            raise UnsupportedSampling(f"unknown sampling parameter {key[:40]!r} for rollmesh; supported: "
                                      "max_tokens (max_new_tokens), temperature, top_p, top_k, logprobs, seed, "
                                      "stop_token_ids, ignore_eos")
    limit = default_max_tokens if max_tokens is None else max_tokens
    if limit < 1:
        raise UnsupportedSampling(f"max_tokens must be >= 1, got {limit}")
    out.max_tokens = limit
    return out
