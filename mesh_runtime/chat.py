"""Text, chat templates and tool calls without torch: what the balancer's OpenAI front and the driver's
multi-turn rollouts need of a model's tokenizer.

:class:`ChatTokenizer` reads a Hugging Face model directory the way ``transformers`` does for these
purposes (``tokenizer.json`` through the ``tokenizers`` library; the chat template from
``chat_template.jinja`` or ``tokenizer_config.json``, rendered with Jinja2 in a sandbox with the globals
and filters ``transformers`` gives templates), so the load balancer, which runs no model, renders exactly
the prompt ids a ``transformers`` tokenizer would. A preset name (``tiny-llama``) gets the presets'
character-level tokenizer, built here from its vocabulary.

Tool calls follow the Hermes convention that Qwen's and verl's tool agent loop use: the model writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; :func:`parse_tool_calls` takes them out of
the text and reports malformed ones instead of raising.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:   # both load only when a tokenizer or template is built
    import jinja2
    from tokenizers import Tokenizer

VOCAB_SIZE = 256
SPECIALS = ("<pad>", "</s>", "<sep>", "<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>")
PRESET_CONTEXT = {"tiny-llama": 512, "tiny-qwen2": 512, "small-llama": 2048, "medium-llama": 2048}
"""Longest sequence (prompt + completion) of each model preset (``modeling.presets``; a test keeps them equal)."""

# The presets' chat template: <|role|>content</s> per message, <|assistant|> to prompt the model. With tools,
# a system turn lists them (one JSON object per line inside <tools></tools>) and says how to call them;
# an assistant's calls follow its content as <tool_call>JSON</tool_call>; a tool's result is a user turn
# wrapped in <tool_response></tool_response> (the Hermes/Qwen layout). Without tools it renders as before.
CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "\n\n{% endif %}# Tools\nCall a function by replying <tool_call>{\"name\": NAME, \"arguments\": {...}}"
    "</tool_call>. Functions:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools></s>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}<|user|><tool_response>{{ message['content'] }}</tool_response></s>"
    "{%- else %}<|{{ message['role'] }}|>{{ message['content'] if message['content'] is not none else '' }}"
    "{%- for call in message.get('tool_calls') or [] %}{% set f = call['function'] if 'function' in call else call %}"
    "<tool_call>{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}</tool_call>"
    "{%- endfor %}</s>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


class ChatError(ValueError):
    """A model directory, a template or a conversation this module cannot use (the message says which)."""


def preset_vocab() -> dict[str, int]:
    """The presets' 256-token vocabulary: specials, tab, newline and printable ASCII at their code points,
    every other id an unused ``<extra_N>``."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for code in (9, 10, *range(32, 127)):
        vocab[chr(code)] = code
    for i in range(VOCAB_SIZE):
        if i not in vocab.values():
            vocab[f"<extra_{i}>"] = i
    return vocab


def build_preset_core(*, with_specials: bool = True) -> Tokenizer:
    """A new presets' ``tokenizers.Tokenizer`` (one character per token); ``with_specials``: the special
    tokens registered as such (whole, skipped by decode), as ``transformers`` registers them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    core = Tokenizer(models.WordLevel(preset_vocab(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")   # newlines too
    core.decoder = decoders.Fuse()
    if with_specials:
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return core


@functools.cache
def preset_core_tokenizer() -> Tokenizer:
    """The presets' tokenizer, built once per process."""
    return build_preset_core()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass
