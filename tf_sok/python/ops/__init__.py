"""Python wrappers of the tf_sok custom ops, with their gradients."""
