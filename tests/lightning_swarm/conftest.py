import pytest


@pytest.fixture
def peers():
    """Processes a test starts (anything with ``kill()``); all of them are killed when the test ends."""
    started = []
    yield started
    for peer in started:
        peer.kill()
