"""Fixtures shared by integration tests of more than one module."""

import pytest

from tests.helpers.bad_inputs import prepare


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """The bad-input catalogue's files (tests/helpers/bad_inputs.py): two trainings, made once for both catalogue
    modules. Every case asserts it changed none of them; test_bad_inputs_writers_and_checksums only adds folders beside them."""
    yield from prepare(str(tmp_path_factory.mktemp("catalogue")))
