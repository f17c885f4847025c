import pytest

from cloud_tier.engine import kernels


@pytest.fixture(scope="session")
def native():
    """The compiled CPU kernels (built once per machine), or the test is skipped."""
    ext = kernels.load()
    if ext is None:
        pytest.skip("the native kernels could not be built here (no compiler)")
    return ext
