import os
import secrets

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest



@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("TF_SOK_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.name}: seed {seed} (TF_SOK_TEST_SEED={seed} to replay)")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _sok_context():
    import tf_sok as sok

    sok.init()
    yield
