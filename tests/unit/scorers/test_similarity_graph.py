"""The black-box formulas on hand-computed cases (semantic sets, EigV, degree,
eccentricity, the medoid)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from abstain_guard.errors import InvalidInputError
from abstain_guard.scorers._similarity_graph import (
    affinity,
    cosine_similarities,
    degree_uncertainties,
    degree_uncertainty,
    discrete_semantic_entropy,
    eccentricities,
    eccentricity_uncertainty,
    eigenvalue_uncertainty,
    equivalent_by_threshold,
    medoid_index,
    normalized_laplacian,
    number_of_semantic_sets,
    semantic_ids,
)

#: Two identical answers and a third unlike both: degrees 2, 2, 1.
TWO_AND_ONE = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])


def pair(a: float) -> np.ndarray:
    return np.array([[1.0, a], [a, 1.0]])


def test_cosine_similarities_of_hand_vectors() -> None:
    emb = np.array([[1.0, 0.0], [3.0, 4.0], [0.0, -2.0]])
    sim = cosine_similarities(emb)
    assert sim == pytest.approx(np.array([[1, 0.6, 0], [0.6, 1, -0.8], [0, -0.8, 1]]))


def test_semantic_ids_compare_with_a_class_first_member_only() -> None:
    # 0 ~ 1 and 1 ~ 2 but not 0 ~ 2: 2 opens a class of its own (Farquhar et al.)
    eq = np.array([[1, 1, 0], [1, 1, 1], [0, 1, 1]], dtype=bool)
    assert semantic_ids(eq).tolist() == [0, 0, 1]
    eq4 = np.eye(4, dtype=bool)
    eq4[0, 2] = eq4[2, 0] = True
    assert semantic_ids(eq4).tolist() == [0, 1, 0, 2]


def test_threshold_equivalence_is_bidirectional() -> None:
    sim = np.array([[1.0, 0.9, 0.2], [0.7, 1.0, 0.85], [0.2, 0.85, 1.0]])
    eq = equivalent_by_threshold(sim, 0.8)
    assert eq.tolist() == [[True, False, False], [False, True, True], [False, True, True]]


@pytest.mark.parametrize(
    ("ids", "entropy", "sets"),
    [
        ([0, 0, 0, 0], 0.0, 1),
        ([0, 0, 1, 1], math.log(2), 2),
        ([0, 0, 0, 1], -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), 2),
        ([0, 1, 2, 3, 4], math.log(5), 5),
        ([2, 0, 2, 1, 1, 2], -(0.5 * math.log(0.5) + math.log(1 / 3) / 3 + math.log(1 / 6) / 6), 3),
    ],
)
def test_discrete_semantic_entropy_and_number_of_sets(ids, entropy, sets) -> None:
    arr = np.asarray(ids)
    assert discrete_semantic_entropy(arr) == pytest.approx(entropy)
    assert number_of_semantic_sets(arr) == sets


def test_affinity_symmetrises_clips_and_sets_the_diagonal() -> None:
    sim = np.array([[0.5, 0.8, -0.4], [0.6, 0.9, 0.2], [-0.2, 0.4, 1.0]])
    assert affinity(sim) == pytest.approx(np.array([[1, 0.7, 0], [0.7, 1, 0.3], [0, 0.3, 1]]))


def test_laplacian_of_two_answers() -> None:
    # W = [[1, a], [a, 1]]: D = (1 + a) I, L = I - W / (1 + a)
    lap = normalized_laplacian(pair(0.5))
    assert lap == pytest.approx(np.array([[1 - 1 / 1.5, -0.5 / 1.5], [-0.5 / 1.5, 1 - 1 / 1.5]]))


@pytest.mark.parametrize("a", [0.0, 0.25, 0.5, 1.0])
def test_eigv_of_two_answers_is_two_over_one_plus_a(a: float) -> None:
    # eigenvalues of L: 0 and 2a / (1 + a); EigV = 1 + (1 - 2a / (1 + a)) = 2 / (1 + a)
    assert eigenvalue_uncertainty(pair(a)) == pytest.approx(2 / (1 + a))


def test_eigv_counts_clusters_at_the_extremes() -> None:
    assert eigenvalue_uncertainty(np.ones((5, 5))) == pytest.approx(1.0)
    assert eigenvalue_uncertainty(np.eye(5)) == pytest.approx(5.0)
    assert eigenvalue_uncertainty(TWO_AND_ONE) == pytest.approx(2.0)


def test_degree_by_hand() -> None:
    assert degree_uncertainty(pair(0.5)) == pytest.approx(0.25)  # 1 - 1.5 / 2
    assert degree_uncertainties(TWO_AND_ONE) == pytest.approx([1 / 3, 1 / 3, 2 / 3])
    assert degree_uncertainty(TWO_AND_ONE) == pytest.approx(4 / 9)
    assert degree_uncertainty(np.ones((4, 4))) == pytest.approx(0.0)
    assert degree_uncertainty(np.eye(4)) == pytest.approx(0.75)


def test_eccentricity_by_hand() -> None:
    # eigenvalues 0, 0, 1: the two null vectors embed the answers, rows (1/√2, 0) twice and
    # (0, 1); centre (√2/3, 1/3); distances √(1/6), √(1/6), √(2/3); U = 1
    assert eccentricities(TWO_AND_ONE) == pytest.approx(
        [math.sqrt(1 / 6), math.sqrt(1 / 6), math.sqrt(2 / 3)]
    )
    assert eccentricity_uncertainty(TWO_AND_ONE) == pytest.approx(1.0)
    assert eccentricity_uncertainty(np.ones((4, 4))) == pytest.approx(0.0, abs=1e-12)
    assert eccentricity_uncertainty(np.eye(4)) == pytest.approx(math.sqrt(3))


def test_eccentricity_keeps_the_eigenvectors_below_the_threshold() -> None:
    # two answers: eigenvalues 0 and 2a / (1 + a); a = 0.5 -> 2/3 kept: U = 1;
    # a = 0.9 -> 0.947 dropped: one constant coordinate, U = 0
    assert eccentricity_uncertainty(pair(0.5)) == pytest.approx(1.0)
    assert eccentricity_uncertainty(pair(0.9)) == pytest.approx(0.0, abs=1e-12)
    assert eccentricity_uncertainty(pair(0.9), eigenvalue_threshold=0.95) == pytest.approx(1.0)


def test_medoid_is_the_answer_most_like_the_others() -> None:
    sim = np.array([[1.0, 0.2, 0.3], [0.2, 1.0, 0.9], [0.3, 0.9, 1.0]])
    assert medoid_index(sim) == 2
    assert medoid_index(np.ones((3, 3))) == 0  # a tie: the first


@pytest.mark.parametrize(
    "bad",
    [np.zeros((0, 0)), np.ones((2, 3)), np.array([[1.0, np.nan], [np.nan, 1.0]])],
)
def test_malformed_matrices_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(InvalidInputError):
        eigenvalue_uncertainty(bad)


def test_malformed_inputs_are_refused() -> None:
    with pytest.raises(InvalidInputError):
        cosine_similarities(np.array([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(InvalidInputError):
        discrete_semantic_entropy(np.array([]))
    with pytest.raises(InvalidInputError):
        number_of_semantic_sets(np.array([0.5, 1.0]))
    with pytest.raises(InvalidInputError):
        normalized_laplacian(np.zeros((2, 2)))
