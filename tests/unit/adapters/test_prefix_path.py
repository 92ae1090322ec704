"""The prefix path (:mod:`abstain_guard.adapters.engine.prefix`): prompt passes split after the
shared prefix, the prefix computed once per model.

What must hold: where a prompt splits depends on the prompt alone; a prefix from the store
gives bitwise the answer a freshly computed one gives (same kernels, same shapes: the store
only skips work); the split pass is exact (within float32 rounding of the one-pass path, on
every family and capture strategy); the path is recorded and a guard calibrated on the other
path refuses it; replay splits the same way."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from tiny_models import FAMILIES, assert_same_answer, tiny_chat_model

from abstain_guard.adapters.capture import session as capture
from abstain_guard.adapters.engine.encoding import prompt_head
from abstain_guard.adapters.engine.prefix import (
    PREFIX_RULE,
    PrefixStore,
    common_prefix,
    prefix_store,
    split_point,
)
from abstain_guard.contract.deployment import decode_path_problem
from abstain_guard.guard.chains import calibrated_on_prefix

SYSTEM = "You answer questions about geography briefly."
MESSAGES = [SystemMessage(SYSTEM), HumanMessage("Capital of Peru?")]
GEOMETRY = ("omega", "theta", "phi_in", "phi_out")
#: float32 rounding of the split pass against the one-pass path (measured: at most 2.7e-6
#: on the tiny families' first token)
SPLIT_TOLERANCE = 2e-5


def _first_token_gap(a: Any, b: Any) -> float:
    ga, gb = a.response_metadata["geometry"], b.response_metadata["geometry"]
    gaps = [
        float(np.abs(np.asarray(ga[k])[0] - np.asarray(gb[k])[0]).max())
        for k in GEOMETRY
        if ga.get(k) is not None
    ]
    la = a.response_metadata["logprobs"]["content"][0]["logprob"]
    lb = b.response_metadata["logprobs"]["content"][0]["logprob"]
    return max([*gaps, abs(la - lb)])


def _pair(family: str, **options: Any) -> tuple[Any, Any]:
    """The same weights on the prefix path and on the one-pass path."""
    on = tiny_chat_model(family, max_new_tokens=6, **options)
    off = tiny_chat_model(family, max_new_tokens=6, prefix_cache=False, **options)
    off._shared = on._shared
    return on, off


def test_split_point_never_at_either_end() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert split_point([1, 2, 3, 4], [1, 2, 9]) == 2
    assert split_point([1, 2, 3], [1, 2, 3, 4]) == 0  # the whole prompt: nothing after it
    assert split_point([5, 2, 3], [1, 2]) == 0


def test_the_head_is_what_every_question_shares() -> None:
    model = tiny_chat_model("llama")
    prompts = [
        model.encode_chat([SystemMessage(SYSTEM), HumanMessage(q)])[0]
        for q in ("Capital of Peru?", "Who wrote the Iliad?")
    ]
    dicts = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    head = prompt_head(model.tokenizer, dicts, None)
    shared = common_prefix(*prompts)
    assert 0 < len(head) <= shared
    assert all(p[: len(head)] == list(head) for p in prompts)
    text = model.tokenizer.decode(list(head))
    assert SYSTEM in text and text.endswith("user\n")
    # another system prompt, another head; history after the first user turn changes nothing
    other = prompt_head(model.tokenizer, [{"role": "system", "content": "Be terse."}], None)
    assert other != head


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stored_prefix_gives_bitwise_the_fresh_answer(family: str) -> None:
    on, off = _pair(family)
    fresh = on.invoke(MESSAGES)
    store = prefix_store(on._shared)
    assert (store.misses, store.hits) == (1, 0)
    stored = on.invoke(MESSAGES)
    assert store.hits == 1
    assert_same_answer(fresh, stored)
    path = fresh.response_metadata["generation"]["decode_path"]
    assert path["prefix"] == PREFIX_RULE and path == on.decode_path()
    one_pass = off.invoke(MESSAGES)
    assert "prefix" not in one_pass.response_metadata["generation"]["decode_path"]
    assert _first_token_gap(fresh, one_pass) <= SPLIT_TOLERANCE


@pytest.mark.parametrize("strategy", ["cached", "sparse", "dense"])
@pytest.mark.parametrize("budget", [None, 0])
def test_every_capture_strategy_is_exact_after_a_prefix(
    monkeypatch: pytest.MonkeyPatch, strategy: str, budget: int | None
) -> None:
    """The request's session continues from the prefix's kept parts or, when they did not fit
    the budget (0; the prefix is computed under its request's budget), from their max-norms;
    both exact."""
    monkeypatch.setattr(capture, "DEFAULT_STRATEGY", strategy)
    if budget is not None:
        monkeypatch.setattr(capture, "CACHE_BUDGET_BYTES", budget)
    on, off = _pair("qwen2")
    a, b = on.invoke(MESSAGES), off.invoke(MESSAGES)
    (state,) = prefix_store(on._shared)._items.values()
    assert (state.u is None) == (budget == 0)
    assert state.cmlp is not None and state.unorm is not None
    assert a.response_metadata["token_ids"] == b.response_metadata["token_ids"]
    ga, gb = a.response_metadata["geometry"], b.response_metadata["geometry"]
    for k in ("omega", "theta"):  # Φ needs reference means
        np.testing.assert_allclose(ga[k], gb[k], atol=SPLIT_TOLERANCE, err_msg=k)


@pytest.mark.parametrize("mode", ["fast", "none"])
def test_plain_prefixes_serve_fast_capture_and_no_capture(mode: str) -> None:
    options = {"capture": "fast"} if mode == "fast" else {"capture_geometry": False}
    on, off = _pair("llama", **options)
    a, b = on.invoke(MESSAGES), off.invoke(MESSAGES)
    (state,) = prefix_store(on._shared)._items.values()
    assert not state.full and state.u is None and state.cmlp is None
    assert a.response_metadata["token_ids"] == b.response_metadata["token_ids"]
    if mode == "fast":
        assert _first_token_gap(a, b) <= SPLIT_TOLERANCE


def test_concurrent_callers_get_their_solo_answers() -> None:
    model = tiny_chat_model("llama", max_new_tokens=6)
    questions = ["Hi", "Capital of Peru?", "Longer, about rivers?", "x"]
    convs = [[SystemMessage(SYSTEM), HumanMessage(q)] for q in questions]
    together = model.batch(convs)
    for conv, got in zip(convs, together, strict=True):
        assert_same_answer(got, model.invoke(conv))
    store = prefix_store(model._shared)
    # engines side by side may both miss the first time; they keep one prefix
    assert len(store._items) == 1 and store.hits >= len(questions) - store.misses


def test_replay_splits_as_generation_does() -> None:
    on, _ = _pair("llama")
    live = on.invoke(MESSAGES)
    replayed = on.replay(MESSAGES, live.response_metadata["token_ids"])
    gl, gr = live.response_metadata["geometry"], replayed.metadata["geometry"]
    for k in ("omega", "theta"):
        np.testing.assert_allclose(gl[k], gr[k], atol=SPLIT_TOLERANCE, err_msg=k)
    # two prefixed pairs and a one-pass pair in one call: each pair its own forward
    pairs = [(MESSAGES, "Lima"), ([HumanMessage("Hi")], "Hello"), (MESSAGES, "Lima")]
    a, b, c = on.replay_batch(pairs)
    assert a.metadata["geometry"] == c.metadata["geometry"]
    assert b.metadata["geometry"] is not None


def test_a_guard_on_the_other_path_refuses() -> None:
    on, off = _pair("llama")
    message = decode_path_problem(off.decode_path(), on.decode_path())
    assert "split after the shared prefix" in message and "prefix_cache" in message


def test_a_guard_loads_its_model_on_the_calibrated_path() -> None:
    on = {"decode_path": {"steps": "shared", "threads": 1, "min_rows": 4, "prefix": PREFIX_RULE}}
    assert calibrated_on_prefix(on)
    # artifacts from before the prefix path recorded none: their model runs one pass
    assert not calibrated_on_prefix({"decode_path": {"steps": "shared", "threads": 1}})
    assert not calibrated_on_prefix({})


def test_the_store_keeps_the_most_recent_prefixes() -> None:
    model = tiny_chat_model("llama", max_new_tokens=2)
    store = prefix_store(model._shared)
    store.size = 2
    for system in ("One.", "Two.", "Three."):
        model.invoke([SystemMessage(system), HumanMessage("Hi")])
    assert len(store._items) == 2
    assert isinstance(store, PrefixStore)
    store.clear()
    assert not store._items
