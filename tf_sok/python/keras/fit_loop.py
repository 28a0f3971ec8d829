"""model.fit's multi-step loop with its control on the host.

With `steps_per_execution=k` Keras 3 runs k steps in one `tf.while_loop`. Its loop condition and
the condition of each step's `tf.cond` are `LogicalAnd`s that TensorFlow places on the GPU: twice
per step the host copies a bool back from the device, and that copy waits for every kernel queued
before it. The host can then never run ahead of the GPU: each step starts with the GPU idle while
the host launches its first ops, and any stall of the host (a busy input pipeline, another process
on its cores) shows up as GPU idle time. Measured on an H200 (DCNv2, batch 65,536): 1.6 ms of a
28 ms step idle in those copies.

`loop_on_host(model)` gives the model a train function that runs the same steps (Keras' own
`train_step`, the same data, the same number of steps per execution, the same end of data) with
the loop's counter and conditions computed on the host, so nothing in the loop waits for the GPU.
With `prefetch=fn` each step also calls fn on the next batch of its execution (fetched before the
step), for `sok.prefetch` to bring that batch's rows into hybrid tables' caches during the step.
"""
import tensorflow as tf

__all__ = ["loop_on_host"]


def _no_optionals(data):
    """Keras' convention: tf.data's empty Optional elements (absent sample weights) become None."""
    return tf.nest.map_structure(lambda x: None if isinstance(x, tf.experimental.Optional) else x, data)


def _host_loop_function(model, steps: int, prefetch=None):
    """`function(iterator) -> logs` running up to `steps` training steps in one graph call (fewer at
    the end of the data; StopIteration when none was left), as Keras' train function does; with
    `prefetch`, see _prefetching_steps."""
    step = tf.function(lambda data: model.train_step(_no_optionals(data)), reduce_retracing=True,
                       jit_compile=model.jit_compile)
    spec = {}

    @tf.autograph.experimental.do_not_convert
    def run_steps(iterator):
        first = iterator.get_next_as_optional()

        def some_data():
            if prefetch is not None:
                logs = _prefetching_steps(model, steps, prefetch, iterator, first)
                out = tf.experimental.Optional.from_value(logs)
                spec["logs"] = out.element_spec
                return out

            def cond(done, logs, upcoming):
                with tf.device("/cpu:0"):
                    return tf.logical_and(done < steps, upcoming.has_value())

            def body(done, logs, upcoming):
                logs = step(upcoming.get_value())
                with tf.device("/cpu:0"):
                    more = done + 1 < steps
                upcoming = tf.cond(more, iterator.get_next_as_optional, lambda: upcoming)
                return done + 1, logs, upcoming

            logs = step(first.get_value())
            _, logs, _ = tf.while_loop(cond, body, [tf.constant(1), logs, iterator.get_next_as_optional()])
            out = tf.experimental.Optional.from_value(logs)
            spec["logs"] = out.element_spec
            return out

        with tf.device("/cpu:0"):
            any_data = first.has_value()
        # the first branch is traced first: the empty one then knows the logs' structure
        return tf.cond(any_data, some_data, lambda: tf.experimental.Optional.empty(spec["logs"]))

    run_steps = tf.function(run_steps, reduce_retracing=True)

    def function(iterator):
        logs = run_steps(iterator)
        if not logs.has_value():
            raise StopIteration
        return logs.get_value()

    return function


def _prefetching_steps(model, steps, prefetch, iterator, first):
    """The steps of one execution, each fetching the next batch before it runs and calling
    prefetch(next batch) in its graph after Keras' train_step (the last step of an execution, whose
    next batch belongs to the next execution, prefetches its own). Returns the last step's logs."""
    def step(data, ahead):
        logs = model.train_step(_no_optionals(data))
        prefetch(_no_optionals(ahead))
        return logs

    step = tf.function(step, reduce_retracing=True)

    def run(current, more):
        nxt = tf.cond(more, iterator.get_next_as_optional,
                      lambda: tf.experimental.Optional.empty(first.element_spec))
        ahead = tf.cond(nxt.has_value(), nxt.get_value, current.get_value)
        return step(current.get_value(), ahead), nxt

    def cond(done, logs, upcoming):
        with tf.device("/cpu:0"):
            return tf.logical_and(done < steps, upcoming.has_value())

    def body(done, logs, upcoming):
        with tf.device("/cpu:0"):
            more = done + 1 < steps
        logs, upcoming = run(upcoming, more)
        return done + 1, logs, upcoming

    logs, upcoming = run(first, tf.constant(steps > 1))
    _, logs, _ = tf.while_loop(cond, body, [tf.constant(1), logs, upcoming])
    return logs


def loop_on_host(model, prefetch=None):
    """Makes `model.fit` run its `steps_per_execution` loop with the loop's control on the host
    (see above); returns the model. Call it once, before or after `compile`. Where the loop has
    nothing to gain or is not plain Keras' (`steps_per_execution=1`, `run_eagerly`, a model built
    under a tf.distribute strategy) fit runs Keras' own train function. Evaluation and prediction
    are unchanged.

    prefetch: fn(batch), called in each step with the next batch of its execution (as the dataset
    gives it: `(x, y)` or `(x, y, sample_weight)`) to call `sok.prefetch` on its ids; the last step
    of each execution prefetches nothing new. Needs `steps_per_execution` > 1.

    Example:
        >>> model.compile(optimizer=sok.keras.Optimizer(...), loss="binary_crossentropy",
        ...               steps_per_execution=10)
        >>> sok.keras.loop_on_host(model).fit(dataset, steps_per_epoch=1000)
        >>> sok.keras.loop_on_host(model, prefetch=lambda batch: sok.prefetch(
        ...     list(embeddings.tables.values()), [batch[0]["user"], batch[0]["item"]]))
    """
    keras_own = model.make_train_function

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        steps = int(model.steps_per_execution or 1)
        if steps <= 1 or model.run_eagerly or getattr(model, "_distribute_strategy", None) is not None:
            if prefetch is not None:
                raise ValueError("sok.keras.loop_on_host(prefetch=...) needs steps_per_execution > 1, no "
                                 "run_eagerly and no tf.distribute strategy; got steps_per_execution="
                                 f"{steps}, run_eagerly={model.run_eagerly}")
            return keras_own(force)
        model.train_function = _host_loop_function(model, steps, prefetch)
        return model.train_function

    model.make_train_function = make_train_function
    return model
