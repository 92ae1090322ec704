"""Decode steps are captured at the end of the step for all layers at once
(:mod:`abstain_guard.adapters.capture.decode_step`); the per-layer hooks still capture prompt
blocks, replays and rows whose session keeps no ``u``. Both must give bitwise the same numbers: the
per-layer path is the one the exactness tests compare with full-matrix references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tiny_models import FAMILIES, tiny_chat_model

from abstain_guard.adapters.capture import session as capture
from abstain_guard.adapters.capture.decode_step import DecodeStepCapture
from abstain_guard.adapters.capture.types import ReferenceMeans
from abstain_guard.adapters.engine.batching import BatchEngine, GenerationRequest
from abstain_guard.adapters.engine.encoding import prompt_ids

QUESTIONS = ("Capital of Peru?", "Who wrote the Iliad, and when?", "2+2?")
FEATURES = ("omega", "theta", "phi_in", "phi_out", "post_attn", "post_mlp")


def _reference(model: Any) -> ReferenceMeans:
    cfg = model.hf_model.config
    n_layers = cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else cfg.n_layer
    hidden = cfg.hidden_size if hasattr(cfg, "hidden_size") else cfg.n_embd
    rng = np.random.default_rng(0)
    return ReferenceMeans(*(rng.normal(size=(n_layers, hidden)) for _ in range(4)))


def _generate(model: Any, mode: str, max_rows: int) -> tuple[list[Any], int]:
    """Every question's result from one engine (shared steps), and how many decode steps
    the end-of-step capture finished."""
    loaded = model._shared
    finished = 0
    original = DecodeStepCapture.finish

    def counting(self: DecodeStepCapture) -> None:
        nonlocal finished
        finished += 1
        original(self)

    DecodeStepCapture.finish = counting  # type: ignore[method-assign]
    try:
        engine = BatchEngine(loaded, max_rows=max_rows)
        rows = [
            engine.start(
                GenerationRequest(
                    prompt=prompt_ids(loaded.tokenizer, [{"role": "user", "content": q}]),
                    max_new=9,
                    capture_mode=mode,
                    reference=_reference(model),
                    keep_states=True,
                )
            )
            for q in QUESTIONS
        ]
        while engine.active:
            engine.step()
    finally:
        DecodeStepCapture.finish = original  # type: ignore[method-assign]
    return [r.result() for r in rows], finished


def _assert_same(a: list[Any], b: list[Any]) -> int:
    """Bitwise equal features of every step of every row; returns the number of steps."""
    n = 0
    for ra, rb in zip(a, b, strict=True):
        assert ra.token_ids == rb.token_ids
        assert len(ra.steps) == len(rb.steps)
        for sa, sb in zip(ra.steps, rb.steps, strict=True):
            for name in FEATURES:
                x, y = getattr(sa, name), getattr(sb, name)
                assert (x is None) == (y is None), name
                if x is not None:
                    assert x.shape == y.shape, name
                    assert np.array_equal(x, y), (name, float(np.abs(x - y).max()))
            n += 1
    return n


@pytest.mark.parametrize("mode", ["full", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_step_capture_equals_the_per_layer_hooks_bitwise(
    family: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_chat_model(family, seed=5)
    deferred, finished = _generate(model, mode, max_rows=3)
    assert finished > 0  # decode steps did take the end-of-step path
    monkeypatch.setattr(capture.CaptureSession, "defers_decode", lambda self: False)
    hooked, none = _generate(model, mode, max_rows=3)
    assert none == 0
    steps = _assert_same(deferred, hooked)
    assert steps > len(QUESTIONS)  # more than the prompt blocks were compared


def test_a_rows_numbers_do_not_depend_on_the_other_rows_of_its_steps() -> None:
    model = tiny_chat_model("gemma3_text", seed=5)
    together, _ = _generate(model, "full", max_rows=3)
    alone, _ = _generate(model, "full", max_rows=1)
    _assert_same(together, alone)


def test_rows_without_kept_parts_keep_the_per_layer_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation over the capture memory budget uses the bound-based strategies, which
    stay in the per-layer hooks; in a step shared with deferred rows every row still gets
    bitwise its own numbers."""
    model = tiny_chat_model("llama", seed=5)
    loaded = model._shared
    spec = loaded.spec
    lengths = [
        len(prompt_ids(loaded.tokenizer, [{"role": "user", "content": q}])) for q in QUESTIONS
    ]
    per_position = 4 * spec.num_layers * spec.layers[0].num_heads * spec.hidden_size
    # the shortest prompt's row keeps u, the others do not
    monkeypatch.setattr(capture, "CACHE_BUDGET_BYTES", per_position * (min(lengths) + 9))
    kinds = []
    original = capture.CaptureSession.defers_decode

    def spy(self: capture.CaptureSession) -> bool:
        kinds.append(original(self))
        return kinds[-1]

    monkeypatch.setattr(capture.CaptureSession, "defers_decode", spy)
    mixed, finished = _generate(model, "full", max_rows=3)
    assert finished > 0 and True in kinds and False in kinds
    monkeypatch.setattr(capture.CaptureSession, "defers_decode", lambda self: False)
    hooked, _ = _generate(model, "full", max_rows=3)
    _assert_same(mixed, hooked)
