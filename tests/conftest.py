"""Shared fixtures. Tests that load the real default model are marked ``model`` and share
one loaded model per session through :func:`default_model`."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct as a GeometryChatModel, loaded once per session,
    generating at most 24 tokens as the shipped default guard was calibrated."""
    from abstain_guard.adapters import load_default_model

    return load_default_model(max_new_tokens=24)


@pytest.fixture(scope="session")
def default_model_with(default_model):
    """``default_model_with(max_new_tokens=16)``: the session model with other settings on
    the same loaded weights -- what ``load_default_model(**settings)`` (or a calibration
    config naming the default model) loads, without loading it again."""

    def make(**settings):
        model = default_model.model_copy(update=settings)
        model._shared = default_model._shared  # the same loaded weights
        return model

    return make
