"""Fixtures shared by integration tests of more than one module."""
import pytest

from tests.helpers.bad_inputs import prepare


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The bad-input catalogue's files (tests/helpers/bad_inputs.py), made once per module that asks."""
    yield from prepare(str(tmp_path_factory.mktemp("catalogue")))
