"""modeling.versions: the supported floor of torch and transformers, refused below it at start-up, and the KV-cache
keyword that differs between transformers releases."""

from __future__ import annotations

import inspect

import pytest
import torch

from modeling import versions
from modeling.presets import build_preset_model

pytestmark = [pytest.mark.timeout(120), pytest.mark.pins]


@pytest.mark.parametrize("text, release", [("2.14.0+cu130", (2, 14, 0)), ("5.20.2", (5, 20, 2)),
                                           ("5.25.0.dev0", (5, 25, 0)), ("2.13.0rc1", (2, 13, 0)), ("x", ())])
def test_release_numbers_ignore_local_and_pre_release_tails(text, release):
    assert versions._release(text) == release


def test_the_installed_versions_are_supported():
    versions.check_supported()
    assert versions.describe() == f"torch {torch.__version__}, transformers {versions.installed()['transformers']}"


@pytest.mark.parametrize("installed, named", [
    ({"torch": "2.12.1", "transformers": "5.24.0"}, ["torch 2.12.1 (rollmesh needs >= 2.13)"]),
    ({"torch": "2.14.0", "transformers": "5.10.1"}, ["transformers 5.10.1 (rollmesh needs >= 5.20)"]),
    ({"torch": "2.9.1", "transformers": "4.57.1"}, ["torch 2.9.1", "transformers 4.57.1"]),
])
def test_older_releases_are_refused_naming_what_is_installed_and_needed(installed, named):
    with pytest.raises(versions.UnsupportedVersion) as caught:
        versions.check_supported(installed)
    assert all(text in str(caught.value) for text in named) and "constraints/cpu.txt" in str(caught.value)


def test_the_cache_keyword_is_the_one_the_installed_release_reads():
    """Whichever name this release uses, a forward given the cache under it fills the cache (before the fix, a
    ``cache=`` keyword was swallowed by ``**kwargs`` on transformers < 5.24 and the cache stayed empty)."""
    from transformers import DynamicCache

    model = build_preset_model("tiny-llama", 0).eval()
    keyword = versions.cache_keyword(model)
    assert keyword in inspect.signature(type(model).forward).parameters
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=True, **{keyword: cache})
    assert cache.get_seq_length() == 4


def test_the_trainers_weight_source_refuses_an_unsupported_release(monkeypatch):
    from trainer_agent.weight_source import TorchWeightSource

    monkeypatch.setattr(versions, "installed", lambda: {"torch": "2.12.0", "transformers": "5.24.0"})
    with pytest.raises(versions.UnsupportedVersion, match=r"torch 2\.12\.0"):
        TorchWeightSource("tiny-llama").load()
