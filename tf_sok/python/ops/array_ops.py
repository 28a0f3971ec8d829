"""Array helpers that keep 64-bit integer tensors on the GPU."""
import tensorflow as tf

_BITS_AS = {tf.int64: tf.float64, tf.uint64: tf.float64}


def split(x, sizes, num: int):
    """tf.split(x, sizes, num=num), on the device x lives on for every dtype.

    TensorFlow's SplitV has no GPU kernel for 64-bit integers: placed on the CPU, it
    would copy the whole tensor to the host and every piece back, one copy and one
    wait each. The bits travel as float64 (which it has; split only moves them) and
    come back unchanged.
    """
    x = tf.convert_to_tensor(x)
    carrier = _BITS_AS.get(x.dtype)
    if carrier is None:
        return tf.split(x, sizes, num=num)
    return [tf.bitcast(p, x.dtype) for p in tf.split(tf.bitcast(x, carrier), sizes, num=num)]
