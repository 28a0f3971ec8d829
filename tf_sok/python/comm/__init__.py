"""Communication between ranks behind one interface."""
from tf_sok.python.comm.base import Communicator, KeyRouting, RoutedKeys
from tf_sok.python.comm.single import SingleProcess

__all__ = ["Communicator", "KeyRouting", "RoutedKeys", "SingleProcess", "HorovodCommunicator", "StrategyCommunicator", "NcclCommunicator"]


def __getattr__(name):
    if name == "HorovodCommunicator":  # imports Horovod only when asked for
        from tf_sok.python.comm.horovod import HorovodCommunicator

        return HorovodCommunicator
    if name == "StrategyCommunicator":
        from tf_sok.python.comm.strategy import StrategyCommunicator

        return StrategyCommunicator
    if name == "NcclCommunicator":
        from tf_sok.python.comm.nccl import NcclCommunicator

        return NcclCommunicator
    raise AttributeError(name)
