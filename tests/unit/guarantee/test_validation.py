"""The shared score / label validator (abstain_guard.guarantee.validation)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee.validation import check_labels, check_scores, require_both_classes


def test_scores_inf_only_where_allowed() -> None:
    scores = [0.1, math.inf, -math.inf]
    np.testing.assert_array_equal(check_scores(scores, allow_inf=True), scores)
    with pytest.raises(InvalidInputError, match="NaN or infinite"):
        check_scores(scores)
    for allow_inf in (True, False):
        with pytest.raises(InvalidInputError, match=r"uncertainty contains 1 NaN.*\[1\]"):
            check_scores([0.1, math.nan], name="uncertainty", allow_inf=allow_inf)


def test_scores_shape_and_emptiness() -> None:
    assert check_scores([1, 2]).dtype == np.float64
    with pytest.raises(InvalidInputError, match="1-D"):
        check_scores([[0.1, 0.2]])
    with pytest.raises(InvalidInputError, match="numbers"):
        check_scores(["a"])
    with pytest.raises(InsufficientDataError, match="empty"):
        check_scores([])


def test_labels_are_int_zero_one() -> None:
    for labels in ([True, False], [1, 0], [1.0, 0.0]):
        out = check_labels(labels, 2)
        assert out.dtype == np.int64 and out.tolist() == [1, 0]
    with pytest.raises(InvalidInputError, match="0/1"):
        check_labels([1, 2])
    with pytest.raises(InvalidInputError, match="0/1"):
        check_labels([1, math.nan])
    with pytest.raises(InvalidInputError, match="1-D"):
        check_labels([[1, 0]])
    with pytest.raises(InsufficientDataError, match="empty"):
        check_labels([])


def test_label_length_is_checked_before_emptiness_and_values() -> None:
    for labels in ([1], [], [1, 2, 3]):
        with pytest.raises(InvalidInputError, match=r"length mismatch.*same length"):
            check_labels(labels, 2)


def test_both_classes() -> None:
    require_both_classes(np.array([1, 0]), what="AUROC", hint="x")
    with pytest.raises(InsufficientDataError, match=r"AUROC needs both .* all 2 are correct; x"):
        require_both_classes(np.array([True, True]), what="AUROC", hint="x")
