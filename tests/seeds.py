"""Fresh random inputs every run, with the seed printed so that a failure can be replayed
(TF_SOK_TEST_SEED=<seed> gives every test that seed)."""
import os
import secrets


def fresh_seed(what, bits=31):
    seed = int(os.environ.get("TF_SOK_TEST_SEED") or secrets.randbits(bits))
    print(f"{what}: seed {seed} (TF_SOK_TEST_SEED={seed} to replay)")
    return seed
