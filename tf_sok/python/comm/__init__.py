"""Communication between ranks behind one interface."""
from tf_sok.python.comm.base import Communicator
from tf_sok.python.comm.single import SingleProcess

__all__ = ["Communicator", "SingleProcess"]
