"""GeometryScorer: formulas on hand-computed cases, synthetic separation per feature family,
state round trip, typed errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _geometry_fakes import D, K, L, _npz_round_trip, _response, _split
from sklearn.covariance import OAS, LedoitWolf

from abstain_guard.adapters import ReferenceMeans, ReplayResult, TokenStates
from abstain_guard.calibration.measure import metrics
from abstain_guard.calibration.measure.permutation_importance import permutation_importance
from abstain_guard.errors import (
    InsufficientDataError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scorers import (
    ScorerState,
    family_slices,
    fit_gaussian,
    response_uncertainty,
    scorer_from_state,
    token_block,
)
from abstain_guard.scorers.geometry import GeometryScorer

# --- formulas --------------------------------------------------------------------------


def test_response_uncertainty_hand_computed() -> None:
    # exp(-(log .5 + log .25) / 2) = exp(1.5 log 2) = 2 ** 1.5
    assert response_uncertainty(np.array([0.5, 0.25])) == pytest.approx(2**1.5)
    # a single token (an EOS-only answer) is its own perplexity
    assert response_uncertainty(np.array([0.8])) == pytest.approx(1 / 0.8)
    # zero confidence is clipped, never inf/NaN
    assert response_uncertainty(np.array([0.0, 1.0])) == pytest.approx(math.sqrt(1e6))


@pytest.mark.parametrize("bad", [np.array([]), np.array([0.5, np.nan])])
def test_response_uncertainty_rejects_empty_and_nan(bad: np.ndarray) -> None:
    with pytest.raises(ScoringError):
        response_uncertainty(bad)


@pytest.mark.parametrize("kind,est", [("ledoit_wolf", LedoitWolf), ("oas", OAS)])
def test_mahalanobis_matches_inverse_covariance(kind: str, est: type) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)) @ rng.normal(size=(6, 6))
    g = fit_gaussian(x, kind)  # type: ignore[arg-type]
    ref = est().fit(x)
    prec = np.linalg.inv(ref.covariance_)
    q = rng.normal(size=(5, 6))
    diff = q - ref.location_
    expected = np.sqrt(np.einsum("ij,jk,ik->i", diff, prec, diff))
    np.testing.assert_allclose(g.distance(q), expected, rtol=1e-8)


def test_fit_gaussian_errors() -> None:
    with pytest.raises(InsufficientDataError):
        fit_gaussian(np.zeros((1, 3)))
    with pytest.raises(InvalidInputError, match="identical"):
        fit_gaussian(np.ones((10, 3)))
    x = np.random.default_rng(0).normal(size=(10, 3))
    x[2, 1] = np.nan
    with pytest.raises(InvalidInputError, match="NaN"):
        fit_gaussian(x)


def test_constant_columns_are_fine() -> None:
    x = np.random.default_rng(0).normal(size=(30, 4))
    x[:, 2] = 0.7  # a layer whose ω never changes
    g = fit_gaussian(x)
    assert np.all(np.isfinite(g.distance(x)))


def test_family_slices() -> None:
    s = family_slices(3)
    assert [(v.start, v.stop) for v in s.values()] == [(0, 5), (5, 10), (10, 15), (15, 20)]


# --- synthetic data --------------------------------------------------------------------


def _auroc(scorer: GeometryScorer, data: list[tuple[ReplayResult, bool]]) -> float:
    scores = scorer.score_many([r for r, _ in data])
    return metrics.auroc(scores, [c for _, c in data])


@pytest.fixture(scope="module")
def fitted_omega() -> tuple[GeometryScorer, list[tuple[ReplayResult, bool]]]:
    scorer = GeometryScorer(num_boost_round=200).fit(_split(1, 80, "omega"), _split(2, 80, "omega"))
    return scorer, _split(3, 80, "omega")


@pytest.mark.parametrize("family", ["omega", "theta", "phi"])
def test_separates_when_one_family_differs(family: str) -> None:
    scorer = GeometryScorer(num_boost_round=200).fit(_split(1, 80, family), _split(2, 80, family))
    assert _auroc(scorer, _split(3, 80, family)) > 0.85


def test_raw_variant_separates() -> None:
    scorer = GeometryScorer(variant="raw", num_boost_round=200)
    scorer.fit(_split(1, 60, "theta"), _split(2, 80, "theta"))
    assert scorer.name == "geometry_raw"
    assert _auroc(scorer, _split(3, 80, "theta")) > 0.85


def test_does_not_separate_without_signal() -> None:
    aucs = []
    for seed in range(3):
        scorer = GeometryScorer(num_boost_round=200, random_state=seed)
        scorer.fit(_split(10 + seed, 80, None), _split(20 + seed, 80, None))
        aucs.append(_auroc(scorer, _split(30 + seed, 120, None)))
    assert abs(float(np.mean(aucs)) - 0.5) < 0.1


def test_scores_are_finite_and_at_least_one(fitted_omega) -> None:
    scorer, data = fitted_omega
    scores = scorer.score_many([r for r, _ in data])
    assert np.all(np.isfinite(scores)) and np.all(scores >= 1.0)
    assert scorer.score(data[0][0]) == pytest.approx(scores[0])
    assert scorer.fit_info_["early_stopping"] is True


def test_single_token_response_scores(fitted_omega) -> None:
    scorer, _ = fitted_omega
    eos_only = _response(np.random.default_rng(5), True, "omega", n=1)
    assert np.isfinite(scorer.score(eos_only))


def test_message_with_phi_scores_like_states(fitted_omega) -> None:
    scorer, data = fitted_omega
    replay = data[0][0]
    phi_in, phi_out = scorer.reference_means_.phi(replay.states)
    meta = json.loads(json.dumps(replay.metadata))
    meta["geometry"]["phi_in"] = phi_in.tolist()
    meta["geometry"]["phi_out"] = phi_out.tolist()
    assert scorer.score(meta) == pytest.approx(scorer.score(replay), rel=1e-9)


def test_message_without_phi_is_a_typed_error(fitted_omega) -> None:
    scorer, data = fitted_omega
    with pytest.raises(ScoringError, match="prepare"):
        scorer.score(data[0][0].metadata)


def test_nan_features_are_a_typed_error(fitted_omega) -> None:
    scorer, _ = fitted_omega
    r = _response(np.random.default_rng(6), True, "omega", n=3)
    r.metadata["geometry"]["omega"][1][2] = float("nan")
    with pytest.raises(ScoringError, match="NaN"):
        scorer.score(r)


def test_zero_token_response_is_a_typed_error(fitted_omega) -> None:
    scorer, _ = fitted_omega
    r = _response(np.random.default_rng(6), True, "omega", n=1)
    r.metadata["geometry"]["omega"] = []
    r.metadata["geometry"]["theta"] = []
    r.metadata["logprobs"]["content"] = []
    r.states = TokenStates(np.zeros((0, L, D)), np.zeros((0, L, D)))
    with pytest.raises(ScoringError, match="no generated tokens"):
        scorer.score(r)


def test_token_block_layout() -> None:
    r = _response(np.random.default_rng(0), True, "omega", n=4)
    means = ReferenceMeans.from_states([r.states], [r.states])
    b = token_block(r, means)
    assert b.geometry.shape == (4, 8 * L - 4)
    np.testing.assert_allclose(b.geometry[:, :K], r.metadata["geometry"]["omega"])
    np.testing.assert_allclose(b.geometry[:, K : 2 * K], r.metadata["geometry"]["theta"])
    assert b.logprob.shape == (4,)


def test_feature_importance_finds_the_informative_family(fitted_omega) -> None:
    scorer, data = fitted_omega
    imp = permutation_importance(scorer, [r for r, _ in data], [c for _, c in data], n_repeats=3)
    assert imp.auroc > 0.85
    assert imp.drops["omega"]["auroc_mean"] > 0.2
    for fam in ("theta", "phi_in", "phi_out"):
        assert abs(imp.drops[fam]["auroc_mean"]) < 0.1
    json.dumps(imp.to_dict())


@pytest.mark.parametrize("variant", ["paper", "raw"])
def test_state_round_trip(variant: str) -> None:
    scorer = GeometryScorer(variant=variant, num_boost_round=50)  # type: ignore[arg-type]
    scorer.fit(_split(1, 40, "omega"), _split(2, 40, "omega"))
    state = scorer.get_state()
    assert state.kind == "geometry"
    loaded_state = ScorerState(
        kind=state.kind,
        params=json.loads(json.dumps(state.params)),
        arrays=_npz_round_trip(state.arrays),
        files={k: bytes(v) for k, v in state.files.items()},
    )
    loaded = scorer_from_state(loaded_state)
    assert isinstance(loaded, GeometryScorer)
    data = [r for r, _ in _split(3, 10, "omega")]
    np.testing.assert_allclose(loaded.score_many(data), scorer.score_many(data), rtol=1e-12)


def test_too_few_reference_responses() -> None:
    ref = [(r, True) for r, _ in _split(1, 10, "omega")] + [(_split(2, 1, None)[0][0], False)]
    with pytest.raises(InsufficientDataError, match="1 incorrect"):
        GeometryScorer().fit(ref, _split(3, 20, "omega"))


def test_reference_needs_states() -> None:
    ref = _split(1, 20, "omega")
    ref[0][0].states = None
    with pytest.raises(ScoringError, match="hidden states"):
        GeometryScorer().fit(ref, _split(3, 20, "omega"))


def test_identical_reference_features() -> None:
    rng = np.random.default_rng(0)
    ref = []
    for i in range(6):
        r = _response(rng, i % 2 == 0, None, n=3)
        r.metadata["geometry"]["omega"] = [[0.5] * K] * 3
        r.metadata["geometry"]["theta"] = [[0.5] * K] * 3
        r.states = TokenStates(np.ones((3, L, D)), np.ones((3, L, D)))
        ref.append((r, i % 2 == 0))
    with pytest.raises(InvalidInputError, match="identical"):
        GeometryScorer().fit(ref, _split(3, 20, "omega"))


def test_single_class_training_split() -> None:
    train = [(r, True) for r, _ in _split(2, 20, "omega")]
    with pytest.raises(InsufficientDataError, match="one class"):
        GeometryScorer().fit(_split(1, 20, "omega"), train)


def test_unfitted_and_bad_parameters() -> None:
    with pytest.raises(NotFittedError):
        GeometryScorer().score({})
    with pytest.raises(InvalidInputError):
        GeometryScorer(variant="nope")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        GeometryScorer(covariance="empirical")  # type: ignore[arg-type]


def test_small_training_split_trains_without_early_stopping() -> None:
    scorer = GeometryScorer(num_boost_round=20).fit(_split(1, 20, "omega"), _split(2, 6, "omega"))
    assert scorer.fit_info_["early_stopping"] is False


@pytest.mark.model
def test_prepare_installs_reference_and_scores_real_messages(default_model) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage

    questions = [
        "What is the capital of France?",
        "What is the capital of Japan?",
        "What is the capital of Tuvalu?",
        "What is the capital of Burkina Faso?",
    ]
    items = [
        ([SystemMessage("Answer in a few words."), HumanMessage(q)], a)
        for q, a in zip(
            questions * 2,
            ["Paris", "Tokyo", "Funafuti", "Ouagadougou"] + ["Lyon", "Osaka"] * 2,
            strict=True,
        )
    ]
    labels = [True] * 4 + [False] * 4
    replays = default_model.replay_batch(items, return_states=True)
    pairs = list(zip(replays, labels, strict=True))
    scorer = GeometryScorer(num_boost_round=10, min_reference_responses=2).fit(pairs, pairs)
    prepared = scorer.prepare(default_model)
    msg = prepared.invoke(items[0][0], max_new_tokens=6)
    assert msg.response_metadata["geometry"]["phi_in"] is not None
    u = scorer.score(msg)
    assert np.isfinite(u) and u >= 1.0
