"""The fronts' incremental decoder: the same text as a full decode, in work linear in the completion's length,
on a byte-level BPE tokenizer (characters split over tokens), a SentencePiece-style one (leading spaces that
show only after another token) and the presets' (special tokens skipped or kept); and a streamed choice that
uses it."""

from __future__ import annotations

import asyncio
import random

import pytest

from loadbalancer.fronts.detokenize import IncrementalDecoder
from loadbalancer.fronts.openai_choices import ChoiceRun
from mesh_runtime.chat import ChatTokenizer
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé wörds, naïve café, façade.",
    "数据并行训练需要同步梯度。强化学习的采样与训练异步进行。",
    "Emoji: 🚀🔥✨ and mixed 中文 text with numbers 12345 and symbols <>{}[]",
    "def f(x):\n    return x ** 2  # a comment\n\tindented\n",
    "Ελληνικά και русский язык и العربية",
]


class Wrapped:
    """A ``ChatTokenizer`` over a ``tokenizers.Tokenizer``, counting the tokens it is asked to decode."""

    def __init__(self, core) -> None:
        self.chat = ChatTokenizer(core, chat_template=None, special_tokens={})
        self.decoded = 0

    def decode(self, ids, *, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.chat.decode(ids, skip_special_tokens=skip_special_tokens)


def _train(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte-level":
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|end|>"])
    else:   # SentencePiece-style: "▁" for a space, byte fallback for unknown characters
        core = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Metaspace()
        core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|end|>"]
                                      + [f"<0x{b:02X}>" for b in range(256)])
    core.train_from_iterator(CORPUS * 4, trainer)
    return core


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def core(request):
    return _train(request.param)


def _feed(decoder: IncrementalDecoder, ids: list[int], rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(ids):
        step = rng.choice([1, 1, 1, 2, 3, 7])
        pieces.append(decoder.extend(ids[at:at + step]))
        at += step
        assert decoder.text == "".join(pieces)
    return pieces


def test_real_text_decodes_as_a_whole_at_every_step(core):
    rng = random.Random(0)
    tokenizer = Wrapped(core)
    for text in CORPUS + ["   leading spaces", "ends with a space ", "a<|end|>b"]:
        ids = core.encode(text).ids
        for skip in (True, False):
            chunked = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
            _feed(chunked, ids, rng)
            assert chunked.text + chunked.pending() == tokenizer.chat.decode(ids, skip_special_tokens=skip)
            decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
            for end in range(1, len(ids) + 1):
                decoder.extend(ids[end - 1:end])
                whole = tokenizer.chat.decode(ids[:end], skip_special_tokens=skip)
                assert whole == decoder.text + decoder.pending()
                # text is held back only while the newest token ends inside a character
                assert decoder.text == whole or (whole.endswith("\ufffd") and whole.startswith(decoder.text))


def test_any_token_sequence_gives_the_full_decode(core):
    rng = random.Random(1)
    tokenizer = Wrapped(core)
    size = core.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 60))]
        decoder = IncrementalDecoder(tokenizer)
        _feed(decoder, ids, rng)
        whole = tokenizer.chat.decode(ids)
        assert decoder.text + decoder.pending() == whole and whole.startswith(decoder.text)


def test_decoding_work_is_linear_in_the_completion_length(core):
    """4,096 tokens fed one at a time: the tokens decoded stay a small multiple of 4,096 (a full decode per
    step would be about 8.4 million)."""
    rng = random.Random(2)
    text = " ".join(rng.choice(CORPUS) for _ in range(200))
    ids = core.encode(text).ids[:4096]
    assert len(ids) == 4096
    tokenizer = Wrapped(core)
    decoder = IncrementalDecoder(tokenizer)
    for token in ids:
        decoder.extend([token])
    assert decoder.text == tokenizer.chat.decode(ids)
    assert tokenizer.decoded < 12 * len(ids)


def test_skipped_special_tokens_are_consumed_without_text():
    tokenizer = ChatTokenizer.from_model("tiny-llama")
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.extend([t]) for t in [104, 1, 1, 105]] == ["h", "", "", "i"]
    kept = IncrementalDecoder(tokenizer, skip_special_tokens=False)
    assert "".join(kept.extend([t]) for t in [104, 1, 105]) == "h</s>i"


def test_a_streamed_choice_shows_split_characters_once_and_stops_inside_them(core):
    """A byte-level completion streamed one token at a time: the deltas add up to the full text, no delta
    shows half a character, and a stop string made of multi-byte characters cuts at its last token."""
    tokenizer = ChatTokenizer(core, chat_template=None, special_tokens={})
    text = CORPUS[1] + CORPUS[2]
    ids = core.encode(text).ids

    def generate(request):
        async def stream():
            for i, token in enumerate(ids):
                msg = pb.GenerateResponse(request_id=request.request_id, token_ids=[token], weight_version=1,
                                          replica_id="r")
                if i == len(ids) - 1:
                    msg.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                    msg.segments.add(token_ids=ids, weight_version=1, replica_id="r")
                yield msg
        return stream()

    async def collect(run):
        return [d async for d in run.deltas()]

    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[5])
    deltas = asyncio.run(collect(ChoiceRun(request, tokenizer, stop=[], parse_tools=False, generate=generate,
                                           call_prefix="c")))
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids) and len(deltas) == len(ids)
    assert not any("\ufffd" in d.text for d in deltas)
    run = ChoiceRun(request, tokenizer, stop=["🔥✨"], parse_tools=False, generate=generate, call_prefix="c")
    deltas = asyncio.run(collect(run))
    shown = "".join(d.text for d in deltas)
    whole = tokenizer.decode(ids)   # a tokenizer may not give back the text it encoded: compare with its decode
    assert shown == whole[:whole.index("🔥✨")] and deltas[-1].finish_reason == "stop"
    assert tokenizer.decode(run.result.token_ids).endswith("🔥✨")
    assert not tokenizer.decode(run.result.token_ids[:-1]).endswith("🔥✨")


def test_a_long_streamed_choice_decodes_each_token_a_bounded_number_of_times(core):
    """2,048 tokens, one per message, with a stop string that never comes: the choice asks its tokenizer to
    decode a small multiple of 2,048 tokens (decoding the whole completion per message: about 2.1 million)."""
    rng = random.Random(3)
    ids = core.encode(" ".join(rng.choice(CORPUS) for _ in range(100))).ids[:2048]
    tokenizer = Wrapped(core)

    def generate(request):
        async def stream():
            for i, token in enumerate(ids):
                msg = pb.GenerateResponse(request_id=request.request_id, token_ids=[token], replica_id="r")
                if i == len(ids) - 1:
                    msg.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                yield msg
        return stream()

    async def collect(run):
        return [d async for d in run.deltas()]

    run = ChoiceRun(pb.GenerateRequest(request_id="r"), tokenizer, stop=["never said"], parse_tools=False,
                    generate=generate, call_prefix="c")
    deltas = asyncio.run(collect(run))
    assert "".join(d.text for d in deltas) == tokenizer.chat.decode(ids)
    assert tokenizer.decoded < 12 * len(ids)
