"""Fixtures of the GPU tests."""
import pytest


@pytest.fixture(params=["keys_on_host", "keys_on_gpu"])
def tier_keys(request, monkeypatch):
    """A test twice (`pytest.mark.usefixtures("tier_keys")`): hybrid tables made in it map their host
    tier's keys on the GPU as well (the default for tiers without max_capacity), then look them up on
    the host alone (TF_SOK_STORE_KEYS_ON_GPU=0; read when a table is made)."""
    monkeypatch.setenv("TF_SOK_STORE_KEYS_ON_GPU", "1" if request.param == "keys_on_gpu" else "0")
    return request.param
