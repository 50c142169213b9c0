import pytest


@pytest.fixture
def data_cache(tmp_path_factory):
    """One tokenized-corpus cache shared by a test module's runs, isolated from the user's."""
    return tmp_path_factory.getbasetemp() / "data-cache"
