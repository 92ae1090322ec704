"""GeometryPlusScorer: response features on a hand-built case, separation from geometry and
from likelihood alone, train-only fitting, state round trip through an artifact, typed
errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _geometry_fakes import _npz_round_trip, _response, _split

from abstain_guard import GuardArtifact
from abstain_guard.adapters import ReplayResult
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.measure import metrics
from abstain_guard.errors import (
    ArtifactSchemaError,
    InsufficientDataError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scorers import (
    Gaussian,
    ScorerState,
    TokenBlock,
    reference_inputs,
    scorer_from_state,
    scorer_spec,
)
from abstain_guard.scorers._linear_probe import row_dot
from abstain_guard.scorers.geometry_plus import (
    RESPONSE_FEATURES,
    GeometryPlusScorer,
    response_features,
)


def _auroc(scorer: GeometryPlusScorer, data: list[tuple[ReplayResult, bool]]) -> float:
    return metrics.auroc(scorer.score_many([r for r, _ in data]), [c for _, c in data])


def test_response_features_hand_computed() -> None:
    # identity-whitened Gaussians at 0 and at (3, 4): distances are plain Euclidean norms
    corr = Gaussian(np.zeros(2), np.eye(2))
    inc = Gaussian(np.array([3.0, 4.0]), np.eye(2))
    block = TokenBlock(
        geometry=np.array([[0.0, 0.0], [3.0, 4.0]]),
        logprob=np.log(np.array([0.5, 0.25])),
        entropy=np.array([1.0, 3.0]),
    )
    f = dict(zip(RESPONSE_FEATURES, response_features(block, corr, inc), strict=True))
    assert f["logprob_mean"] == pytest.approx(np.log(0.5 * 0.25) / 2)
    assert f["logprob_min"] == pytest.approx(np.log(0.25))
    assert f["logprob_first"] == pytest.approx(np.log(0.5))
    assert (f["entropy_mean"], f["entropy_max"], f["entropy_first"]) == (2.0, 3.0, 1.0)
    assert (f["d_corr_mean"], f["d_inc_mean"]) == (2.5, 2.5)
    # margin d_inc - d_corr: token 1 sits on the correct mean (+5), token 2 on the incorrect
    assert (f["margin_min"], f["margin_max"], f["margin_first"]) == (-5.0, 5.0, 5.0)
    assert f["margin_mean"] == 0.0
    assert f["log_tokens"] == pytest.approx(np.log(3.0))


def test_response_features_need_entropy() -> None:
    g = Gaussian(np.zeros(2), np.eye(2))
    block = TokenBlock(np.zeros((2, 2)), np.zeros(2), np.full(2, np.nan))
    with pytest.raises(ScoringError, match="entropies"):
        response_features(block, g, g)


@pytest.mark.parametrize("family", ["omega", "theta", "phi"])
def test_separates_on_geometry(family: str) -> None:
    scorer = GeometryPlusScorer().fit(_split(1, 80, family), _split(2, 120, family))
    assert _auroc(scorer, _split(3, 120, family)) > 0.85
    assert scorer.model_.C > 0.0 and scorer.fit_info_["train_responses"][0] > 0


def test_separates_on_likelihood_alone() -> None:
    """Classes differ only in the log-probabilities: the likelihood columns carry it."""
    rng = np.random.default_rng(0)

    def split(n: int) -> list[tuple[ReplayResult, bool]]:
        out = []
        for c in rng.uniform(size=n) < 0.4:
            r = _response(rng, bool(c), None)
            lp = np.log(rng.uniform(0.7, 1.0) if c else rng.uniform(0.05, 0.5), dtype=float)
            for tok in r.metadata["logprobs"]["content"]:
                tok["logprob"] = float(lp)
            out.append((r, bool(c)))
        return out

    ref, train, test = split(60), split(120), split(120)
    assert _auroc(GeometryPlusScorer().fit(ref, train), test) > 0.9
    no_likelihood = [f for f in RESPONSE_FEATURES if not f.startswith("logprob")]
    blind = GeometryPlusScorer(features=no_likelihood).fit(ref, train)
    assert blind.features == tuple(no_likelihood)
    assert _auroc(blind, test) < 0.75


def test_no_signal_no_separation() -> None:
    aucs = [
        _auroc(
            GeometryPlusScorer(random_state=s).fit(
                _split(10 + s, 60, None), _split(20 + s, 100, None)
            ),
            _split(30 + s, 150, None),
        )
        for s in range(3)
    ]
    assert abs(float(np.mean(aucs)) - 0.5) < 0.1


def test_fit_blocks_equals_fit() -> None:
    ref, train = _split(1, 40, "theta"), _split(2, 60, "theta")
    a = GeometryPlusScorer().fit(ref, train)
    inputs = reference_inputs(ref)
    blocks = a.token_blocks([r for r, _ in train])
    b = GeometryPlusScorer().fit_blocks(inputs, blocks, [c for _, c in train])
    data = [r for r, _ in _split(3, 20, "theta")]
    np.testing.assert_array_equal(a.score_many(data), b.score_many(data))


def test_a_response_scored_alone_gets_bitwise_its_score_in_a_batch() -> None:
    """Calibration scores its answers as one batch, the guard one at a time: the bits must
    match on any processor (live = stored), so the logit is an exactly rounded row sum
    (``row_dot``), neither a BLAS product (its kernel depends on the row count) nor numpy's
    ``sum(axis=1)`` (its order depends on the array's layout and the SIMD width: 5.6e-17
    apart on an AVX-512 machine)."""
    scorer = GeometryPlusScorer().fit(_split(1, 40, "theta"), _split(2, 60, "theta"))
    data = [r for r, _ in _split(3, 37, "theta")]
    batch = scorer.score_many(data)
    alone = np.array([scorer.score(r) for r in data])
    assert np.array_equal(batch, alone), np.abs(batch - alone).max()


def test_state_round_trip_and_artifact(tmp_path: Path) -> None:
    scorer = GeometryPlusScorer(features=RESPONSE_FEATURES[:-1])
    scorer.fit(_split(1, 40, "omega"), _split(2, 60, "omega"))
    state = scorer.get_state()
    assert state.kind == "geometry_plus" and not state.files  # arrays + JSON only
    loaded = scorer_from_state(
        ScorerState(state.kind, json.loads(json.dumps(state.params)), _npz_round_trip(state.arrays))
    )
    data = [r for r, _ in _split(3, 12, "omega")]
    np.testing.assert_allclose(loaded.score_many(data), scorer.score_many(data), rtol=1e-12)
    assert isinstance(loaded, GeometryPlusScorer) and loaded.features == RESPONSE_FEATURES[:-1]
    scores = scorer.score_many(data)
    art = GuardArtifact.from_calibration(
        scorer=scorer, calibration=CalibrationSet(scores, np.arange(12) % 2 == 0)
    )
    art.save(tmp_path / "guard")
    again = GuardArtifact.load(tmp_path / "guard")
    np.testing.assert_allclose(again.scorer.score_many(data), scores, rtol=1e-12)
    assert scorer_spec("geometry_plus").fitted


def test_state_with_unknown_feature_or_wrong_shape_is_refused() -> None:
    scorer = GeometryPlusScorer().fit(_split(1, 40, "omega"), _split(2, 60, "omega"))
    state = scorer.get_state()
    bad = ScorerState(
        state.kind, {**state.params, "features": ["logprob_mean", "vibes"]}, state.arrays
    )
    with pytest.raises(ArtifactSchemaError, match="vibes"):
        GeometryPlusScorer.from_state(bad)
    three = {f"feature_{k}": np.ones(3) for k in ("mean", "scale", "coef")}
    short = ScorerState(state.kind, state.params, {**state.arrays, **three})
    with pytest.raises(ArtifactSchemaError, match="entries"):
        GeometryPlusScorer.from_state(short)
    missing = ScorerState(
        state.kind, state.params, {k: v for k, v in state.arrays.items() if k != "feature_coef"}
    )
    with pytest.raises(ArtifactSchemaError, match="coef"):
        GeometryPlusScorer.from_state(missing)


def test_typed_errors() -> None:
    with pytest.raises(NotFittedError):
        GeometryPlusScorer().score_many([r for r, _ in _split(3, 2, None)])
    with pytest.raises(InvalidInputError, match="features"):
        GeometryPlusScorer(features=["nope"])
    with pytest.raises(InvalidInputError, match="cs"):
        GeometryPlusScorer(cs=[0.0])
    with pytest.raises(InvalidInputError, match="cv_folds"):
        GeometryPlusScorer(cv_folds=1)
    with pytest.raises(InvalidInputError, match="covariance"):
        GeometryPlusScorer(covariance="diag")  # type: ignore[arg-type]
    # 3 correct train answers cannot feed 5 stratified folds
    train = _split(2, 60, "omega")
    few = [(r, c) for r, c in train if not c] + [(r, c) for r, c in train if c][:3]
    with pytest.raises(InsufficientDataError, match="train split"):
        GeometryPlusScorer().fit(_split(1, 40, "omega"), few)


def test_row_sums_are_the_same_bits_in_any_order_layout_or_batch() -> None:
    """``row_dot`` is exactly rounded: a row's value is ``math.fsum`` of its products
    whatever the order of the columns, the memory layout (the scorer's feature matrix is
    column-major after its column selection) or the rows beside it."""
    rng = np.random.default_rng(7)
    z = np.stack([rng.normal(size=13) * 10.0 ** rng.integers(-3, 4, 13) for _ in range(37)])
    z = z[:, list(range(13))]  # the layout ``_features`` gives: column-major
    coef = rng.normal(size=13)
    batch = row_dot(z, coef)
    alone = np.array([row_dot(z[i : i + 1], coef)[0] for i in range(len(z))])
    perm = rng.permutation(13)
    exact = np.array([math.fsum(float(v) for v in row * coef) for row in z])
    assert np.array_equal(batch, alone)
    assert np.array_equal(batch, row_dot(np.ascontiguousarray(z[:, perm]), coef[perm]))
    assert np.array_equal(batch, exact)
    with pytest.raises(InvalidInputError):
        row_dot(z[0], coef)
