import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
from tests.seeds import fresh_seed



@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    return np.random.default_rng(fresh_seed(request.node.name, bits=32))


@pytest.fixture(autouse=True)
def _sok_context():
    import tf_sok as sok

    sok.init()
    yield
