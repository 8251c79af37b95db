"""tfamp inspect on small saved models, compared with reviewed golden outputs."""

import pytest

from tests.golden.cases import CASES, GOLDEN, build_fixtures, normalize, run_case


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fixtures")
    build_fixtures(folder)
    return folder


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_matches_golden(fixtures, case):
    result = run_case(case, fixtures)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = (GOLDEN / case).read_text()
    assert normalize(result.stdout, fixtures) == expected, (
        f"{case} differs from tests/golden/{case}; if the change is intended, run "
        f"`python tests/golden/cases.py` and review the diff")
