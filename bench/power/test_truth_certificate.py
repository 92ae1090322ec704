"""truth_certificate.py: its cells run on a few draws, and the committed JSON says what
docs/guarantees.md (section 5) reads from it.

    .venv/bin/pytest -p no:cacheprovider -q bench
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import truth_certificate as bench

RESULT = json.loads((Path(__file__).with_name("truth_certificate.json")).read_text())


def test_a_validity_and_a_power_cell_run() -> None:
    cell = bench.validity_cell("scoped", 1000, 100, 40, 20, 0)
    assert cell["scope"] == 0.8 and 0.0 <= cell["fwer_total"]["rate"] <= 1.0
    power = bench.power_cell("perfect", 1000, 200, 20, 0.4, 0)
    assert power["p_combined_below_human_share"] == 0.0


def test_the_committed_result_holds_what_the_docs_say() -> None:
    for cell in RESULT["validity"]:
        for arm in ("human", "judge", "total"):
            assert cell[f"fwer_{arm}"]["ci95"][0] <= cell[f"fwer_{arm}"]["level"]
        assert cell["fwer_total"]["ci95"][1] <= RESULT["delta"]
    for cell in RESULT["power"]:
        assert cell["p_combined_below_human_share"] == 0.0
        if cell["n"] / cell["m"] < 10:
            assert cell["ratio_vs_delta"] >= 0.97
        if cell["n"] / cell["m"] >= 25 and cell["judge"] != "lenient_on_confident_wrong":
            assert cell["difference_vs_delta"]["ci95"][0] > 0.0  # above human-only at δ
    assert all(row["ratio_to_judge_only"] >= 0.8 for row in RESULT["low_accuracy"])
    negative = RESULT["cross_checks"]["negative_control"]["coverage"]
    assert negative["ppi"]["ci95"][1] < 0.95 <= negative["exact"]["ci95"][1]
    for cell in RESULT["cross_checks"]["confseq"]["cells"]:  # valid, and no tighter on average
        assert cell["coverage"]["confseq"]["ci95"][1] >= 1 - cell["level"]
        assert cell["mean_upper"]["confseq"] >= cell["mean_upper"]["exact"]
