"""Errors shared by the context and the communicators."""

REPLICA_CONTEXT_MESSAGE = (
    "tf_sok under tf.distribute: tables are sharded across replicas, so lookups and sparse updates run per "
    "replica. Call them inside strategy.run(...) (model.fit, evaluate and predict do)")


def replica_context_required():
    raise RuntimeError(REPLICA_CONTEXT_MESSAGE)