class ToolCall:
    """One call the model made: its function's name and its arguments as a JSON object text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedOutput:
    """A model turn split into its text and its tool calls; ``errors`` says what could not be read."""

    content: str
    tool_calls: list[ToolCall]
    errors: list[str]


_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


def parse_tool_calls(text: str, *, id_prefix: str = "call") -> ParsedOutput:
    """Take the Hermes ``<tool_call>{json}</tool_call>`` blocks out of ``text`` (an unclosed last block
    counts: the model may stop right after its JSON). A block that is not a JSON object with a string
    ``name`` and object (or JSON-text) ``arguments`` is an error, never an exception."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for index, match in enumerate(_CALL.finditer(text)):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            errors.append(f"tool call {index} is not valid JSON ({err.msg} at {err.pos}): {body[:80]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            errors.append(f"tool call {index} needs a string 'name': {body[:80]!r}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                errors.append(f"tool call {index} ({call['name'][:40]}): 'arguments' is not a JSON object")
                continue
        if not isinstance(arguments, dict):
            errors.append(f"tool call {index} ({call['name'][:40]}): 'arguments' must be an object")
            continue
        calls.append(ToolCall(f"{id_prefix}-{index}", call["name"], json.dumps(arguments, ensure_ascii=False)))
    content = _CALL.sub("", text).strip() if calls or errors else text
    return ParsedOutput(content, calls, errors)


class ChatTokenizer:
    """Encode, decode and render chats for one model, with ``tokenizers`` and Jinja2 only."""

    def __init__(self, core: Tokenizer, *, chat_template: str | None, special_tokens: dict[str, str | None],
                 max_model_len: int | None = None, name: str = "") -> None:
        self.core = core
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.max_model_len = max_model_len
        self.name = name
        eos = special_tokens.get("eos_token")
        self.eos_token_id: int | None = core.token_to_id(eos) if eos else None
        self._template: Any = None

    @classmethod
    def from_model(cls, model: str) -> ChatTokenizer:
        """The tokenizer of a Hugging Face model directory, or the presets' for a preset name."""
        if model in PRESET_CONTEXT:
            return cls(preset_core_tokenizer(), chat_template=CHAT_TEMPLATE,
                       special_tokens={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                                       "unk_token": "<unk>"},
                       max_model_len=PRESET_CONTEXT[model], name=model)
        return cls._from_directory(Path(model))

    @classmethod
    def _from_directory(cls, directory: Path) -> ChatTokenizer:
        from tokenizers import Tokenizer  # noqa: PLC0415

        if not (directory / "tokenizer.json").is_file():
            raise ChatError(f"{str(directory)[:200]} is neither a model preset ({', '.join(PRESET_CONTEXT)}) "
                            "nor a model directory with a tokenizer.json")
        core = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        template: Any = None
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        elif (directory / "chat_template.json").is_file():
            template = _read_json(directory / "chat_template.json").get("chat_template")
        else:
            template = config.get("chat_template")
        if isinstance(template, list):   # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        model_config = _read_json(directory / "config.json")
        max_len = model_config.get("max_position_embeddings")
        limit = config.get("model_max_length")
        if isinstance(limit, int) and limit < 10**9:
            max_len = min(max_len, limit) if isinstance(max_len, int) else limit
        specials = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token",
                                                                   "unk_token")}
        return cls(core, chat_template=template, special_tokens=specials,
                   max_model_len=max_len if isinstance(max_len, int) else None, name=directory.name)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.core.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.core.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (the ``token`` of a logprob entry)."""
        return self.core.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ chat
    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The chat template applied to ``messages`` (and ``tools``), as ``transformers``'
        ``apply_chat_template(..., tokenize=False)`` renders it."""
        if self.chat_template is None:
            raise ChatError(f"model {self.name[:80]!r} has no chat template; use completions with a prompt")
        if self._template is None:
            self._template = _compile(self.chat_template)
        template = self._template
        import jinja2  # noqa: PLC0415

        try:
            return template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special_tokens.items() if v is not None},
                                         **extra)
        except jinja2.TemplateError as err:
            raise ChatError(f"the chat template cannot render this conversation: {str(err)[:200]}") from None

    def encode_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a chat (the rendered text already holds its special tokens)."""
        return self.encode(self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt),
                           add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ChatError(f"{str(path)[:200]} is not valid JSON: {err}") from None
    return value if isinstance(value, dict) else {}


def _compile(source: str) -> jinja2.Template:
    """A sandboxed template with what ``transformers`` gives chat templates: ``raise_exception``,
    ``strftime_now``, a ``tojson`` that keeps non-ASCII, loop controls, trimmed blocks."""
    import datetime  # noqa: PLC0415

    import jinja2  # noqa: PLC0415
    from jinja2.ext import loopcontrols  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatError(f"the model's chat template does not compile: {err}") from None
